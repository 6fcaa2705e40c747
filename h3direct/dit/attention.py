"""The attention seam: `attention(q, k, v, backend)` and the backend registry.

Every attention call of the DiT (and of the token refiner) goes through `attention()`; `backend` is a name (that
backend with its default options) or an `AttentionOptions` (the backend and every backend's options, passed down by
the caller: `dit/options.py`), so a backend is chosen per call, no reload needed. q, k, v: [B, H, S, D]; returns
[B, S, H·D]. A backend that takes options is registered with its options class (diffusers' registry does the same
with a backend's constraints); its function and availability check get the call's `AttentionOptions`.

| name            | what                                                                                      |
|-----------------|-------------------------------------------------------------------------------------------|
| sdpa            | torch SDPA, PyTorch's own kernel choice (default; exact; ComfyUI's `attention_pytorch`;    |
|                 | on an H200 with bf16 PyTorch picks cuDNN or flash, on the CPU its math/flash CPU kernel)   |
| cudnn_sdpa      | torch SDPA forced to cuDNN; an error if cuDNN cannot run it (never falls back)            |
| fa3             | FlashAttention-3 forward (`fa3-fwd`, extra `fa3`): Hopper (sm_90) only, bf16; exact       |
| fa3_fp8         | FA3's FP8 e4m3 forward, approximate: per-(batch, head) scales, K (and V) smoothing over    |
|                 | tokens, q and k rotated by a random-sign Hadamard matrix (fp8_attention.py); sm_90, bf16  |
|                 | inputs. head_dim not a multiple of 16 (or > 256)                                          |
|                 | runs its `fallback` (fa3), counted; `strict` makes it an error (`FP8AttentionOptions`).   |
| sage2           | SageAttention 2 (`sageattention.sageattn`: INT8 QK, FP8 PV on sm_89/sm_90/sm_12x), built   |
|                 | from source by `tools/build_sageattention.sh`; SageAttention 1 (PyPI 1.x) is refused      |
| ck_int8         | comfy-kitchen `int8_attention` (INT8 Q/K/V, approximate)                                  |
| kj_head_sliced  | heads in slices of `size` (8) through `backend` (sage2) (`HeadSliceOptions`)              |
| sol_attn        | comfy-kitchen >= 0.2.40 `sol_attn` (sparse, INT8); `SolOptions` (sol_options.py).         |
|                 | A call shorter than `min_tokens` or with head_dim != 128 runs its `fallback`; such calls  |
|                 | are counted (`h3direct.counts`) and `strict` makes them errors. The query rows before the |
|                 | target video attend every key exactly, through `rows_backend` (an exact backend).         |
|                 | No kernel (CPU, old comfy-kitchen, < sm_80) = unavailable, never a substitute.            |

An unknown or unavailable backend raises `BackendUnavailable` with the reason and the list of backends
available here. Availability is probed with a tensor of the compute dtype and device (`like`): a backend that runs
only bf16/fp16 is unavailable for fp32 inputs, and says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from h3direct.counts import count_attention
from h3direct.dit.options import BACKEND_OPTIONS, DEFAULT_BACKEND, AttentionOptions
from h3direct.dit.sol_options import SOL_HEAD_DIM
from h3direct.errors import BackendUnavailable


@dataclass(frozen=True)
class Backend:
    name: str
    fn: Callable  # (q, k, v) -> [B,H,S,D] (any strides); with `options`: (q, k, v, AttentionOptions)
    available: Callable  # (like) -> None if it can run, else the reason; with `options`: (like, AttentionOptions)
    exact: bool  # same math as fp32 softmax attention up to rounding
    options: type | None = None  # the options class registered with the backend (`dit/options.py`)
    sparse: bool = False  # drops key blocks: its error depends on where the input's attention mass lies

    def run(self, q, k, v, opts: AttentionOptions):
        return self.fn(q, k, v) if self.options is None else self.fn(q, k, v, opts)

    def reason(self, like, opts: AttentionOptions) -> str | None:
        return self.available(like) if self.options is None else self.available(like, opts)


_REGISTRY: dict[str, Backend] = {}

# Where the conditioning rows end in the current packed sequence (set by the DiT around its blocks), for
# backends that treat them specially (sol_attn's sink blocks). None: unknown (e.g. a teacher-forced layer).
_PREFIX_ROWS: contextvars.ContextVar[int | None] = contextvars.ContextVar("h3_attention_prefix_rows", default=None)


def register(name: str, fn, available, exact: bool, sparse: bool = False):
    """A backend under `name`; its options class is the one `AttentionOptions` holds for it (None: it takes none)."""
    _REGISTRY[name] = Backend(name, fn, available, exact, BACKEND_OPTIONS.get(name), sparse)


def backends() -> list[str]:
    return list(_REGISTRY)


def as_options(backend: str | AttentionOptions) -> AttentionOptions:
    """A backend name -> that backend with every option at its default; AttentionOptions as given."""
    return backend if isinstance(backend, AttentionOptions) else AttentionOptions(backend=backend)


def _registered(backend: str | AttentionOptions) -> Backend:
    """The registered backend whose math a call runs (kj_head_sliced: its inner backend's)."""
    opts = as_options(backend)
    return _REGISTRY[opts.kj_head_sliced.backend if opts.backend == "kj_head_sliced" else opts.backend]


def is_exact(backend: str | AttentionOptions) -> bool:
    """Same math as fp32 softmax attention up to rounding (kj_head_sliced: as exact as its inner backend)."""
    return _registered(backend).exact


def is_sparse(backend: str | AttentionOptions) -> bool:
    """Drops key blocks (sol_attn, budget_attn): an error that follows the input's attention structure, not rounding
    (kj_head_sliced: as sparse as its inner backend)."""
    return _registered(backend).sparse


@contextlib.contextmanager
def sequence_hints(prefix_rows: int | None):
    """Within the block: the packed sequence's first `prefix_rows` rows are conditioning (text, references,
    keyframes, target audio); the target video follows."""
    token = _PREFIX_ROWS.set(prefix_rows)
    try:
        yield
    finally:
        _PREFIX_ROWS.reset(token)


def unavailable_reason(backend: str | AttentionOptions, like: torch.Tensor | None = None) -> str | None:
    opts = as_options(backend)
    if opts.backend not in _REGISTRY:
        return f"unknown attention backend {opts.backend!r}"
    return _REGISTRY[opts.backend].reason(like, opts)


def available_backends(like: torch.Tensor | None = None, options: AttentionOptions | None = None) -> list[str]:
    opts = options or AttentionOptions()
    return [n for n in _REGISTRY if unavailable_reason(opts.using(n), like) is None]


def check_backend(backend: str | AttentionOptions, like: torch.Tensor | None = None) -> None:
    """BackendUnavailable (a RequestError of the field `attention`): why the backend cannot run here, what can."""
    opts = as_options(backend)
    reason = unavailable_reason(opts, like)
    if reason is not None:
        kind = "choice" if opts.backend not in _REGISTRY else "value"
        available = ", ".join(available_backends(like, opts)) or "none"
        raise BackendUnavailable(f" {opts.backend!r} cannot run: {reason}; available here: {available}",
                                 field="attention", kind=kind)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              backend: str | AttentionOptions = DEFAULT_BACKEND) -> torch.Tensor:
    """Softmax attention, no mask. q, k, v: [B, H, S, D] -> [B, S, H·D]."""
    opts = as_options(backend)
    b = _REGISTRY.get(opts.backend)
    if b is None:
        check_backend(opts, q)
    try:
        out = b.run(q, k, v, opts)
    except (ImportError, RuntimeError) as exc:
        reason = b.reason(q, opts)
        if reason is not None:  # it could not run here: say why, as one line
            check_backend(opts, q)
        if opts.backend == "cudnn_sdpa":
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
    def wrapped(q, k, v, *options):
        return fn(q, k, dense_rows(v), *options)
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


