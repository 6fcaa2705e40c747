"""Strict loading of ComfyUI-format H3 DiT checkpoints, with ComfyUI's dtype policy.

Strict: every checkpoint key must map to a parameter/buffer of `H3DiT` (module paths = keys) with the
right shape; missing, unexpected or misshapen keys are one-line `CheckpointError`s (ComfyUI only warns and
then runs on uninitialised memory).

Dtype policy (what ComfyUI ends up holding, per compute dtype):

- compute fp32: every float parameter fp32 (bf16 weights upcast exactly);
- compute bf16/fp16, no `comfy_quant` key: the fp32 islands (patch projections, time embedder, output heads,
  curve adaLN) stay fp32, the rest is held at the compute dtype;
- compute bf16/fp16 with any `comfy_quant` key: every non-quantized Linear and norm at the compute dtype,
  islands included (ComfyUI's mixed-precision ops ignore the fp32 declaration).

NVFP4 layers keep their packed tensors; buffers (`adaln_t_table`, `rope.inv_freq`) stay fp32.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from h3direct.checkpoint.quant import state_dict_markers
from h3direct.checkpoint.quant.nvfp4 import STORAGE_DTYPES
from h3direct.config import H3Config
from h3direct.dit import parallel
from h3direct.dit.blocks import RMSNorm
from h3direct.dit.linear import (
    NVFP4_MODES,
    FP8Linear,
    Linear,
    NVFP4Linear,
    apply_fp8_linears,
    check_fp8_linear,
    resolve_nvfp4_mode,
    restorable,
    restore_linears,
)
from h3direct.dit.model import H3DiT
from h3direct.dit.options import FP8_LINEAR_LEAVES, fp8_layer_set, rotate_set
from h3direct.errors import CheckpointError, ConfigError

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_compute_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return COMPUTE_DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown compute dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}") from None


def read_state_dict(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """All tensors of a safetensors file (validated header first), and its metadata."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError("no such file", path=path)
    try:
        from h3direct.checkpoint.safetensors_header import read_header, validate
    except ImportError:  # pragma: no cover - the header module is part of the package
        read_header = validate = None
    if read_header is not None:
        validate(read_header(path))
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt", device="cpu") as f:
            meta = f.metadata() or {}
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read safetensors: {str(exc).splitlines()[0]}", path=path) from None


def quant_formats(sd: dict[str, torch.Tensor], path=None) -> dict[str, str]:
    """layer path -> format, from the `.comfy_quant` JSON markers."""
    return {layer: conf["format"] for layer, conf in state_dict_markers(sd, path).items()}


def logical_shapes(sd: dict[str, torch.Tensor], formats: dict[str, str]) -> dict[str, tuple[int, ...]]:
    shapes = {k: tuple(v.shape) for k, v in sd.items()}
    for layer, fmt in formats.items():
        if fmt == "nvfp4" and f"{layer}.weight" in shapes:
            n, k2 = shapes[f"{layer}.weight"]
            shapes[f"{layer}.weight"] = (n, 2 * k2)
    return shapes


def build_model(config: H3Config, formats: dict[str, str], nvfp4_mode: str = "w4a16") -> H3DiT:
    """H3DiT on the meta device, NVFP4 layers where the checkpoint has them."""
    if nvfp4_mode not in NVFP4_MODES or nvfp4_mode == "auto":
        raise ConfigError(f"unknown NVFP4 mode {nvfp4_mode!r}; choose one of {', '.join(NVFP4_MODES)}")
    with torch.device("meta"):
        model = H3DiT(config)
        for layer, fmt in formats.items():
            parent_name, _, child = layer.rpartition(".")
            try:
                parent = model.get_submodule(parent_name)
                old = getattr(parent, child)
            except AttributeError:
                raise CheckpointError(f"quantization marker for unknown layer {layer}") from None
            if not isinstance(old, Linear):
                raise CheckpointError(f"{layer} is quantized but is not a Linear layer")
            if fmt != "nvfp4":
                raise CheckpointError(f"{layer}: quantization format {fmt!r} is not supported by the DiT loader "
                                      f"(supported: nvfp4)")
            if old.island:
                raise CheckpointError(f"{layer} is an fp32-island layer and must not be quantized")
            setattr(parent, child, NVFP4Linear(old.in_features, old.out_features, bias=old.bias is not None,
                                               mode=nvfp4_mode))
    return model


