"""Smoke tests of the benchmark scripts (`benchmarks/`): tiny preset on the CPU, a few seconds each.

Speed is never asserted; the JSON each script writes must carry its fields with finite numbers. The workload
arithmetic is checked against the numbers PERFORMANCE.md states (S = 20,050; 772.6 + 576.3 TFLOP per step). The
scripts run as a user runs them, in a subprocess (no test imports from benchmarks/).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(script: str, tmp_path: Path, *extra: str, preset: str = "tiny") -> dict:
    out = tmp_path / f"{script}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{script}", "--preset", preset, "--device", "cpu",
                           "--out", str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert out.is_file(), proc.stdout[-2000:]
    return json.loads(out.read_text())


def _finite(x, what: str) -> None:
    assert isinstance(x, int | float) and not isinstance(x, bool), f"{what} = {x!r} is not a number"
    assert math.isfinite(x), f"{what} = {x!r} is not finite"


def test_workload_matches_performance_md(tmp_path):
    """`bench_dit.py --preset full --dry-run` (builds nothing): the workload's latents, rows, S and FLOP per step
    are PERFORMANCE.md's, and S agrees with h3direct's packed layout."""
    d = _run("bench_dit", tmp_path, "--dry-run", preset="full")
    wl = d["workload"]
    assert wl["video_latent"] == [1, 24, 37, 34, 60] and wl["audio_latent"] == [1, 32, 2, 207]
    assert wl["rows"] == {"text": 256, "ref_image": 510, "audio": 414, "video": 18870}
    assert wl["seq_len"] == wl["seq_len_layout"] == 20050
    f = d["flops_per_step"]
    assert abs(f["block_linears_tflop"] - 772.6) < 0.05 and abs(f["attention_tflop"] - 576.3) < 0.05


def test_bench_dit_tiny(tmp_path):
    d = _run("bench_dit", tmp_path, "--attention", "sdpa,cudnn_sdpa", "--steps", "2")
    assert d["workload"]["seq_len"] == d["workload"]["seq_len_layout"]
    for key in ("block_linears_tflop", "attention_tflop", "total_tflop"):
        _finite(d["flops_per_step"][key], key)
    k = d["kernels"]
    for m in k["matmul"] + k["block_gemms"]:
        _finite(m["ms"], m["name"])
        _finite(m["tflops"], m["name"])
    att = {a["backend"]: a for a in k["attention"]}
    _finite(att["sdpa"]["ms"], "sdpa ms")
    assert "skipped" in att["cudnn_sdpa"]  # no CUDA here: skipped with the reason, not an error
    _finite(k["nvfp4_dequant_per_step_ms"], "dequant")
    ok = [c for c in d["configs"] if c["status"] == "ok"]
    assert {(c["weights"], c["attention"]) for c in ok} == {("nvfp4", "sdpa"), ("bf16", "sdpa")}
    for c in ok:
        assert len(c["step_s"]) == 2 and c["finite"] is True
        for key in ("step_s_median", "warmup_s", "tflops", "vs_comfyui_speedup", "vs_floor_ratio", "build_s"):
            _finite(c[key], key)
    skipped = [c for c in d["configs"] if c["status"] == "skipped"]
    assert skipped and all(c["reason"] for c in skipped)
    assert not d["errors"], d["errors"]
    assert {b["weights"] for b in d["builds"]} == {"nvfp4", "bf16"}


def test_bench_dit_budget_skips(tmp_path):
    d = _run("bench_dit", tmp_path, "--budget-seconds", "0", "--attention", "sdpa")
    assert d["kernels"] == {} and any(s["what"] == "kernels" for s in d["skipped"])
    assert [c["status"] for c in d["configs"]] == ["skipped", "skipped"]
    assert all(c["reason"] == "budget" for c in d["configs"])


def test_bench_vae_tiny(tmp_path):
    d = _run("bench_vae", tmp_path)
    vd, ve, ad = d["video_decode"], d["video_encode_image"], d["audio_decode"]
    assert vd["status"] == ve["status"] == ad["status"] == "ok"
    assert vd["pixels"] == [1, d["workload"]["frame_count"], 64, 64, 3] and vd["finite"]
    assert ve["latent"] == [1, 24, 1, 4, 4] and ve["finite"]
    assert ad["waveform"] == [1, 800 * d["workload"]["audio_latent"][-1], 2] and ad["finite"]
    for part in (vd, ve, ad):
        for key in ("build_s", "warmup_s", "median_s", "model_gib"):
            _finite(part[key], key)


def _check_generate(d: dict) -> None:
    assert d["end_to_end_complete"] is True, d["errors"]
    _finite(d["end_to_end_s"], "end_to_end_s")
    assert len(d["step_s"]) == 2
    for s in d["step_s"]:
        _finite(s, "step")
    for name in d["e2e_stages"]:
        assert d["stages"][name]["status"] == "ok", name
        _finite(d["stages"][name]["s"], name)
    o = d["outputs"]
    assert o["latent_video"] == d["workload"]["video_latent"] and o["latent_audio"] == d["workload"]["audio_latent"]
    assert o["pixels"] == [1, d["workload"]["frame_count"], 64, 64, 3]
    assert o["waveform"] == [1, 800 * d["workload"]["audio_latent"][-1], 2]
    assert o["latent_finite"] and o["pixels_finite"] and o["waveform_finite"]


def test_bench_generate_tiny_pieces(tmp_path):
    d = _run("bench_generate", tmp_path, "--steps", "2", "--driver", "pieces")
    assert d["driver"] == "pieces"
    _check_generate(d)
    assert d["seq_len_layout"] == d["workload"]["seq_len"]


def test_bench_generate_tiny_pipeline(tmp_path):
    d = _run("bench_generate", tmp_path, "--steps", "2")
    assert d["driver"] == "pipeline"
    _check_generate(d)


def test_bench_residency_tiny(tmp_path):
    """The moves of each policy, as README's table states them: offload loads once into host memory, then every
    request moves the encoder to the device and back; unload holds nothing, and every request reads the file to the
    device and frees it. Each move timed; the encoder's bytes held between requests only under offload."""
    d = _run("bench_residency", tmp_path, "--cycles", "2", "--weights", "nvfp4,bf16")
    assert set(d["formats"]) == {"nvfp4", "bf16"}
    for weights, entry in d["formats"].items():
        _finite(entry["file_gib"], f"{weights} file_gib")
        off, unl = entry["policies"]["offload"], entry["policies"]["unload"]
        assert [(m["step"], m["move"], m["where"]) for m in off["moves"]] == [
            ("start", "load", "host"), ("acquire", "to_device", "device"), ("release", "to_host", "host"),
            ("acquire", "to_device", "device"), ("release", "to_host", "host")]
        assert [(m["step"], m["move"], m["where"]) for m in unl["moves"]] == [
            ("start", "none", "unloaded"), ("acquire", "load", "device"), ("release", "free", "unloaded"),
            ("acquire", "load", "device"), ("release", "free", "unloaded")]
        assert (off["loads"], unl["loads"]) == (1, 2)
        assert off["encoder_gib_between_requests"] > 0 and unl["encoder_gib_between_requests"] is None
        for policy in (off, unl):
            for m in policy["moves"][1:]:
                _finite(m["seconds"], f"{weights} {m['move']} seconds")
        assert set(off["median_s"]) == {"to_device", "to_host"} and set(unl["median_s"]) == {"load", "free"}


