"""A trace recorded under any name into any folder is gated there: its manifest names its checkpoint and inputs file
with where they were recorded from and their sha256 (`oracle record`), so nothing needs copying beside it; a trace
whose files are nowhere, and any other file of the folder the gate cannot use, is named in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from parity_tests.discovery import FIXTURES, find_dit_cases
from tests.gate.test_gate_options import _pytest

CASE = "trace_fx_curve_bf16_t2va_mask_fp32"


def _recorded(folder: Path, name: str, **manifest) -> Path:
    """The fixture case's trace as `oracle record --out folder/name.safetensors` writes it now: the manifest names
    the checkpoint and inputs by name, sha256 and the absolute path they were read from."""
    from oracle.record import file_fields

    folder.mkdir(parents=True, exist_ok=True)
    m = json.loads((FIXTURES / f"{CASE}.json").read_text())
    m.update(file_fields("checkpoint", FIXTURES / m["checkpoint"]), **file_fields("inputs", FIXTURES / m["inputs"]))
    m.update(manifest)
    shutil.copy(FIXTURES / f"{CASE}.safetensors", folder / f"{name}.safetensors")
    (folder / f"{name}.json").write_text(json.dumps(m))
    return folder / f"{name}.safetensors"


def test_the_manifest_names_each_file_by_name_sha256_and_path():
    from h3direct.traces.pairing import file_sha256
    from oracle.record import file_fields

    path = FIXTURES / "h3_fx_bf16.safetensors"
    assert file_fields("checkpoint", path) == {"checkpoint": path.name, "checkpoint_sha256": file_sha256(path),
                                               "checkpoint_path": str(path.resolve())}


def test_a_trace_under_any_name_is_gated_where_it_was_written(tmp_path):
    trace = _recorded(tmp_path / "my traces", "run 1 (t2va mask)")
    cases, problems = find_dit_cases([trace.parent])
    assert not problems and len(cases) == 1, problems
    assert cases[0].checkpoint.parent == FIXTURES and cases[0].inputs.parent == FIXTURES
    r = _pytest(["-m", "parity", "--trace-dir", str(trace.parent), "-k", "test_dit_layers and teacher or planted"],
                tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 passed" in r.stdout and f"dit 1/1, vae 0/0, generate 0/0; roots: {trace.parent}" in r.stdout, r.stdout


def test_a_trace_whose_files_are_nowhere_is_named_in_one_line(tmp_path):
    folder = tmp_path / "traces"
    trace = _recorded(folder, "lost", checkpoint_path=str(tmp_path / "moved" / "ckpt.safetensors"))
    _, problems = find_dit_cases([folder])
    assert len(problems) == 1 and problems[0].startswith(f"{trace}: checkpoint "), problems
    assert "not found beside the trace" in problems[0] and str(tmp_path / "moved") in problems[0], problems
    r = _pytest(["-m", "parity", "--trace-dir", str(folder)], tmp_path)  # the folder's only trace: nothing to gate
    assert r.returncode == 4 and "no DiT, VAE or generation trace case found" in r.stdout + r.stderr, r.stdout
    assert f"not gated: {problems[0]}" in r.stdout + r.stderr, r.stdout + r.stderr


def test_every_file_the_gate_cannot_use_is_named(tmp_path):
    folder = tmp_path / "traces"
    _recorded(folder, "good")
    (folder / "notes.json").write_text(json.dumps({"comment": "mine"}))
    shutil.copy(FIXTURES / f"{CASE}.safetensors", folder / "orphan.safetensors")  # tensors without a manifest
    (folder / "half.json").write_text((FIXTURES / f"{CASE}.json").read_text())  # a manifest without tensors
    r = _pytest(["-m", "parity", "--trace-dir", str(folder), "-k", "test_dit_layers and teacher"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("not gated: ")]
    assert lines == [f"not gated: {folder / 'half.json'}: a trace manifest without its tensors (half.safetensors)",
                     f"not gated: {folder / 'notes.json'}: not a trace manifest (no `kind`, no detected DiT config)",
                     f"not gated: {folder / 'orphan.safetensors'}: no manifest beside it (orphan.json): not a trace "
                     f"the gate can read"], r.stdout


@pytest.mark.parametrize("moved", ["beside", "recorded"])
def test_a_copy_beside_the_trace_wins_and_the_sha256_picks(tmp_path, moved):
    """The ../shared/oracle layout keeps working (files beside the trace by name); where both exist, the one whose
    sha256 the manifest recorded is used."""
    folder = tmp_path / "traces"
    trace = _recorded(folder, "t")
    m = json.loads(trace.with_suffix(".json").read_text())
    beside = folder / m["checkpoint"]
    if moved == "beside":
        shutil.copy(FIXTURES / m["checkpoint"], beside)
    else:  # another file of that name beside it: the recorded path (right sha256) is used instead
        shutil.copy(FIXTURES / "h3_fx_curve_nvfp4.safetensors", beside)
    cases, problems = find_dit_cases([folder])
    assert not problems and len(cases) == 1, problems
    assert cases[0].checkpoint == (beside if moved == "beside" else FIXTURES / m["checkpoint"])
