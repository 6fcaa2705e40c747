"""`h3direct generate` under torchrun (sequence parallelism, gloo on the CPU) and serve's refusal of it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_generate_under_torchrun_writes_one_identical_clip(tmp_path, monkeypatch):
    """2 ranks of the bundled tiny models: rank 0 alone writes, one summary line, the same mp4 bytes as one
    process (the sharded DiT is exact here, and so is everything downstream of it)."""
    from h3direct.app.cli import main

    cache = tmp_path / "cache"
    monkeypatch.setenv("H3_CACHE_DIR", str(cache))
    single = tmp_path / "single" / "clip.mp4"
    single.parent.mkdir()
    assert main(["generate", "--prompt", "a cat", "--quiet", "-o", str(single)]) == 0

    out_dir = tmp_path / "sp"
    out_dir.mkdir()
    env = {**os.environ, "H3_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "h3direct", "generate", "--prompt", "a cat", "-o", str(out_dir / "clip.mp4")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout
    summary = json.loads(lines[0])
    assert (summary["world_size"], summary["sequence_parallel"]) == (2, "ulysses")
    assert sorted(p.name for p in out_dir.iterdir()) == ["clip.mp4"]
    assert (out_dir / "clip.mp4").read_bytes() == single.read_bytes()


def test_serve_under_torchrun_is_one_line_exit_2(monkeypatch, capsys):
    from h3direct.app.cli import main

    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchrun" in err[0], err


def test_bench_sp_tiny_under_torchrun(tmp_path):
    """benchmarks/bench_sp.py on 2 gloo ranks, tiny sizes: the fields the results note is built from, and the
    all-to-all bytes per layer as the Ulysses arithmetic gives them (2 ranks, fp32, padded to an even S)."""
    import math

    from h3direct.config import H3Config

    out = tmp_path / "bench_sp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("OUT", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "benchmarks.bench_sp", "--preset", "tiny", "--device", "cpu",
                           "--steps", "1", "--geometries", "96x64x22", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (r,) = json.loads(out.read_text())["results"]
    c = H3Config.from_name("tiny-curve")
    rows = -(-r["seq_len"] // 2)  # per rank
    inner = c.num_attention_heads * c.attention_head_dim
    # qkv: 3·rows·inner fp32 values, half of them leave; the output: 2·rows·inner/2 values, half of them leave
    assert r["a2a_bytes_per_layer"] == (3 * rows * inner + rows * inner) * 4 // 2
    # the two-Spark projection's message sizes (bf16: 2 bytes a value) are the counted ones
    proj = subprocess.run([sys.executable, "-m", "benchmarks.bench_sp", "--preset", "tiny", "--device",
                           "cpu", "--project", "--geometries", "96x64x22"], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proj.returncode == 0, proj.stderr[-2000:]
    p = json.loads(proj.stdout.strip().splitlines()[-1])
    assert p["seq_len"] == r["seq_len"] and 2 * p["bytes_per_layer"]["total"] == r["a2a_bytes_per_layer"]
    assert r["a2a_calls_per_step"] == 2 * c.num_layers
    for key in ("sp_s_per_step", "single_s_per_step", "a2a_s_per_step", "scaling_efficiency"):
        assert math.isfinite(r[key]) and r[key] > 0, (key, r[key])
    assert r["sp_vs_single_rel_l2"] == {"video": 0.0, "audio": 0.0}