@pytest.mark.parametrize("flags", [("--weights", "fp8"), ("--policies", "resident"), ("--cycles", "0"),
                                   ("--dir", "/nonexistent/h3")])
def test_bench_residency_bad_flags(flags, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_residency", "--preset", "tiny", "--device", "cpu",
                           "--out", str(tmp_path / "r.json"), *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2 and not (tmp_path / "r.json").exists()


def test_bench_serve_tiny(tmp_path):
    """benchmarks/bench_serve.py end to end on the CPU: files written, `h3direct serve` started, /ready recorded,
    one Ref2VA request answered with an mp4 of the asked size, SIGTERM -> exit 0."""
    import av  # noqa: F401  (the media extra; bench_serve.py writes and reads the mp4 in a child process)
    import fastapi  # noqa: F401  (the serve extra; the child starts `h3direct serve`)
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_serve", "--preset", "tiny", "--device", "cpu",
                           "--requests", "sdpa", "--out", str(out), "--work", str(tmp_path / "work")], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "bench_serve.json").read_text())
    assert data["failures"] == [] and data["exit_code"] == 0
    mem = data["ready_before"]["memory"]
    assert mem["kind"] == "cpu_rss" and mem["rss_bytes"] > 0
    assert set(data["ready_before"]["components"]) == {"dit", "video_vae", "audio_vae", "text_encoder"}
    assert data["ready_before"]["components"]["dit"]["quantization"].startswith("nvfp4")
    (req,) = data["requests"]
    assert req["status"] == 200 and req["response"]["task"] == "ref2va"
    assert req["mp4"]["video_frames"] == 22 and (req["mp4"]["width"], req["mp4"]["height"]) == (64, 64)
    assert req["mp4"]["audio_streams"] == 1
    for stage in ("conditioning", "sample", "decode_video", "decode_audio", "write", "total"):
        _finite(req["response"]["timings"][stage], stage)
    assert len(req["response"]["step_seconds"]) == 2
    assert data["ready_after"]["queue"]["completed"] == 1
    assert not (tmp_path / "work" / "dit_nvfp4.safetensors").exists()  # model files removed at the end


