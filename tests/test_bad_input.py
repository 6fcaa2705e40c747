"""`h3direct inspect` on a corpus of malformed files: one stderr line naming the file, exit 2, no traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import malformed
import pytest

from h3direct.app.cli import main

CASES = malformed.corpus()
PY = os.environ.get("H3_PYTHON", sys.executable)


def test_corpus_is_large_enough():
    assert len(CASES) >= 15
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name.removesuffix(".safetensors") for c in CASES])
def test_malformed_file_is_one_error_line(case, tmp_path, capsys):
    path = tmp_path / case.name
    case.write(path)
    rc = main(["inspect", str(path), "--out", str(tmp_path / "reports")])
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert rc == 2, captured
    assert len(lines) == 1, lines
    assert str(path) in lines[0], lines[0]
    assert case.fragment in lines[0], lines[0]
    assert captured.out == ""
    assert not (tmp_path / "reports").exists()  # no report for a rejected file


@pytest.mark.parametrize("case", [c for c in CASES if c.safetensors_level],
                         ids=[c.name.removesuffix(".safetensors") for c in CASES if c.safetensors_level])
def test_safetensors_library_also_rejects(case, tmp_path):
    """Honest baseline: the reference `safetensors` parser refuses every file we call structurally broken."""
    from safetensors import safe_open

    path = tmp_path / case.name
    case.write(path)
    with pytest.raises(Exception):  # noqa: B017 - the library raises several types
        with safe_open(str(path), "np") as f:
            for k in f.keys():
                f.get_slice(k)


@pytest.mark.parametrize("name", ["truncated_payload.safetensors", "nvfp4_nan_block_scale.safetensors",
                                  "not_h3.safetensors"])
def test_real_process(name, tmp_path):
    """A few cases through a real interpreter: exit status 2, one line, no traceback."""
    case = next(c for c in CASES if c.name == name)
    path = tmp_path / name
    case.write(path)
    r = subprocess.run([PY, "-m", "h3direct", "inspect", str(path), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r
    assert "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and str(path) in lines[0] and case.fragment in lines[0], lines


def test_missing_file(tmp_path, capsys):
    path = tmp_path / "nope.safetensors"
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and str(path) in err[0] and "no such file" in err[0]
