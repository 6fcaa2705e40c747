"""The attention seam: `attention(q, k, v, backend)` and the backend registry.

Every attention call of the DiT (and of the token refiner) goes through `attention()`; backends are
selected per call by name, no reload needed. q, k, v: [B, H, S, D]; returns [B, S, H·D].

| name            | what                                                                                      |
|-----------------|-------------------------------------------------------------------------------------------|
| sdpa            | torch SDPA, PyTorch's own kernel choice (default; exact; ComfyUI's `attention_pytorch`;    |
|                 | on an H200 with bf16 PyTorch picks cuDNN or flash, on the CPU its math/flash CPU kernel)   |
| cudnn_sdpa      | torch SDPA forced to cuDNN; an error if cuDNN cannot run it (never falls back)            |
| fa3             | FlashAttention-3 forward (`fa3-fwd`, extra `fa3`): Hopper (sm_90) only, bf16; exact       |
| fa3_fp8         | FA3's FP8 e4m3 forward, approximate: per-(batch, head) scales, K (and V) smoothing over    |
|                 | tokens (fp8_attention.py); sm_90, bf16 inputs. head_dim not a multiple of 16 (or > 256)  |
|                 | runs `H3_FP8_ATTN_FALLBACK` (fa3), counted; `H3_FP8_ATTN_STRICT=1` makes it an error.    |
| sage2           | SageAttention 2 (`sageattention.sageattn`: INT8 QK, FP8 PV on sm_89/sm_90/sm_12x), built   |
|                 | from source by `tools/build_sageattention.sh`; SageAttention 1 (PyPI 1.x) is refused      |
| ck_int8         | comfy-kitchen `int8_attention` (INT8 Q/K/V, approximate)                                  |
| kj_head_sliced  | heads in slices of `H3_HEAD_SLICE_SIZE` (8) through `H3_HEAD_SLICE_BACKEND` (sage2)       |
| sol_attn        | comfy-kitchen >= 0.2.40 `sol_attn` (sparse, INT8); options `H3_SOL_*` (sol_options.py).   |
|                 | A call shorter than `H3_SOL_MIN_TOKENS` or with head_dim != 128 runs `H3_SOL_FALLBACK`;   |
|                 | such calls are counted (`attention_stats()`) and `H3_SOL_STRICT=1` makes them errors.     |
|                 | No kernel (CPU, old comfy-kitchen, < sm_80) = unavailable, never a substitute.            |

An unknown or unavailable backend raises `BackendUnavailable` with the reason and the list of backends
available here. Availability is probed with a tensor of the compute dtype and device (`like`): a backend that runs
only bf16/fp16 is unavailable for fp32 inputs, and says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from h3direct.dit.sol_options import SOL_HEAD_DIM, sol_options
from h3direct.errors import BackendUnavailable

DEFAULT_BACKEND = "sdpa"


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # [B,H,S,D] -> [B,H,S,D] (any strides)
    available: Callable[[torch.Tensor | None], str | None]  # None if it can run, else the reason
    exact: bool  # same math as fp32 softmax attention up to rounding


_REGISTRY: dict[str, Backend] = {}

# Where the conditioning rows end in the current packed sequence (set by the DiT around its blocks), for
# backends that treat them specially (sol_attn's sink blocks). None: unknown (e.g. a teacher-forced layer).
_PREFIX_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("h3_attention_prefix_rows", default=None)

# Per-backend call counts: {"sol_attn": Counter({"kernel": n, "fallback to <backend>: <reason>": m})}, fa3_fp8 alike.
_STATS: dict[str, Counter] = {}


def register(name: str, fn, available, exact: bool):
    _REGISTRY[name] = Backend(name, fn, available, exact)


def backends() -> list[str]:
    return list(_REGISTRY)


def is_exact(name: str) -> bool:
    """Same math as fp32 softmax attention up to rounding (kj_head_sliced: as exact as its inner backend)."""
    if name == "kj_head_sliced":
        return _REGISTRY[_slice_settings()[0]].exact
    return _REGISTRY[name].exact


@contextlib.contextmanager
def sequence_hints(prefix_rows: int | None):
    """Within the block: the packed sequence's first `prefix_rows` rows are conditioning (text, references,
    keyframes, target audio); the target video follows."""
    token = _PREFIX_ROWS.set(prefix_rows)
    try:
        yield
    finally:
        _PREFIX_ROWS.reset(token)


def attention_stats() -> dict[str, dict[str, int]]:
    """Calls per backend that count them (sol_attn, fa3_fp8: kernel vs each documented fallback reason)."""
    return {name: dict(c) for name, c in _STATS.items() if c}


def reset_attention_stats() -> None:
    _STATS.clear()


def _count(backend: str, what: str) -> None:
    _STATS.setdefault(backend, Counter())[what] += 1


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


# ---- availability helpers ------------------------------------------------------------------------

def _always(_like):
    return None


def _cuda_only(like):
    if not torch.cuda.is_available():
        return "needs a CUDA device (torch.cuda.is_available() is False)"
    if like is not None and not like.is_cuda:
        return "inputs are not on a CUDA device"
    return None


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _half_only(like):
    if like is not None and like.dtype not in (torch.float16, torch.bfloat16):
        return f"needs fp16/bf16 inputs, got {_dtype_name(like.dtype)}"
    return None


def _capability(like) -> tuple[int, int]:
    dev = like.device if like is not None and like.is_cuda else None
    return torch.cuda.get_device_capability(dev)


# ---- backends ------------------------------------------------------------------------------------

def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> the same values with dense [B, S, H, D] storage (free when it already is).

    The DiT hands v over as a strided view into the qkv projection output (row stride 3·H·D); FA3 reads that
    directly, the other backends get this copy (the layout the block used to make for every backend)."""
    b, h, s, d = t.shape
    if t.stride() == (s * h * d, d, h * d, 1) or t.is_contiguous():
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _dense_v(fn):
    """A backend that wants v dense: the copy is made here, not by every caller."""
    @functools.wraps(fn)
    def wrapped(q, k, v):
        return fn(q, k, dense_rows(v))
    return wrapped


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False)


