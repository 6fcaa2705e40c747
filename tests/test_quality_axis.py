"""The contract's quality axis (`benchmarks/quality.py`, `run_contract --quality-dir`), on the CPU: a case laid out
like the validation set's (ComfyUI bf16, its fp32 twin, a stand-in of its `--use-sage-attention` recording), each
path's output error against the twin in units of ComfyUI bf16's and ComfyUI+sage's, as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gate.test_gate_class_and_drift import SAGE_ERROR, _copy_case, write_sage_recording

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "benchmarks" / "ref2va-960x544-124f.json"


@pytest.fixture(scope="module")
def quality_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("validation")
    (root / "fx").mkdir()
    _copy_case(root / "fx")
    write_sage_recording(root / "fx")
    (root / "no_sage").mkdir()
    _copy_case(root / "no_sage")
    (root / "fx2").mkdir()  # the same case with a closer sage stand-in: every path's x ComfyUI+sage is larger there
    _copy_case(root / "fx2")
    write_sage_recording(root / "fx2", factor=1.0)
    return root


def _contract(tmp_path: Path, *cases: str) -> Path:
    c = json.loads(CONTRACT.read_text())
    c["paths"] = {"exact": {"class": "exact", "attention": "sdpa", "options": {"fused": False}},
                  "fp8": {"class": "approximate", "attention": "sdpa", "fp8_linear": "stream"},
                  "int8_mlp": {"class": "approximate", "attention": "sdpa", "fp8_linear": "stream",
                               "options": {"fp8_linear_format": "int8", "fp8_linear_layers": "fc1,fc2"}},
                  "gpu_only": {"class": "approximate", "attention": "fa3"}}
    c["quality"] = {"cases": list(cases or ["fx"])}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(c))
    return path


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def test_quality_measures_each_path_against_the_twin_in_comfyui_units(tmp_path, quality_dir):
    """The exact path is ComfyUI bf16's equal (×1 within the exact rule's k) and far inside ComfyUI+sage (whose
    stand-in errs sqrt(1 + 3²) × ComfyUI bf16); FP8 linears err more than the exact path, int8 on the MLP less than
    FP8 on every linear; ComfyUI's own rows: 1 and the stand-in's sqrt(10); a GPU-only path says why it did not run."""
    out = tmp_path / "q.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.quality", "--contract", str(_contract(tmp_path)),
                        "--trace-dir", str(quality_dir), "--device", "cpu", "--out", str(out)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    case = json.loads(out.read_text())["cases"][0]
    assert case["status"] == "ok" and case["case"] == "fx"
    comfy, paths = case["comfyui"], case["paths"]
    assert comfy["default"]["error_x_comfyui_bf16"] == 1.0
    assert comfy["sage"]["error_x_comfyui_bf16"] == pytest.approx((1 + SAGE_ERROR ** 2) ** 0.5, rel=0.05)
    assert comfy["sage"]["error_x_comfyui_sage"] == 1.0
    exact = paths["exact"]["error_x_comfyui_bf16"]
    assert exact <= 1.5
    fp8, int8 = paths["fp8"]["error_x_comfyui_bf16"], paths["int8_mlp"]["error_x_comfyui_bf16"]
    assert fp8 > 1.5 * exact and int8 < fp8
    for name in ("exact", "fp8", "int8_mlp"):
        q = paths[name]
        assert q["error_x_comfyui_sage"] == pytest.approx(q["error_x_comfyui_bf16"] / comfy["sage"]["error_x_comfyui_bf16"],
                                                          rel=0.05)
    assert paths["gpu_only"]["status"].startswith("unavailable:")
    assert "| ComfyUI sage |" in p.stdout and "| fp8 |" in p.stdout  # the ladder table


def test_a_case_without_its_sage_recording_is_not_measured(tmp_path, quality_dir):
    p = subprocess.run([sys.executable, "-m", "benchmarks.quality", "--contract", str(_contract(tmp_path)),
                        "--trace-dir", str(quality_dir), "--case", "no_sage", "--device", "cpu", "--paths", "exact"],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 1 and "no ComfyUI --use-sage-attention recording" in p.stdout, p.stdout + p.stderr


def _run_contract(tmp_path: Path, contract: Path, quality_dir: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "benchmarks.run_contract", "--contract", str(contract), "--out",
                        str(tmp_path / "r.json"), "--smoke", "--steps", "1", "--device", "cpu", "--no-vae",
                        "--floor-seconds", "0", "--paths", "exact,fp8", "--quality-dir", str(quality_dir)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((tmp_path / "r.json").read_text())


def _compare(tmp_path: Path, contract: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.compare", "--contract", str(contract), "--result",
                           str(tmp_path / "r.json")], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=60)


def test_run_contract_records_quality_per_case_and_compare_judges_the_worst(tmp_path, quality_dir):
    """Two cases: each path's figures on each, and its worst, which is the case whose ComfyUI+sage errs least (fx2's
    stand-in: sqrt(2) × ComfyUI bf16's own, against fx's sqrt(10)); compare takes the worst from the per-case figures
    and names the case."""
    contract = _contract(tmp_path, "fx", "fx2")
    r = _run_contract(tmp_path, contract, quality_dir)
    assert r["quality"] == {"cases": ["fx", "fx2"], "status": "ok"}
    exact, fp8 = r["paths"]["exact"]["quality"], r["paths"]["fp8"]["quality"]
    assert exact["status"] == "ok" and set(exact["cases"]) == {"fx", "fx2"}
    fx, fx2 = (exact["cases"][c]["error_x_comfyui_sage"] for c in ("fx", "fx2"))
    assert fx2 == pytest.approx(fx * (10 / 2) ** 0.5, rel=0.05)  # the same output, a smaller ComfyUI+sage error
    assert exact["error_x_comfyui_sage"] == fx2 and exact["worst_case"]["error_x_comfyui_sage"] == "fx2"
    assert exact["error_x_comfyui_bf16"] <= 1.5 and fp8["error_x_comfyui_bf16"] > 1.5
    q = _compare(tmp_path, contract)
    assert "info quality cases fx, fx2: ok" in q.stdout and "info exact        quality on fx2: x" in q.stdout, q.stdout
    assert "ok   rule   quality cases" in q.stdout, q.stdout


def test_a_case_not_measured_leaves_the_paths_without_a_figure(tmp_path, quality_dir):
    """A case of the contract without its sage recording: the others are measured, the run says which case was not,
    and compare misses every quality target naming that case (the worst may be the one missing)."""
    contract = _contract(tmp_path, "fx", "no_sage")
    r = _run_contract(tmp_path, contract, quality_dir)
    assert r["quality"]["status"].startswith("not measured on no_sage: ")
    exact = r["paths"]["exact"]["quality"]
    assert exact["cases"]["fx"]["error_x_comfyui_sage"] > 0 and exact["error_x_comfyui_sage"] is None
    assert exact["status"].startswith("case no_sage: not measured")
    c = json.loads(contract.read_text())
    c["targets"] = {"exact": {"error_x_comfyui_bf16": {"max": 1.5}}}
    contract.write_text(json.dumps(c))
    q = _compare(tmp_path, contract)
    assert q.returncode == 1 and "MISS exact" in q.stdout and "(quality: case no_sage: not measured" in q.stdout, q.stdout


@pytest.mark.parametrize("flags, code, needle", [
    (["--case", "nope"], 1, "no ComfyUI bf16 trace with its fp32 twin (not a case of the validation set either)"),
    (["--paths", "exact,nope"], 2, "--paths: nope not a path of the contract"),
    (["--contract", "/nonexistent.json"], 2, "--contract /nonexistent.json"),
])
def test_quality_bad_input(tmp_path, quality_dir, flags, code, needle):
    """A bad flag is one line and exit 2; a case that is not there is its status and exit 1."""
    base = {"--contract": str(_contract(tmp_path)), "--trace-dir": str(quality_dir), "--device": "cpu"}
    base.update(zip(flags[::2], flags[1::2]))
    p = subprocess.run([sys.executable, "-m", "benchmarks.quality", *(a for kv in base.items() for a in kv)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == code and needle in p.stdout + p.stderr, p.stdout + p.stderr
    if code == 2:
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