def _target_dtype(module: nn.Module, compute: torch.dtype, mixed: bool) -> torch.dtype | None:
    """Dtype a module's float parameters are held in, per ComfyUI's ops; None = keep as stored."""
    if isinstance(module, NVFP4Linear):
        return None
    if compute == torch.float32:
        return torch.float32
    if isinstance(module, Linear) and module.island and not mixed:
        return torch.float32
    return compute


def load_dit(path: str | Path, *, compute_dtype: str | torch.dtype = "fp32", nvfp4_mode: str = "auto",
             device: str | torch.device = "cpu", fp8_linear: str | None = None, nvfp4_dequant: str = "auto",
             fp8_strict: bool = False, fp8_accum: str = "fast", fp8_linear_layers: str | None = None,
             fp8_linear_format: str = "e4m3", fp8_linear_rotate: str = "none") -> H3DiT:
    """The kernel options fixed when the weights load (`KernelOptions.load_time()`): `fp8_linear` "stream"/"resident":
    the 200 (full model) block linears become FP8 W8A8 layers after loading (`linear.apply_fp8_linears`; opt-in,
    approximate; None/"off": as stored), `fp8_linear_layers` which of each block's four (None: all),
    `fp8_linear_format` their number format (e4m3 | int8), `fp8_linear_rotate` which int8 ones rotate their input and
    weight (`checkpoint.quant.hadamard`; "none" or a comma list),
    `fp8_strict` their strictness, `fp8_accum` their GEMMs' accumulation,
    `nvfp4_dequant` the NVFP4 layers' dequantization path on CUDA."""
    compute = parse_compute_dtype(compute_dtype)
    check_fp8_linear(fp8_linear)
    sd, _meta = read_state_dict(path)
    return load_state_dict(sd, compute_dtype=compute, nvfp4_mode=nvfp4_mode, device=device, source=path,
                           fp8_linear=fp8_linear, nvfp4_dequant=nvfp4_dequant, fp8_strict=fp8_strict,
                           fp8_accum=fp8_accum, fp8_linear_layers=fp8_linear_layers,
                           fp8_linear_format=fp8_linear_format, fp8_linear_rotate=fp8_linear_rotate)


def apply_load_time(model: H3DiT, *, fp8_linear: str = "off", nvfp4_dequant: str = "auto",
                    fp8_strict: bool = False, fp8_accum: str = "fast", fp8_linear_layers: str | None = None,
                    fp8_linear_format: str = "e4m3", fp8_linear_rotate: str = "none") -> None:
    """The kernel options fixed at load (`KernelOptions.load_time()`) on a loaded model: FP8 block linears (made in
    place; a model that has them in another mode or for other layers gets its own linears back first, which a model
    whose linears were converted (`resident`, or from bf16 weights) cannot: it is refused), their strictness and
    accumulation, and the NVFP4 layers' dequantization path."""
    leaves = None if fp8_linear_layers is None else fp8_layer_set(fp8_linear_layers)
    if leaves == FP8_LINEAR_LEAVES:
        leaves = None
    rotate = rotate_set(fp8_linear_rotate)
    if rotate and fp8_linear_format != "int8":
        raise ConfigError(f"fp8_linear_rotate {fp8_linear_rotate!r}: the rotation is of the int8 linears "
                          f"(fp8_linear_format int8), not of {fp8_linear_format}")
    held = getattr(model, "fp8_linear", "off")
    held_as = (held, getattr(model, "fp8_linear_layers", None), getattr(model, "fp8_linear_format", "e4m3"),
               getattr(model, "fp8_linear_rotate", ()))
    if held != "off" and held_as != (fp8_linear, leaves, fp8_linear_format, rotate):
        if not restorable(model):
            raise ConfigError(f"fp8_linear {fp8_linear!r}: this model's block linears were made FP8 {held!r} when "
                              f"it loaded (converted: its own linears are gone); load it again for another mode")
        restore_linears(model)
    if fp8_linear != "off" and getattr(model, "fp8_linear", "off") == "off":
        apply_fp8_linears(model, fp8_linear, leaves, fp8_linear_format, rotate)
    for module in model.modules():
        if isinstance(module, NVFP4Linear):
            module.dequant = nvfp4_dequant
        elif isinstance(module, FP8Linear):
            module.strict, module.accum = fp8_strict, fp8_accum