def _cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return _sdpa(q, k, v)


def _cudnn_available(like):
    reason = _cuda_only(like) or _half_only(like)
    if reason:
        return reason
    if not torch.backends.cudnn.is_available():
        return "cuDNN is not available in this torch build"
    return None


def _fa3(q, k, v):
    from fa3_fwd_interface import flash_attn_func

    # FA3 takes [B, S, H, D]; the DiT's q/k/v are [B, H, S, D] views of [S, H, D] rows, so this is free
    out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=False)
    if isinstance(out, tuple):
        out = out[0]
    return out.transpose(1, 2)


def _fa3_available(like):
    reason = _cuda_only(like)
    if reason:
        return reason
    cap = _capability(like)
    if cap != (9, 0):
        return f"FlashAttention-3 runs on Hopper (sm_90) only; this GPU is sm_{cap[0]}{cap[1]}"
    if like is not None and like.dtype != torch.bfloat16:
        return f"fa3-fwd is built for bf16 only, got {_dtype_name(like.dtype)}"
    try:
        import fa3_fwd_interface  # noqa: F401
    except ImportError as exc:
        return f"fa3-fwd is not importable ({exc}); pip install 'h3direct[fa3]'"
    return None


def _sage2(q, k, v):
    from sageattention import sageattn

    # dispatches on the GPU: sm_90 -> sageattn_qk_int8_pv_fp8_cuda_sm90 (INT8 QK, FP8 PV, fp32 accumulation)
    return sageattn(q, k, v, tensor_layout="HND", is_causal=False)


def _sage2_available(like):
    reason = _cuda_only(like) or _half_only(like)
    if reason:
        return reason
    try:
        import sageattention
    except ImportError as exc:
        return f"sageattention is not importable ({exc}); build it with tools/build_sageattention.sh"
    if not hasattr(sageattention, "sageattn_qk_int8_pv_fp8_cuda"):
        return "the installed sageattention is SageAttention 1 (Triton); build SageAttention 2 with " \
               "tools/build_sageattention.sh"
    cap = _capability(like)
    if cap < (8, 0):
        return f"SageAttention 2 needs sm_80 or newer; this GPU is sm_{cap[0]}{cap[1]}"
    try:
        import sageattention._qattn_sm80  # noqa: F401  (every SA2 build has it)
        if cap == (9, 0):
            import sageattention._qattn_sm90  # noqa: F401
    except ImportError as exc:
        return f"SageAttention 2's CUDA extension for sm_{cap[0]}{cap[1]} is not built ({exc})"
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


def slice_backend() -> str:
    """The inner backend kj_head_sliced hands its head slices to."""
    return _slice_settings()[0]


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


def sol_kernel_reason(like: torch.Tensor | None) -> str | None:
    """Why comfy-kitchen's compiled sol_attn cannot run here (None: it can)."""
    reason = _cuda_only(like)
    if reason:
        return reason
    try:
        import comfy_kitchen as ck
    except ImportError as exc:
        return f"comfy_kitchen is not importable ({exc}); pip install 'h3direct[kitchen]'"
    if not hasattr(ck, "sol_attn") or not hasattr(ck, "sol_attn_is_available"):
        return "the installed comfy-kitchen has no sol_attn (needs comfy-kitchen >= 0.2.40)"
    if not ck.sol_attn_is_available(like.device if like is not None else None):
        return "comfy-kitchen's sol_attn kernel cannot run on this GPU (its CUDA backend needs sm_80+)"
    return None


def sol_fallback_reason(q: torch.Tensor, min_tokens: int) -> str | None:
    """The documented reason a call runs the fallback backend instead of the kernel (None: the kernel runs)."""
    if q.shape[-1] != SOL_HEAD_DIM:
        return f"head_dim {q.shape[-1]} != {SOL_HEAD_DIM}"
    if q.shape[2] < min_tokens:
        return f"{q.shape[2]} tokens < H3_SOL_MIN_TOKENS={min_tokens}"
    return None