# The CUDA extension of SageAttention 2 that `sageattn` runs on each compute capability it dispatches on
# (thu-ml/SageAttention's sageattention/core.py at tools/build_sageattention.sh's SAGE_REV; its setup.py builds an
# extension only for the archs in TORCH_CUDA_ARCH_LIST); None: Triton kernels only. Importing sageattention at all
# needs `_fused`, its quantizers, which every build has. Any other capability (10.0 among them) makes `sageattn` raise.
SAGE2_EXTENSIONS: dict[tuple[int, int], str | None] = {
    (8, 0): "_qattn_sm80",
    (8, 6): None,
    (8, 9): "_qattn_sm89",
    (9, 0): "_qattn_sm90",
    (12, 0): "_qattn_sm89",
    (12, 1): "_qattn_sm89",  # DGX Spark: INT8 QK, FP8 PV (per-warp), the sm_121a build of tools/build_sageattention.sh
}


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
    sm = f"sm_{cap[0]}{cap[1]}"
    if cap not in SAGE2_EXTENSIONS:
        return f"SageAttention 2's sageattn has no kernel for {sm} (it dispatches on " \
               f"{', '.join(f'sm_{a}{b}' for a, b in SAGE2_EXTENSIONS)})"
    extension = SAGE2_EXTENSIONS[cap]
    if extension is not None:
        try:
            importlib.import_module(f"sageattention.{extension}")
        except ImportError as exc:
            return f"SageAttention 2's CUDA extension for {sm} (sageattention.{extension}) is not built ({exc}); " \
                   f"build it with tools/build_sageattention.sh --arch {cap[0]}.{cap[1]}"
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