SHELL_SCRIPTS = sorted(str(p.relative_to(ROOT)) for pattern in ("benchmarks/*.sh", "fixtures/*.sh", "tools/*.sh",
                                                                  "docker/*.sh") for p in ROOT.glob(pattern))


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse_and_run_directly(script):
    """Every shell script parses; those the docs run as `path/to/x.sh` (all but the sourced `_*.sh`) are executable."""
    proc = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    if not Path(script).name.startswith("_"):
        assert os.access(ROOT / script, os.X_OK), f"{script} lost its executable bit"


def test_attention_kernels_cpu(tmp_path):
    out = tmp_path / "attn.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.attention_kernels", "--device", "cpu", "--seq", "256",
                           "--heads", "2", "--backends", "sdpa,fa3", "--iters", "2", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["sdpa"]["status"] == "ok" and rows["sdpa"]["finite_structured"] and rows["sdpa"]["finite_random"]
    for key in ("ms", "rel_l2_structured", "rel_l2_random"):
        _finite(rows["sdpa"][key], f"sdpa {key}")
    assert rows["fa3"]["status"].startswith("unavailable: "), rows["fa3"]


def test_int8_gemm_smoke_times_the_gemms_and_the_stream_weights(tmp_path):
    """benchmarks/int8_gemm.py --smoke: the int8 kernel bitwise its exact emulation and the rotated weight conversion
    bitwise its torch reference on every block shape (small, through Triton's interpreter), each timing finite."""
    pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86_64 Linux)")
    out = tmp_path / "i8.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.int8_gemm", "--smoke", "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert set(r["shapes"]) == {"qkv_proj", "out_proj", "fc1", "fc2"}
    for name, row in r["shapes"].items():
        assert row["bitwise_int8"] and row["bitwise_rotated_weight"], name
        assert set(row["weight_ms"]) == {"int8", "int8_rotated", "int8_rotated_torch"}, name
        assert set(row["input_ms"]) == {"int8", "int8_rotated", "int8_rotated_torch"}, name
        for part in ("ms", "weight_ms", "input_ms"):
            for what, ms in row[part].items():
                _finite(ms, f"{name} {part} {what}")
    assert set(r["block_weight_ms"]) == set(r["block_input_ms"]) == {"int8", "int8_rotated", "int8_rotated_torch"}
