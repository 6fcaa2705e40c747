"""What this container can run: GPU, compute capability, attention backends, NVFP4 mode.

Printed by the image's entrypoint before it runs the command (`H3_DOCTOR=off` skips it, `H3_DOCTOR=quick` only
asks the backend registry, `full` — the default — also runs one tiny attention call per backend, since a wheel
that imports can still lack kernels for this GPU). Without a GPU it says so and exits 0: the shell and the CPU
tests are legitimate uses of the image.

    python docker/spark_doctor.py [--mode full|quick] [--json]

Everything it reports comes from h3direct itself: `h3direct.dit.attention` (the backend registry and each
backend's own reason for not running) and `h3direct.dit.linear.resolve_nvfp4_mode` (the `--nvfp4-mode auto`
choice for the device the runtime would use).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

MODES = ("full", "quick", "off")
# one small attention problem: [B, H, S, D], big enough for kernels that tile by 64/128 tokens
PROBE_SHAPE = (1, 2, 256, 64)


def gpu_report() -> dict:
    """The device `--device cuda` would use, or why there is none."""
    import torch

    info: dict = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if not torch.cuda.is_available():
        why = ("this torch build has no CUDA" if torch.version.cuda is None
               else "torch.cuda.is_available() is False: no GPU visible (docker run --gpus all?)")
        return info | {"gpu": None, "reason": why}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    major, minor = torch.cuda.get_device_capability(index)
    return info | {"gpu": props.name, "index": index, "capability": f"{major}.{minor}", "sm": f"sm_{major}{minor}",
                   "memory_gib": round(props.total_memory / 2**30, 1),
                   "compiled_archs": torch.cuda.get_arch_list()}


def _probe_inputs(on_gpu: bool):
    import torch

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    qkv = [torch.randn(PROBE_SHAPE, generator=gen) for _ in range(3)]
    return [t.to("cuda" if on_gpu else "cpu", dtype) for t in qkv]


def _run_probe(name: str, q, k, v) -> dict:
    """One attention call through the seam; its rel-L2 error against fp32 SDPA (informational, not judged)."""
    import torch

    from h3direct.dit.attention import attention

    out = attention(q, k, v, name)
    if q.is_cuda:
        torch.cuda.synchronize()
    ref = attention(q.float(), k.float(), v.float(), "sdpa")
    err = (out.float() - ref).norm() / ref.norm().clamp_min(1e-30)
    return {"ran": True, "rel_l2_vs_fp32": float(err)}


def attention_report(mode: str, on_gpu: bool) -> dict[str, dict]:
    """Per backend: runnable or the registry's reason; in `full` mode the outcome of a real call."""
    from h3direct.dit.attention import backends, unavailable_reason
    from h3direct.errors import H3Error

    q, k, v = _probe_inputs(on_gpu)
    report = {}
    for name in backends():
        try:
            reason = unavailable_reason(name, q)
        except H3Error as exc:  # a bad H3_* option of that backend: report it, keep diagnosing the others
            reason = str(exc)
        entry: dict = {"available": reason is None}
        if reason is not None:
            entry["reason"] = reason
        elif mode == "full":
            try:
                entry |= _run_probe(name, q, k, v)
            except Exception as exc:  # a backend that claims to run but fails here is exactly what we report
                first = (str(exc).strip().splitlines() or [""])[0]
                entry |= {"available": False, "ran": False,
                          "reason": f"call failed: {type(exc).__name__}: {first[:200]}"}
        report[name] = entry
    return report


def nvfp4_report(on_gpu: bool) -> dict:
    """What `--nvfp4-mode auto` resolves to on the device the runtime would use, and whether comfy-kitchen's
    FP4 GEMM loads here."""
    from h3direct.checkpoint.quant.kitchen import kitchen_op
    from h3direct.dit.linear import resolve_nvfp4_mode

    device = "cuda" if on_gpu else "cpu"
    return {"device": device, "mode": resolve_nvfp4_mode("auto", device),
            "kitchen_scaled_mm_nvfp4": kitchen_op("scaled_mm_nvfp4") is not None}


def kitchen_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("comfy-kitchen")
    except PackageNotFoundError:
        return None


def collect(mode: str) -> dict:
    import h3direct

    gpu = gpu_report()
    on_gpu = gpu["gpu"] is not None
    return {"h3direct": h3direct.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "comfy_kitchen": kitchen_version(), **gpu,
            "attention": attention_report(mode, on_gpu), "nvfp4": nvfp4_report(on_gpu)}


def render(r: dict) -> str:
    lines = [f"h3direct {r['h3direct']} · python {r['python']} · {r['machine']} · torch {r['torch']} "
             f"(CUDA {r['torch_cuda'] or 'none'}) · comfy-kitchen {r['comfy_kitchen'] or 'not installed'}"]
    if r["gpu"] is None:
        lines.append(f"GPU: no GPU ({r['reason']})")
    else:
        lines.append(f"GPU: {r['gpu']} (cuda:{r['index']}), compute capability {r['capability']} ({r['sm']}), "
                     f"{r['memory_gib']} GiB; torch kernels for {' '.join(r['compiled_archs']) or '?'}")
    runnable = [n for n, e in r["attention"].items() if e["available"]]
    lines.append(f"attention backends that run here: {', '.join(runnable) or 'none'}")
    for name, e in r["attention"].items():
        if e["available"]:
            detail = f"ran, rel-L2 vs fp32 {e['rel_l2_vs_fp32']:.1e}" if e.get("ran") else "available"
        else:
            detail = f"no: {e['reason']}"
        lines.append(f"  {name:<15} {detail}")
    n = r["nvfp4"]
    loads = "loads" if n["kitchen_scaled_mm_nvfp4"] else "does not load"
    lines.append(f"NVFP4 mode (--nvfp4-mode auto on {n['device']}): {n['mode']}; "
                 f"comfy-kitchen scaled_mm_nvfp4 {loads} here")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="spark_doctor", description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=MODES, default=None,
                   help="full: also run one tiny call per backend (default; env H3_DOCTOR); quick: registry only; "
                        "off: print nothing")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = p.parse_args(argv)
    mode = args.mode or os.environ.get("H3_DOCTOR") or "full"
    if mode not in MODES:
        p.error(f"H3_DOCTOR={mode!r} is not one of {', '.join(MODES)}")
    if mode == "off":
        return 0
    report = collect(mode)
    print(json.dumps(report) if args.json else render(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