def slice_backend(backend: str | AttentionOptions = "kj_head_sliced") -> str:
    """The inner backend kj_head_sliced hands its head slices to under these options."""
    return as_options(backend).kj_head_sliced.backend


def _head_sliced(q, k, v, opts: AttentionOptions):
    inner, size = opts.kj_head_sliced.backend, opts.kj_head_sliced.size
    b = _REGISTRY[inner]
    return torch.cat([b.run(q[:, i:i + size], k[:, i:i + size], v[:, i:i + size], opts)
                      for i in range(0, q.shape[1], size)], dim=1)


def _head_sliced_available(like, opts: AttentionOptions):
    inner = opts.kj_head_sliced.backend
    if inner == "kj_head_sliced" or inner not in _REGISTRY:
        return f"head_slice_backend {inner!r} is not a usable inner backend"
    reason = _REGISTRY[inner].reason(like, opts)
    return None if reason is None else f"its inner backend head_slice_backend {inner!r} cannot run: {reason}"


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


def sol_fallback_reason(q: torch.Tensor, min_tokens: int) -> tuple[str, str] | None:
    """(count tag, documented reason) a call runs the fallback backend instead of the kernel (None: the kernel
    runs)."""
    if q.shape[-1] != SOL_HEAD_DIM:
        return "head_dim", f"head_dim {q.shape[-1]} != {SOL_HEAD_DIM}"
    if q.shape[2] < min_tokens:
        return "short", f"{q.shape[2]} tokens < sol_min_tokens={min_tokens}"
    return None


def _sol(q, k, v, opts: AttentionOptions):
    reason = _sol_kernel_reason_cached(q.device)
    if reason is not None:  # no kernel here: unavailable, never a substitute (not even for short calls)
        raise BackendUnavailable(f"attention backend 'sol_attn' cannot run: {reason}")
    import comfy_kitchen as ck

    return sol_call(q, k, v, ck.sol_attn, opts)


@functools.lru_cache(maxsize=8)
def _sol_kernel_reason_cached(device: torch.device) -> str | None:
    return sol_kernel_reason(torch.empty(0, device=device))


def sol_call(q, k, v, kernel, options: str | AttentionOptions = "sol_attn"):
    """One sol_attn call through `kernel` (comfy_kitchen.sol_attn): q, k, v [B, H, S, D] -> [B, H, S, D] view.

    Calls the kernel cannot take run the options' fallback, counted (`h3direct.counts`); `strict` raises."""
    opts = as_options(options)
    sol = opts.sol_attn
    why = sol_fallback_reason(q, sol.min_tokens)
    if why is not None:
        return _run_fallback("sol_attn", "sol_strict", sol.fallback, sol.strict, why, q, k, v, opts)
    count_attention("sol_attn", "kernel")
    prefix = _PREFIX_ROWS.get()
    rows = sol.exact_query_rows(prefix, q.shape[2]) if sol.rows_elsewhere else 0

    def exact_rows():  # the exact query blocks: the rows backend over every key
        return _REGISTRY[sol.rows_elsewhere].run(q[:, :, :rows], k, v, opts).transpose(1, 2)

    def routed():  # the kernel takes [B, S, H, D]; the DiT's q/k/v are [B, H, S, D] views of [S, H, D] rows: free
        return kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **sol.kernel_kwargs(prefix))

    if not rows:
        return routed().transpose(1, 2)
    if q.is_cuda:  # both only read q, k, v: the exact rows run beside the kernel, on a second stream
        main, side = torch.cuda.current_stream(q.device), _side_stream(q.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            exact = exact_rows()
        out = routed()
        main.wait_stream(side)
        exact.record_stream(main)
    else:
        exact, out = exact_rows(), routed()
    out[:, :rows] = exact  # written over the kernel's routed rows
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=8)
def _side_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _sol_available(like, opts: AttentionOptions):
    reason = sol_kernel_reason(like) or _half_only(like)
    if reason is not None:
        return reason
    rows = opts.sol_attn.rows_elsewhere
    if rows is not None:
        why = _REGISTRY[rows].reason(like, opts)
        if why is not None:
            return f"its exact rows' backend sol_rows_backend {rows!r} cannot run: {why}"
    if opts.sol_attn.strict:
        return None  # calls that cannot run the kernel raise, one by one
    return _fallback_unavailable("sol_attn", "sol_fallback", opts.sol_attn.fallback, like, opts)


