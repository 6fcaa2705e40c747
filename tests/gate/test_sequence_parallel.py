"""The parity gate per world size: Ulysses sequence parallelism (`h3direct.dit.parallel`) on the CPU, gloo.

`h3direct trace` runs under torchrun with 2 processes (the issue's done-when command) and its gathered trace
is gated against ComfyUI's fp32 trace and against the single-process h3direct trace, through the gate's own
comparison (`parity_tests.gate.gate_tensors`, budgets from budgets.toml). The sharded layers are also
teacher-forced (`parity_tests.sp_worker`: the attention core between the two all-to-alls, the sharded
attention module, whole blocks, the inner forward). Padding rows (S not divisible by the world size) and a
world size that does not divide the heads are covered too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity_tests.discovery import FIXTURES, SHARED_ORACLE, DitCase, find_dit_cases
from parity_tests.gate import gate_tensors

ROOT = Path(__file__).resolve().parents[2]
# t2va + ref2va, bf16 + NVFP4 checkpoints, fp32 compute: the shared set when it sits beside the checkout (plus
# a curve-adaLN case with seven interleaved segments, so modulation runs straddle the slice boundary), else the
# committed fixtures (bf16 ref2va, curve NVFP4 ref2va, curve t2va with a denoise mask). The teacher-forced run
# adds fl2va (keyframe condition rows) to the shared set.
SHARED = ("trace_bf16_t2va_fp32", "trace_bf16_ref2va_fp32", "trace_nvfp4_t2va_fp32", "trace_nvfp4_ref2va_fp32",
          "trace_curve_bf16_ref2va_av_fp32")
SHARED_TEACHER = (*SHARED, "trace_curve_bf16_fl2va_fp32")
FIXTURE = ("trace_fx_bf16_ref2va_fp32", "trace_fx_curve_nvfp4_ref2va_fp32", "trace_fx_curve_bf16_t2va_mask_fp32")


def _cases(shared: tuple[str, ...]) -> list[DitCase]:
    root, stems = (SHARED_ORACLE, shared) if SHARED_ORACLE.is_dir() else (FIXTURES, FIXTURE)
    found = {c.trace.stem: c for c in find_dit_cases([root])[0]}
    return [found[s] for s in stems if s in found]


CASES = _cases(SHARED)
TEACHER_CASES = _cases(SHARED_TEACHER)


def _torchrun(nproc: int, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _sharded_trace(case: DitCase, out: Path, nproc: int, inputs: Path | None = None):
    proc = _torchrun(nproc, "-m", "h3direct", "trace", "--checkpoint", str(case.checkpoint), "--inputs",
                     str(inputs or case.inputs), "--compute-dtype", "fp32", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    from h3direct.traces.format import load_trace

    return load_trace(out)


def _single_trace(case: DitCase, out: Path, inputs: Path | None = None):
    """The same evaluation in this process (no process group): the single-process h3direct trace."""
    from h3direct.dit.loader import load_dit
    from h3direct.dit.tracing import Tracer
    from h3direct.traces.evaluate import one_step
    from h3direct.traces.format import load_trace, save_trace
    from h3direct.traces.inputs import load_inputs

    model = load_dit(case.checkpoint, compute_dtype="fp32", nvfp4_mode="w4a16")
    with torch.no_grad(), Tracer(model) as tracer:
        one_step(model, load_inputs(inputs or case.inputs))
    save_trace(out, tracer.tensors, {"producer": "h3direct"})
    return load_trace(out)


def _outputs(trace) -> dict[str, torch.Tensor]:
    return {n: trace.get(n) for n in trace.names_in_order()}


# world size 2 for every case; 4 for one ref2va case (shared: S = 74, so the last rank carries 2 padding rows)
WORLDS = [(c, 2) for c in CASES] + [(c, 4) for c in CASES if "ref2va" in c.task][:1]


@pytest.mark.parametrize(("case", "world"), WORLDS, ids=[f"{c.trace.stem}-x{w}" for c, w in WORLDS])
def test_torchrun_trace_matches_comfyui_and_single_process(case, world, tmp_path):
    sharded = _sharded_trace(case, tmp_path / "sp.safetensors", world)
    manifest = json.loads((tmp_path / "sp.json").read_text())
    assert (manifest["world_size"], manifest["sequence_parallel"]) == (world, "ulysses")

    vs_comfy = gate_tensors(case, _outputs(sharded), title=f"{case.id} [free, torchrun x{world}] vs ComfyUI")
    assert any(r.kind == "output" for r in vs_comfy.layers), vs_comfy.skipped
    assert vs_comfy.passed, vs_comfy.report()

    single = _single_trace(case, tmp_path / "single.safetensors")
    vs_single = gate_tensors(case, _outputs(sharded), reference=single,
                             title=f"{case.id} [free, torchrun x{world}] vs single process")
    assert len(vs_single.layers) == len(single.names_in_order())
    assert vs_single.passed, vs_single.report()


@pytest.mark.gpu2
def test_torchrun_trace_on_two_gpus(tmp_path):
    """NCCL: the same gate on 2 GPUs, against ComfyUI's CPU trace and the 1-GPU trace (fp32 budget)."""
    case = CASES[0]
    traces = {}
    for n in (1, 2):
        out = tmp_path / f"x{n}.safetensors"
        proc = _torchrun(n, "-m", "h3direct", "trace", "--device", "cuda", "--checkpoint", str(case.checkpoint),
                         "--inputs", str(case.inputs), "--compute-dtype", "fp32", "--out", str(out))
        assert proc.returncode == 0, proc.stderr[-3000:]
        from h3direct.traces.format import load_trace

        traces[n] = load_trace(out)
    for ref, what in ((None, "ComfyUI"), (traces[1], "1 GPU")):
        r = gate_tensors(case, _outputs(traces[2]), reference=ref, title=f"{case.id} [2 GPUs] vs {what}")
        assert r.passed, r.report()


