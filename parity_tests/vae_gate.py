"""The VAE part of the gate: h3direct's public VAE path (`h3direct trace-vae`) against one ComfyUI VAE trace.

Every key the ComfyUI trace recorded (`<case>.<module path>[#k].in|out`, `<case>.vae_decode.out`, ...) is compared
under the budgets table (mode "vae", compute = the VAE dtype, weights "vae"): fp32 by the fp32 rule, fp16 by the
ratio rule against ComfyUI's fp32 twin trace. Decoded video also reports its per-frame PSNR and SSIM and decoded
audio its waveform SNR (what the rule on the decoded tensor means for a viewer or a listener).

Plain Python, like gate.py:

    from parity_tests.vae_gate import run_vae_case
    print(run_vae_case(case).report())
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from h3direct.traces import metrics
from h3direct.traces.format import Trace, load_trace
from parity_tests.budgets import BudgetTable, Measured, load_budgets, verdict
from parity_tests.discovery import VaeCase
from parity_tests.results import CaseResult, LayerResult, ReplayContext, command, replay_request

FINAL_SUFFIXES = (".vae_decode.out", ".vae_encode.out")


def VaeCaseResult(case: VaeCase, attention: str) -> CaseResult:  # noqa: N802 (a CaseResult for a VAE trace)
    return CaseResult(case, "vae", attention, title=f"{case.id} [vae {case.kind}, {case.dtype}]", unit="key")


@lru_cache(maxsize=16)
def _trace(path: str) -> Trace:
    return load_trace(path)


@lru_cache(maxsize=8)
def h3direct_trace(weights: str, config: str, inputs: str, dtype: str, op: str) -> Trace:
    """Run `h3direct trace-vae` (its own `run`, in process) and read back what it wrote."""
    from h3direct.traces import trace_vae

    with tempfile.TemporaryDirectory(prefix="h3_vae_gate_") as tmp:
        out = Path(tmp) / "ours.safetensors"
        with contextlib.redirect_stdout(io.StringIO()):
            trace_vae.run(weights=weights, config=config, inputs=inputs, dtype=dtype, only=op, out=str(out))
        return load_trace(out)


def frame_metrics(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Per-frame PSNR (peak 1) and SSIM (scikit-image, data range 1) of [B, T, H, W, 3] clips; mean and min."""
    from skimage.metrics import structural_similarity

    a = ours.double().reshape(-1, *ours.shape[-3:])
    b = ref.double().reshape(-1, *ref.shape[-3:])
    mse = ((a - b) ** 2).flatten(1).mean(1)
    psnr = [math.inf if m == 0 else 10.0 * math.log10(1.0 / m) for m in mse.tolist()]
    side = min(a.shape[1:3])
    win = 7 if side >= 7 else max(3, side - 1 + side % 2)  # scikit-image's default 7, odd and <= the frame side
    ssim = [float(structural_similarity(x.numpy(), y.numpy(), channel_axis=-1, data_range=1.0, win_size=win))
            for x, y in zip(a, b, strict=True)]
    return {"psnr_mean": sum(psnr) / len(psnr), "psnr_min": min(psnr), "ssim_mean": sum(ssim) / len(ssim),
            "ssim_min": min(ssim), "frames": len(psnr)}


def _info(case: VaeCase, name: str, ours: torch.Tensor, ref: torch.Tensor) -> str:
    if case.kind == "video_decode" and name.endswith(".vae_decode.out"):
        fm = frame_metrics(ours, ref)
        return (f"{fm['frames']} frames: PSNR mean {fm['psnr_mean']:.1f} / min {fm['psnr_min']:.1f} dB, "
                f"SSIM mean {fm['ssim_mean']:.6f} / min {fm['ssim_min']:.6f}")
    if case.kind == "audio_decode" and name.endswith(".vae_decode.out"):
        return f"waveform SNR {metrics.sqnr_db(ours, ref):.1f} dB"
    return ""


def _key_result(name, ours, ref, twin, budgets, case, context) -> LayerResult:
    kind = "output" if name.endswith(FINAL_SUFFIXES) else "module"
    replay = replay_request(case.trace, context, twin=case.twin_fp32)
    if ours is None or ours.shape != ref.shape:
        what = ("not produced by h3direct" if ours is None
                else f"shape {tuple(ours.shape)} != ComfyUI {tuple(ref.shape)}")
        nan = metrics.MaxAbs(math.inf, (), math.nan, math.nan)
        return LayerResult(name, kind, "vae", math.inf, -math.inf, nan, False, what, "", command(replay, name),
                           error=math.inf,
                           limit=0.0)
    b = budgets.lookup(mode="vae", kind=kind, compute=case.dtype, weights="vae", attention="exact",
                       twin="yes" if twin is not None else "no")
    rel = metrics.rel_l2(ours, ref)
    vs = None
    if twin is not None and name in twin and twin.get(name).shape == ref.shape:
        base = twin.get(name)
        vs = (metrics.rel_l2(ours, base), metrics.rel_l2(ref, base))
    v = verdict(b, Measured(rel, identical=torch.equal(ours, ref), twin=vs))
    return LayerResult(name, kind, "vae", rel, metrics.sqnr_db(ours, ref), metrics.max_abs(ours, ref), v.passed,
                       v.text, b.provenance, command(replay, name, b, v.limit), vs, v.error, v.limit, "exact",
                       _info(case, name, ours, ref))


def run_vae_case(case: VaeCase, *, attention: str = "sdpa", budgets: BudgetTable | None = None,
                 trace: Trace | None = None, ours: Trace | None = None,
                 replay: ReplayContext | None = None) -> CaseResult:
    """Compare h3direct with ComfyUI on every key of one VAE trace (`trace` / `ours` override for tests)."""
    budgets = budgets or load_budgets()
    ref_trace = trace or _trace(str(case.trace))
    twin = _trace(str(case.twin_fp32)) if case.twin_fp32 else None
    op = case.kind.split("_")[1]
    if ours is None:
        ours = h3direct_trace(str(case.weights), str(case.config), str(case.inputs), case.dtype, op)
    result = VaeCaseResult(case, attention)
    for name in ref_trace.names_in_order():
        ref = ref_trace.get(name)
        mine = ours.get(name) if name in ours else None
        result.layers.append(_key_result(name, mine, ref, twin, budgets, case, replay))
    return result