def load_state_dict(sd: dict[str, torch.Tensor], *, compute_dtype: torch.dtype = torch.float32,
                    nvfp4_mode: str = "auto", device="cpu", source=None, fp8_linear: str | None = None,
                    nvfp4_dequant: str = "auto", fp8_strict: bool = False, fp8_accum: str = "fast",
                    fp8_linear_layers: str | None = None, fp8_linear_format: str = "e4m3",
                    fp8_linear_rotate: str = "none") -> H3DiT:
    fp8_linear = check_fp8_linear(fp8_linear)
    formats = quant_formats(sd, source)
    nvfp4_mode = resolve_nvfp4_mode(nvfp4_mode, device)
    try:
        config = H3Config.from_shapes(logical_shapes(sd, formats))
    except ConfigError as exc:
        raise CheckpointError(str(exc), path=source) from None
    model = build_model(config, formats, nvfp4_mode)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(sd))
    unexpected = sorted(set(sd) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s) (first: {', '.join(missing[:3])})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s) (first: {', '.join(unexpected[:3])})")
        raise CheckpointError("not an H3 DiT checkpoint of the derived config: " + "; ".join(parts), path=source)
    for key, ref in expected.items():
        if key.endswith(".comfy_quant"):
            continue
        if tuple(sd[key].shape) != tuple(ref.shape):
            raise CheckpointError(f"{key} has shape {list(sd[key].shape)}, expected {list(ref.shape)}", path=source)

    mixed = bool(formats)
    state = {}
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        target = _target_dtype(module, compute_dtype, mixed)
        for pname, _ in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            key = prefix + pname
            t = sd[key]
            is_buffer = pname in dict(module.named_buffers(recurse=False))
            if isinstance(module, NVFP4Linear) and is_buffer:
                expect = {**STORAGE_DTYPES, "comfy_quant": torch.uint8}[pname]
                if t.dtype != expect:
                    if pname == "weight_scale" and t.dtype == torch.uint8:
                        t = t.view(torch.float8_e4m3fn)
                    else:
                        raise CheckpointError(f"{key} is {t.dtype}, expected {expect}", path=source)
            elif is_buffer:
                t = t.to(torch.float32)
            elif not t.is_floating_point():
                raise CheckpointError(f"{key} has dtype {t.dtype}, expected a float tensor", path=source)
            elif target is not None:
                t = t.to(target)
            state[key] = t.to(device)
    for mod_name, module in model.named_modules():
        if isinstance(module, NVFP4Linear):  # the JSON marker's length is the file's
            module.comfy_quant = torch.empty_like(state[f"{mod_name}.comfy_quant"], device="meta")
    model.load_state_dict(state, strict=True, assign=True)
    model.compute_dtype = compute_dtype
    model.fp8_linear, model.fp8_linear_layers, model.fp8_linear_format = "off", None, "e4m3"
    model.fp8_linear_rotate = ()
    del state
    # after the strict load: the checkpoint's names are checked as stored
    apply_load_time(model, fp8_linear=fp8_linear, nvfp4_dequant=nvfp4_dequant, fp8_strict=fp8_strict,
                    fp8_accum=fp8_accum, fp8_linear_layers=fp8_linear_layers, fp8_linear_format=fp8_linear_format,
                    fp8_linear_rotate=fp8_linear_rotate)
    model.eval()
    sp = parallel.active()  # under torchrun (parallel.init_from_env): the blocks run sharded
    if sp is not None:
        sp.attach(model)
    return model


__all__ = ["load_dit", "load_state_dict", "build_model", "read_state_dict", "parse_compute_dtype", "RMSNorm"]
