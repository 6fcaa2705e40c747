"""One denoiser evaluation from an inputs file, recorded under the oracle's names (`h3direct trace`; its command
line: `app/cli_trace.py`)."""

from __future__ import annotations

import json
import sys


def trace(*, checkpoint: str, inputs: str, out: str, options=None, compute_dtype: str = "fp32",
          nvfp4_mode: str = "auto", device: str = "cpu", sequence_parallel: int | None = None) -> int:
    """Load, evaluate once with `options` (`dit.options.Options`; default: sdpa, every option at its default), write
    the trace and its manifest. The inputs are checked against the checkpoint's header before anything loads."""
    import torch

    from h3direct.checkpoint.inspect import inspect_checkpoint
    from h3direct.config import H3Config
    from h3direct.dit import parallel
    from h3direct.dit.options import Options
    from h3direct.errors import H3Error
    from h3direct.traces.inputs import check_fits, load_inputs

    options = options or Options()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise H3Error(f"--device {device}: no CUDA device is available")
    loaded = load_inputs(inputs)
    check_fits(loaded, H3Config.from_dict(inspect_checkpoint(checkpoint)["config"]))
    sp = parallel.init_from_env(sequence_parallel, device)
    try:
        return _trace(checkpoint, inputs, loaded, out, options, compute_dtype, nvfp4_mode, device, sp)
    finally:
        parallel.shutdown()


def _trace(checkpoint, inputs_path, inputs, out, options, compute_dtype, nvfp4_mode, device, sp) -> int:
    import torch

    from h3direct.dit import parallel
    from h3direct.dit.attention import check_backend
    from h3direct.dit.linear import resolve_nvfp4_mode
    from h3direct.dit.loader import load_dit
    from h3direct.dit.tracing import Tracer
    from h3direct.traces.evaluate import one_step
    from h3direct.traces.format import save_trace

    run_device = str(sp.device) if sp is not None else device  # each rank on its own GPU (cuda:LOCAL_RANK)
    compute = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[compute_dtype]
    check_backend(options.attention, torch.empty(0, device=run_device, dtype=compute))
    model = load_dit(checkpoint, compute_dtype=compute_dtype, nvfp4_mode=nvfp4_mode, device=run_device,
                     **options.kernels.load_time())
    with Tracer(model) as tracer:
        one_step(model, inputs, backend=options, device=run_device)
    if not parallel.is_writer():
        return 0  # rank 0 holds the same gathered trace and writes it
    manifest = {
        "producer": "h3direct",
        "checkpoint": str(checkpoint),
        "inputs": str(inputs_path),
        "task": inputs.task,
        "variant": inputs.variant,
        "sigma": inputs.sigma,
        "seed": inputs.seed,
        "compute_dtype_requested": compute_dtype,
        "nvfp4_mode": resolve_nvfp4_mode(nvfp4_mode, device),
        "attention": options.attention.backend,
        "options": options.flat(),
        "device": device,
        **parallel.manifest_fields(),
        "config": model.config.comfy_dict(),
    }
    path = save_trace(out, tracer.tensors, manifest)
    print(json.dumps({"trace": str(path), "manifest": str(path.with_suffix(".json")),
                      "tensors": len(tracer.tensors)}), file=sys.stdout)
    return 0
