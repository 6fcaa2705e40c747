"""The attention seam: `attention(q, k, v, backend)` and the backend registry.

Every attention call of the DiT (and of the token refiner) goes through `attention()`; backends are
selected per call by name, no reload needed. q, k, v: [B, H, S, D]; returns [B, S, H·D].

| name            | what                                                                             |
|-----------------|----------------------------------------------------------------------------------|
| sdpa            | torch SDPA, PyTorch's own kernel choice (default; exact; ComfyUI's `attention_pytorch`) |
| cudnn_sdpa      | torch SDPA forced to cuDNN; an error if cuDNN cannot run it (never falls back)   |
| sage2           | SageAttention ≥ 2 (`sageattention.sageattn`), when importable on a CUDA device   |
| ck_int8         | comfy-kitchen `int8_attention` (INT8 Q/K/V, approximate)                         |
| kj_head_sliced  | runs heads in slices of `H3_HEAD_SLICE_SIZE` (8) through `H3_HEAD_SLICE_BACKEND` (sage2) |
| sol_attn        | comfy-kitchen `sol_attn` when the installed comfy-kitchen has it; options from `H3_SOL_*`; |
|                 | falls back to `H3_SOL_FALLBACK` (sage2) below `H3_SOL_MIN_TOKENS` or when unavailable,   |
|                 | unless `H3_SOL_STRICT=1`                                                                 |

An unknown or unavailable backend raises `BackendUnavailable` with the reason and the list of backends
available here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from h3direct.errors import BackendUnavailable

DEFAULT_BACKEND = "sdpa"


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # [B,H,S,D] -> [B,H,S,D]
    available: Callable[[torch.Tensor | None], str | None]  # None if it can run, else the reason
    exact: bool  # same math as fp32 softmax attention up to rounding


_REGISTRY: dict[str, Backend] = {}


def register(name: str, fn, available, exact: bool):
    _REGISTRY[name] = Backend(name, fn, available, exact)


def backends() -> list[str]:
    return list(_REGISTRY)


def unavailable_reason(name: str, like: torch.Tensor | None = None) -> str | None:
    if name not in _REGISTRY:
        return f"unknown attention backend {name!r}"
    return _REGISTRY[name].available(like)


def available_backends(like: torch.Tensor | None = None) -> list[str]:
    return [n for n, b in _REGISTRY.items() if b.available(like) is None]


def check_backend(name: str, like: torch.Tensor | None = None) -> None:
    reason = unavailable_reason(name, like)
    if reason is not None:
        raise BackendUnavailable(f"attention backend {name!r} cannot run: {reason}; "
                                 f"available here: {', '.join(available_backends(like)) or 'none'}")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = DEFAULT_BACKEND) -> torch.Tensor:
    """Softmax attention, no mask. q, k, v: [B, H, S, D] -> [B, S, H·D]."""
    b = _REGISTRY.get(backend)
    if b is None:
        check_backend(backend, q)
    try:
        out = b.fn(q, k, v)
    except (ImportError, RuntimeError) as exc:
        reason = b.available(q)
        if reason is not None:  # it could not run here: say why, as one line
            check_backend(backend, q)
        if backend == "cudnn_sdpa":
            raise BackendUnavailable(f"attention backend 'cudnn_sdpa' cannot run these inputs "
                                     f"({str(exc).splitlines()[0]}); it never falls back") from None
        raise
    return rearrange(out, "b h s d -> b s (h d)")


# ---- backends ----------------------------------------------------------------------------------

def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)


def _always(_like):
    return None


def _cuda_only(like):
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    if like is not None and not like.is_cuda:
        return "inputs are not on a CUDA device"
    return None


def _cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return _sdpa(q, k, v)


def _half_only(like):
    if like is not None and like.dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16 inputs, got {str(like.dtype).removeprefix('torch.')}"
    return None


def _cudnn_available(like):
    reason = _cuda_only(like) or _half_only(like)
    if reason:
        return reason
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available in this torch build"
    return None


def _sage2(q, k, v):
    from sageattention import sageattn

    return sageattn(q, k, v, tensor_layout="HND", is_causal=False)


def _sage2_available(like):
    reason = _cuda_only(like) or _half_only(like)
    if reason:
        return reason
    try:
        import sageattention  # noqa: F401
    except ImportError as exc:
        return f"sageattention is not importable ({exc}); pip install 'h3direct[sage]'"
    return None


def _ck_int8(q, k, v):
    import comfy_kitchen as ck

    out = ck.int8_attention(q, k, v)
    return out.to(q.dtype)


def _ck_int8_available(like):
    reason = _cuda_only(like)
    if reason:
        return reason
    try:
        import comfy_kitchen as ck
    except ImportError as exc:
        return f"comfy_kitchen is not importable ({exc}); pip install 'h3direct[kitchen]'"
    if not ck.int8_attention_is_available(like.device if like is not None else None):
        return "comfy-kitchen int8_attention needs its CUDA extension on SM75 or newer"
    return None


def _slice_settings():
    return os.environ.get("H3_HEAD_SLICE_BACKEND", "sage2"), int(os.environ.get("H3_HEAD_SLICE_SIZE", "8"))


def _head_sliced(q, k, v):
    inner, size = _slice_settings()
    fn = _REGISTRY[inner].fn
    return torch.cat([fn(q[:, i:i + size], k[:, i:i + size], v[:, i:i + size])
                      for i in range(0, q.shape[1], size)], dim=1)


def _head_sliced_available(like):
    inner, size = _slice_settings()
    if inner == "kj_head_sliced" or inner not in _REGISTRY:
        return f"H3_HEAD_SLICE_BACKEND={inner!r} is not a usable inner backend"
    if size <= 0:
        return f"H3_HEAD_SLICE_SIZE must be positive, got {size}"
    return _REGISTRY[inner].available(like)


def _sol_options() -> dict:
    env = os.environ.get
    return {"tau": float(env("H3_SOL_TAU", "1.3")), "min_tokens": int(env("H3_SOL_MIN_TOKENS", "4096")),
            "thresh_type": env("H3_SOL_THRESH_TYPE", "diag"),
            "int8_qk": env("H3_SOL_INT8_QK", "0") == "1", "int8_pv": env("H3_SOL_INT8_PV", "0") == "1",
            "fallback": env("H3_SOL_FALLBACK", "sage2"), "strict": env("H3_SOL_STRICT", "0") == "1"}


def _sol_kernel_reason(like) -> str | None:
    reason = _cuda_only(like)
    if reason:
        return reason
    try:
        import comfy_kitchen as ck
    except ImportError as exc:
        return f"comfy_kitchen is not importable ({exc})"
    if not hasattr(ck, "sol_attn"):
        return f"the installed comfy-kitchen ({getattr(ck, '__version__', '?')}) has no sol_attn"
    return None


def _sol(q, k, v):
    opts = _sol_options()
    if _sol_kernel_reason(q) is None and q.shape[2] >= opts["min_tokens"]:
        import comfy_kitchen as ck

        return ck.sol_attn(q, k, v, tau=opts["tau"], thresh_type=opts["thresh_type"],
                           int8_qk=opts["int8_qk"], int8_pv=opts["int8_pv"])
    return _REGISTRY[opts["fallback"]].fn(q, k, v)


def _sol_available(like):
    opts = _sol_options()
    reason = _sol_kernel_reason(like)
    if reason is None:
        return None
    if opts["strict"]:
        return reason + " (H3_SOL_STRICT=1 forbids the fallback)"
    fb = opts["fallback"]
    if fb == "sol_attn" or fb not in _REGISTRY:
        return f"{reason}, and H3_SOL_FALLBACK={fb!r} is not a usable backend"
    fb_reason = _REGISTRY[fb].available(like)
    return None if fb_reason is None else f"{reason}, and its fallback {fb!r}: {fb_reason}"


register("sdpa", _sdpa, _always, exact=True)
register("cudnn_sdpa", _cudnn, _cudnn_available, exact=True)
register("sage2", _sage2, _sage2_available, exact=False)
register("ck_int8", _ck_int8, _ck_int8_available, exact=False)
register("kj_head_sliced", _head_sliced, _head_sliced_available, exact=False)
register("sol_attn", _sol, _sol_available, exact=False)
