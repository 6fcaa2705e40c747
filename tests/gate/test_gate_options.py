"""The gate's command line, as a user runs it: pytest started in another folder, traces kept outside the checkout,
`--trace-dir DIR` and `--trace-dir=DIR`, relative and absolute; an empty root is a failure, not a green run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "fixtures"
CASE = "trace_fx_curve_bf16_t2va_mask_fp32"


def _plugin_args() -> list[str]:
    """Nothing when the pytest11 entry point is installed (CI: pip install -e .), else load the plugin by name."""
    eps = entry_points(group="pytest11")
    return [] if any(ep.name == "parity_tests.plugin" for ep in eps) else ["-p", "parity_tests.plugin"]


def _pytest(args: list[str], cwd: Path, plugins: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """pytest in a subprocess started in `cwd`; `plugins`: {module name: source} written under cwd/plugins and
    loaded with -p (a test's patch of the run it starts)."""
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    if plugins:
        folder = cwd / "plugins"
        folder.mkdir(exist_ok=True)
        for name, source in plugins.items():
            (folder / f"{name}.py").write_text(source)
        path.insert(0, str(folder))
        args = [a for name in plugins for a in ("-p", name)] + list(args)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    cmd = [sys.executable, "-m", "pytest", *_plugin_args(), "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def outside_root(tmp_path_factory) -> Path:
    """A trace folder outside the checkout: one fixture DiT trace with its checkpoint and inputs."""
    import json

    root = tmp_path_factory.mktemp("traces_elsewhere")
    m = json.loads((FIXTURES / f"{CASE}.json").read_text())
    for name in (f"{CASE}.json", f"{CASE}.safetensors", m["checkpoint"], m["inputs"]):
        shutil.copy(FIXTURES / name, root / name)
    return root


@pytest.mark.parametrize("form", ["space", "equals", "relative"])
def test_trace_dir_outside_the_checkout_from_another_folder(outside_root, form, tmp_path):
    cwd = outside_root.parent if form == "relative" else tmp_path
    value = outside_root.name if form == "relative" else str(outside_root)
    opt = [f"--trace-dir={value}"] if form == "equals" else ["--trace-dir", value]
    r = _pytest(["-m", "parity", *opt, "-k", "test_dit_layers and teacher", str(REPO / "parity_tests")], cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 passed" in r.stdout, r.stdout[-2000:]
    assert f"dit 1/1, vae 0/0, generate 0/0; roots: {outside_root}" in r.stdout, r.stdout[-2000:]


def test_trace_dir_repeated_and_pytest_started_in_the_checkout(outside_root, tmp_path):
    (tmp_path / "b").mkdir()
    for p in outside_root.iterdir():
        shutil.copy(p, tmp_path / "b" / p.name)
    r = _pytest(["-m", "parity", "--trace-dir", str(outside_root), "--trace-dir", str(tmp_path / "b"), "--co"], REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "dit 0/2" in r.stdout, r.stdout[-2000:]


def test_empty_trace_dir_fails_with_one_line(tmp_path):
    empty = tmp_path / "nothing_here"
    empty.mkdir()
    r = _pytest(["-m", "parity", "--trace-dir", str(empty), str(REPO / "parity_tests")], tmp_path)
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.startswith("ERROR:")]
    assert len(lines) == 1 and "no DiT, VAE or generation trace case found in" in lines[0] and str(empty) in lines[0], \
        r.stdout[-2000:] + r.stderr[-2000:]


def test_missing_trace_dir_is_a_usage_error(tmp_path):
    r = _pytest(["-m", "parity", "--trace-dir", str(tmp_path / "typo"), str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"--trace-dir: not a directory: {tmp_path / 'typo'}" in r.stderr + r.stdout


@pytest.mark.parametrize("option, words", [("sol_tau=x", "--option sol_tau='x': must be a number"),
                                           ("fused=0", "--option fused: not a backend's option")])
def test_a_bad_backend_option_is_a_usage_error(tmp_path, option, words):
    r = _pytest(["-m", "parity", "--attention", "sol_attn", "--option", option, str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert words in r.stderr + r.stdout and "Traceback" not in r.stderr + r.stdout


def test_an_option_the_backend_never_reads_is_a_usage_error(tmp_path):
    """`--option sol_tau=2.0` beside sdpa used to run sdpa and label the report "sdpa (sol_tau=2)"."""
    r = _pytest(["-m", "parity", "--option", "sol_tau=2.0", str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert "--option sol_tau: an option of sol_attn, which attention sdpa does not run" in r.stderr + r.stdout
    assert "Traceback" not in r.stderr + r.stdout


@pytest.mark.parametrize("flags, words", [
    (["--fp8-linear-layers", "fc1"], "--fp8-linear-layers: needs --fp8-linear"),
    (["--fp8-linear-format", "int8"], "--fp8-linear-format: needs --fp8-linear"),
    (["--fp8-linear", "--fp8-linear-layers", "fc1,fc9"], "--fp8-linear-layers 'fc1,fc9': a comma list of qkv_proj"),
    (["--fp8-linear", "--fp8-linear-format", "int4"], "invalid choice: 'int4'")])
def test_bad_fp8_linear_flags_are_usage_errors(tmp_path, flags, words):
    r = _pytest(["-m", "parity", *flags, str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 4, r.stdout[-2000:] + r.stderr[-2000:]
    assert words in r.stderr + r.stdout and "Traceback" not in r.stderr + r.stdout


def test_under_xdist_the_summary_and_the_report_are_the_whole_runs(tmp_path):
    """`-n 2` (what the README's test command runs): every worker's cases reach one parity report and one summary
    line, and the deselections are explained as without workers."""
    import json

    pytest.importorskip("xdist", reason="pytest-xdist is not installed (the test extra has it)")
    report = tmp_path / "report"
    r = _pytest(["-n", "2", "-m", "parity or gpu", "-k", "test_dit_layers and teacher or int_mm",
                 "--parity-report", str(report), str(REPO / "parity_tests"), str(REPO / "tests" / "test_int8_linear.py")],
                tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    cases = {json.loads(line)["case"] for line in (report / "results.jsonl").read_text().splitlines()}
    found = [line for line in r.stdout.splitlines() if line.startswith("parity cases run (of found): dit ")]
    counts = re.match(r"parity cases run \(of found\): dit (\d+)/(\d+)(?: \((\d+) traces\))?", found[0]) if found else None
    assert counts is not None, r.stdout[-2000:]
    ran, of, traces = int(counts[1]), int(counts[2]), int(counts[3] or counts[2])  # a bf16 trace and its twin: 1 case
    assert ran == of and traces >= 2 and len(cases) == traces, (found, sorted(cases))
    if not __import__("torch").cuda.is_available():
        # (the count is test_int8_linear.py's GPU tests: any, explained once, as without workers)
        said = re.findall(r"^([1-9][0-9]*) GPU test\(s\) deselected: no CUDA device here", r.stdout, re.M)
        assert len(said) == 1, r.stdout[-2000:]


def test_started_outside_the_checkout_without_a_test_path_runs_the_gate(outside_root, tmp_path):
    """`pytest -m parity --trace-dir DIR` from another folder, nothing else: the installed gate runs on DIR."""
    r = _pytest(["-m", "parity", "--trace-dir", str(outside_root), "-k", "test_dit_layers and teacher"], tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "1 passed" in r.stdout and f"dit 1/1, vae 0/0, generate 0/0; roots: {outside_root}" in r.stdout