def _run_fallback(name: str, strict_name: str, fallback: str, strict: bool, reason: tuple[str, str], q, k, v,
                  opts: AttentionOptions):
    """A call backend `name`'s kernel cannot take (`reason`: its count tag and why): runs its documented `fallback`
    backend, counted as "fallback to <fallback>: <tag>"; in strict mode a one-line error instead."""
    tag, why = reason
    if strict:
        raise BackendUnavailable(f"attention backend {name!r} would fall back to {fallback!r} ({why}); "
                                 f"{strict_name} forbids it")
    count_attention(name, f"fallback to {fallback}: {tag}")
    return _REGISTRY[fallback].run(q, k, v, opts)


def _fallback_unavailable(name: str, option: str, fallback: str, like, opts: AttentionOptions) -> str | None:
    """Why backend `name`'s documented fallback (its option `option`) cannot take its calls here (None: it can)."""
    if fallback not in _REGISTRY or fallback == name:
        return f"{option} {fallback!r} is not another attention backend"
    reason = _REGISTRY[fallback].reason(like, opts)
    return None if reason is None else f"its fallback {option} {fallback!r} cannot run: {reason}"


def _budget(q, k, v, opts: AttentionOptions):
    """budget_attn (`budget_attention.py`): calls shorter than budget_min_tokens run its fallback, counted."""
    from h3direct.dit import budget_attention as BA

    budget = opts.budget_attn
    why = BA.call_reason(q, budget.min_tokens)
    if why is not None:
        return _run_fallback("budget_attn", "budget_strict", budget.fallback, budget.strict, why, q, k, v, opts)
    count_attention("budget_attn", "kernel" if q.is_cuda else "reference")  # the CPU runs the kernel's reference
    keep = BA.select(q, k, _PREFIX_ROWS.get(), budget).keep
    return BA.attend(q, k, v, keep, budget.tail)


def _budget_available(like, opts: AttentionOptions):
    from h3direct.dit.budget_attention import kernel_reason

    reason = kernel_reason(like)
    if reason is not None or opts.budget_attn.strict:
        return reason
    return _fallback_unavailable("budget_attn", "budget_fallback", opts.budget_attn.fallback, like, opts)


def fp8_fallback_reason(q: torch.Tensor) -> str | None:
    """Why FA3's FP8 kernel cannot take this call (None: it can)."""
    from h3direct.dit.fp8_attention import FP8_HEAD_DIM_ALIGN, FP8_MAX_HEAD_DIM

    d = q.shape[-1]
    if d % FP8_HEAD_DIM_ALIGN or d > FP8_MAX_HEAD_DIM:
        return f"head_dim {d} is not a multiple of {FP8_HEAD_DIM_ALIGN} up to {FP8_MAX_HEAD_DIM}"
    return None


def _fa3_fp8(q, k, v, opts: AttentionOptions):
    from h3direct.dit.fp8_attention import fa3_fp8_attention

    fp8 = opts.fa3_fp8
    why = fp8_fallback_reason(q)
    if why is not None:
        return _run_fallback("fa3_fp8", "fp8_attn_strict", fp8.fallback, fp8.strict, ("head_dim", why), q, k, v,
                             opts)
    count_attention("fa3_fp8", "kernel")
    return fa3_fp8_attention(q, k, v, smooth_v=fp8.smooth_v, rotate=fp8.rotate)


def _fa3_fp8_available(like, opts: AttentionOptions):
    reason = _fa3_available(like)
    if reason is not None:
        return reason
    if opts.fa3_fp8.strict:
        return None
    return _fallback_unavailable("fa3_fp8", "fp8_attn_fallback", opts.fa3_fp8.fallback, like, opts)


# fa3 reads a v with unit last-dim stride as it comes (FA3 requires only stride(-1) == 1); every other backend gets
# v dense (kj_head_sliced hands its head slices to its inner registered backend, which densifies them itself)
register("sdpa", _dense_v(_sdpa), _always, exact=True)
register("cudnn_sdpa", _dense_v(_cudnn), _cudnn_available, exact=True)
register("fa3", _fa3, _fa3_available, exact=True)
register("fa3_fp8", _fa3_fp8, _fa3_fp8_available, exact=False)
register("sage2", _dense_v(_sage2), _sage2_available, exact=False)
register("ck_int8", _dense_v(_ck_int8), _ck_int8_available, exact=False)
register("kj_head_sliced", _head_sliced, _head_sliced_available, exact=False)
register("sol_attn", _sol, _sol_available, exact=False, sparse=True)  # reads v as the strided view it is
register("budget_attn", _budget, _budget_available, exact=False, sparse=True)