def test_sharded_layers_teacher_forced(tmp_path):
    """Every sharded site fed ComfyUI's recorded inputs, within the same budgets (2 ranks, all cases at once)."""
    out = tmp_path / "teacher.json"
    proc = _torchrun(2, "-m", "parity_tests.sp_worker", "--out", str(out), *(str(c.trace) for c in TEACHER_CASES))
    assert out.is_file(), proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for case in TEACHER_CASES:
        r = results[case.id]
        names = {x["name"] for x in r["layers"]}
        assert {"blocks.0.attn.out_proj.in", "blocks.0.attn.out", "dit_inner.out.video"} <= names, names
        assert r["passed"], r["report"]
    assert proc.returncode == 0, proc.stdout[-3000:]


def _odd_text_inputs(case: DitCase, path: Path) -> Path:
    """The case's inputs with one text token dropped, so the packed length is odd (padding on 2 ranks)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(case.inputs), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != "layout_position_ids_f64"}
    tensors["text_states"] = tensors["text_states"][:, :-1].contiguous()
    tensors["token_tags"] = tensors["token_tags"][:-1].contiguous()
    save_file(tensors, str(path), metadata=meta)
    return path


def test_padding_rows_do_not_change_results(tmp_path):
    """S odd on 2 ranks: the last rank carries a padding row; the gathered trace equals the single-process one
    within the fp32 budget at every recorded tensor."""
    from h3direct.dit.loader import load_dit
    from h3direct.traces.evaluate import conditioning_of
    from h3direct.traces.inputs import load_inputs

    case = next(c for c in CASES if "ref2va" in c.task)
    inputs = _odd_text_inputs(case, tmp_path / "inputs_odd.safetensors")
    loaded = load_inputs(inputs)
    model = load_dit(case.checkpoint, compute_dtype="fp32", nvfp4_mode="w4a16")
    video = loaded["video_latent"]
    layout = model.layout_for(loaded["text_states"].shape[1], video, loaded["audio_latent"], conditioning_of(loaded))
    assert layout.seq_len % 2 == 1, layout.seq_len

    sharded = _sharded_trace(case, tmp_path / "sp2.safetensors", 2, inputs)
    single = _single_trace(case, tmp_path / "single.safetensors", inputs)
    odd = DitCase(tmp_path / "single.safetensors", case.checkpoint, inputs, "fp32", case.weights, case.task, None)
    result = gate_tensors(odd, _outputs(sharded), reference=single, title="odd S [torchrun x2] vs single process")
    assert len(result.layers) == len(single.names_in_order())
    assert result.passed, result.report()


def test_gate_catches_misordered_slices(tmp_path):
    """The gate can fail: the sharded output with its two rank slices swapped (an all-to-all ordering bug)."""
    case = CASES[0]
    single = _single_trace(case, tmp_path / "single.safetensors")
    ours = _outputs(single)
    v = ours["final_layer.video_out.out"]
    half = v.shape[0] // 2
    ours["final_layer.video_out.out"] = torch.cat([v[half:], v[:half]])
    result = gate_tensors(case, ours)
    assert not result.passed
    assert result.first_failure.name == "final_layer.video_out.out"


def test_world_size_not_dividing_heads_is_one_line_exit_2(tmp_path):
    case = CASES[0]
    proc = _torchrun(3, "-m", "h3direct", "trace", "--checkpoint", str(case.checkpoint), "--inputs",
                     str(case.inputs), "--out", str(tmp_path / "t.safetensors"))
    # torchrun exits 1 when a worker fails; the first worker to fail (its "root cause") exited 2 with one line.
    # (torchrun may SIGTERM the other ranks before they reach their own exit 2.)
    assert proc.returncode != 0
    root_cause = proc.stderr.split("Root Cause")[-1]
    assert "exitcode  : 2" in root_cause, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "h3direct trace: error:" in ln]
    assert lines and all("attention heads are not divisible by 3" in ln for ln in lines), proc.stderr
    assert "/h3direct/" not in proc.stderr  # no traceback from our code (torchrun prints its launcher's own)
    assert not (tmp_path / "t.safetensors").exists()


def test_sequence_parallel_flag_outside_torchrun_is_one_line_exit_2(tmp_path):
    from h3direct.app.cli import main

    case = CASES[0]
    rc = main(["trace", "--checkpoint", str(case.checkpoint), "--inputs", str(case.inputs), "--sequence-parallel",
               "2", "--out", str(tmp_path / "t.safetensors")])
    assert rc == 2