def _sol(q, k, v):
    reason = _sol_kernel_reason_cached(q.device)
    if reason is not None:  # no kernel here: unavailable, never a substitute (not even for short calls)
        raise BackendUnavailable(f"attention backend 'sol_attn' cannot run: {reason}")
    import comfy_kitchen as ck

    return sol_call(q, k, v, ck.sol_attn)


@functools.lru_cache(maxsize=8)
def _sol_kernel_reason_cached(device: torch.device) -> str | None:
    return sol_kernel_reason(torch.empty(0, device=device))


def sol_call(q, k, v, kernel):
    """One sol_attn call through `kernel` (comfy_kitchen.sol_attn): q, k, v [B, H, S, D] -> [B, H, S, D] view.

    Calls the kernel cannot take run H3_SOL_FALLBACK, counted in attention_stats(); H3_SOL_STRICT=1 raises."""
    opts = sol_options()
    why = sol_fallback_reason(q, opts.min_tokens)
    if why is not None:
        return _run_fallback("sol_attn", "H3_SOL_STRICT", opts.fallback, opts.strict, why,
                             "head_dim" if why.startswith("head") else "short", q, k, v)
    _count("sol_attn", "kernel")
    # the kernel takes [B, S, H, D]; the DiT's q/k/v are [B, H, S, D] views of [S, H, D] rows, so this is free
    out = kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **opts.kernel_kwargs(_PREFIX_ROWS.get()))
    return out.transpose(1, 2)


def _sol_available(like):
    opts = sol_options()
    reason = sol_kernel_reason(like) or _half_only(like)
    if reason is not None:
        return reason
    if opts.strict:
        return None  # calls that cannot run the kernel raise, one by one
    return _fallback_unavailable("sol_attn", "H3_SOL_FALLBACK", opts.fallback, like)


def _run_fallback(name: str, strict_env: str, fallback: str, strict: bool, why: str, tag: str, q, k, v):
    """A call backend `name`'s kernel cannot take (`why`): runs its documented `fallback` backend, counted as
    "fallback to <fallback>: <tag>"; in strict mode a one-line error instead."""
    if strict:
        raise BackendUnavailable(f"attention backend {name!r} would fall back to {fallback!r} ({why}); "
                                 f"{strict_env}=1 forbids it")
    _count(name, f"fallback to {fallback}: {tag}")
    return _REGISTRY[fallback].fn(q, k, v)


def _fallback_unavailable(name: str, env: str, fallback: str, like) -> str | None:
    """Why backend `name`'s documented fallback (set by `env`) cannot take its calls here (None: it can)."""
    if fallback not in _REGISTRY or fallback == name:
        return f"{env}={fallback!r} is not another attention backend"
    reason = _REGISTRY[fallback].available(like)
    return None if reason is None else f"its fallback {env}={fallback!r} cannot run: {reason}"


def fp8_fallback_reason(q: torch.Tensor) -> str | None:
    """Why FA3's FP8 kernel cannot take this call (None: it can)."""
    from h3direct.dit.fp8_attention import FP8_HEAD_DIM_ALIGN, FP8_MAX_HEAD_DIM

    d = q.shape[-1]
    if d % FP8_HEAD_DIM_ALIGN or d > FP8_MAX_HEAD_DIM:
        return f"head_dim {d} is not a multiple of {FP8_HEAD_DIM_ALIGN} up to {FP8_MAX_HEAD_DIM}"
    return None


def _fp8_settings() -> tuple[str, bool]:
    return os.environ.get("H3_FP8_ATTN_FALLBACK", "fa3"), os.environ.get("H3_FP8_ATTN_STRICT", "0") == "1"


def _fa3_fp8(q, k, v):
    from h3direct.dit.fp8_attention import fa3_fp8_attention

    fallback, strict = _fp8_settings()
    why = fp8_fallback_reason(q)
    if why is not None:
        return _run_fallback("fa3_fp8", "H3_FP8_ATTN_STRICT", fallback, strict, why, "head_dim", q, k, v)
    _count("fa3_fp8", "kernel")
    return fa3_fp8_attention(q, k, v)


def _fa3_fp8_available(like):
    reason = _fa3_available(like)
    if reason is not None:
        return reason
    fallback, strict = _fp8_settings()
    if strict:
        return None
    return _fallback_unavailable("fa3_fp8", "H3_FP8_ATTN_FALLBACK", fallback, like)


# fa3 reads a v with unit last-dim stride as it comes (FA3 requires only stride(-1) == 1); every other backend gets
# v dense (kj_head_sliced hands its head slices to its inner registered backend, which densifies them itself)
register("sdpa", _dense_v(_sdpa), _always, exact=True)
register("cudnn_sdpa", _dense_v(_cudnn), _cudnn_available, exact=True)
register("fa3", _fa3, _fa3_available, exact=True)
register("fa3_fp8", _fa3_fp8, _fa3_fp8_available, exact=False)  # its quantizer reads strided v
register("sage2", _dense_v(_sage2), _sage2_available, exact=False)
register("ck_int8", _dense_v(_ck_int8), _ck_int8_available, exact=False)
register("kj_head_sliced", _head_sliced, _head_sliced_available, exact=False)
register("sol_attn", _dense_v(_sol), _sol_available, exact=False)
