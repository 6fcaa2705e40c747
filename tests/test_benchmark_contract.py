"""The benchmark contract, its runner and `python -m benchmarks.compare` (CPU: tiny sizes, plumbing only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "benchmarks" / "ref2va-960x544-124f.json"


def _compare(contract: Path, result: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.compare", "--contract", str(contract), "--result",
                           str(result)], cwd=ROOT, capture_output=True, text=True, timeout=60)


def _result(tmp_path, **paths) -> Path:
    r = {"contract": "ref2va-960x544-124f", "device": "NVIDIA H200", "comfyui": {"s_per_step": 3.1}, "paths": paths}
    p = tmp_path / "r.json"
    p.write_text(json.dumps(r))
    return p


def test_contract_workload_is_the_performance_workload(tmp_path):
    """The contract's S is what the benchmarks' workload geometry gives for its canvas (`bench_dit.py --dry-run`)."""
    c = json.loads(CONTRACT.read_text())
    w = c["workload"]
    out = tmp_path / "dry.json"
    p = subprocess.run([sys.executable, "benchmarks/bench_dit.py", "--dry-run", "--device", "cpu", "--width",
                        str(w["width"]), "--height", str(w["height"]), "--frames", str(w["frames"]), "--text-len",
                        str(w["text_tokens"]), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(out.read_text())["workload"]["seq_len"] == w["seq_len"] == 20050
    assert set(c["targets"]["exact"]) == {"s_per_step", "x_comfyui", "peak_gpu_gib"}


def test_compare_passes_when_every_target_is_met(tmp_path):
    ok = {"status": "ok", "s_per_step": 1.2, "peak_gpu_gib": 13.9}
    p = _compare(CONTRACT, _result(tmp_path, exact=ok, approximate=ok))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "6 of 6 targets met" in p.stdout


@pytest.mark.parametrize("exact, needle", [
    ({"status": "ok", "s_per_step": 1.96, "peak_gpu_gib": 13.0}, "MISS exact        s_per_step"),  # 0.01 s over
    ({"status": "ok", "s_per_step": 1.9, "peak_gpu_gib": 14.01}, "MISS exact        peak_gpu_gib"),
    ({"status": "ok", "s_per_step": 2.1, "peak_gpu_gib": 13.0}, "MISS exact        x_comfyui"),  # 3.1/2.1 < 1.55
    ({"status": "unavailable: no fa3"}, "MISS exact        s_per_step"),
])
def test_compare_misses_exit_nonzero(tmp_path, exact, needle):
    ok = {"status": "ok", "s_per_step": 1.2, "peak_gpu_gib": 13.9}
    p = _compare(CONTRACT, _result(tmp_path, exact=exact, approximate=ok))
    assert p.returncode == 1 and needle in p.stdout, p.stdout


def test_compare_without_same_run_comfyui_cannot_meet_ratios(tmp_path):
    ok = {"status": "ok", "s_per_step": 1.2, "peak_gpu_gib": 13.9}
    path = _result(tmp_path, exact=ok, approximate=ok)
    r = json.loads(path.read_text())
    r["comfyui"], r["comfyui_note"] = None, "no same-run ComfyUI"
    path.write_text(json.dumps(r))
    p = _compare(CONTRACT, path)
    assert p.returncode == 1 and "x_comfyui" in p.stdout and "no same-run ComfyUI" in p.stdout


@pytest.mark.parametrize("content, needle", [(None, "cannot read"), ("{", "not JSON"),
                                             ('{"contract": "other"}', "is for contract 'other'")])
def test_compare_bad_input_is_one_line_exit_2(tmp_path, content, needle):
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    p = _compare(CONTRACT, path)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_runner_smoke_writes_a_result_compare_reads(tmp_path):
    c = json.loads(CONTRACT.read_text())
    c["paths"] = {"exact": {"attention": "sdpa"}, "approximate": {"attention": "fa3"}}
    contract = tmp_path / "c.json"
    contract.write_text(json.dumps(c))
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "benchmarks.run_contract", "--contract", str(contract), "--out",
                        str(out), "--smoke", "--steps", "1", "--device", "cpu", "--no-vae"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["paths"]["exact"]["status"] == "ok" and r["paths"]["exact"]["s_per_step"] > 0
    assert r["paths"]["approximate"]["status"].startswith("unavailable:")  # fa3 needs a Hopper GPU
    assert r["comfyui"] is None and "no same-run ComfyUI" in r["comfyui_note"]
    q = _compare(contract, out)
    assert q.returncode == 1 and "no same-run ComfyUI" in q.stdout


def test_compare_reports_clock_and_power_of_each_run(tmp_path):
    gp = {"sm_clock_mhz_median": 1530.0, "sm_clock_mhz_max": 1980.0, "power_w_median": 688.0,
          "power_limit_w": 700.0, "temperature_c_median": 66.0, "power_capped_share": 0.9, "samples": 40}
    ok = {"status": "ok", "s_per_step": 1.2, "peak_gpu_gib": 13.9, "gpu_clock_power": gp}
    p = _compare(CONTRACT, _result(tmp_path, exact=ok, approximate={**ok, "gpu_clock_power": None}))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "info exact        SM clock median 1530 MHz (max seen 1980), power median 688 of 700 W, at the power " \
           "cap in 90 % of samples" in p.stdout
    assert "info approximate" not in p.stdout
