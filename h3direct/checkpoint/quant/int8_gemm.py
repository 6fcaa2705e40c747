"""The int8 W8A8 GEMM of the block linears in one Triton kernel: int8 codes times int8 codes on the tensor cores'
int8 path (exact int32 accumulation), the row and column scales (and the bias) applied to the accumulator in the same
kernel, rounded once to the output dtype.

    y[m, n] = round_out((acc[m, n] · s_x[m]) · s_w[n] (+ b[n])),   acc = Σ_k x8[m, k] · w8[n, k]  (int32, exact)

The epilogue is `w8a8.int8_epilogue`'s order of operations, built without floating-point contraction, so the kernel
equals its emulation (`w8a8.int8_epilogue` of the exact integer product) bit for bit: the integer part by exactness,
the float part by the same IEEE operations in the same order (the kernel rule of `budgets.toml`'s int8 entries:
FBGEMM's and torchao's int8 GEMM tests hold the int32 product exact and the scaled output to the reference's own
rounding).

The kernel is persistent (one program per SM, each walking output tiles in groups of GROUP_M rows of tiles, so a
group's weight columns stay in L2), reads its operands through tensor descriptors (the TMA engine on Hopper), and is
autotuned per (N, K) among a few tile shapes. Launch configs live in `CONFIGS`; `benchmarks/int8_gemm.py` times it
against torch's int8 (`torch._int_mm`, cuBLASLt), e4m3 (`torch._scaled_mm`) and bf16 GEMMs at the DiT's shapes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from h3direct.checkpoint.quant.w8a8_triton import round_out
from h3direct.triton_build import OUT_CODES, build, cuda_index, interpreting, shared_limit

ALIGN = 16  # tensor descriptors: row strides (K bytes of int8) in multiples of 16 bytes


def _int8_gemm_kernel(a_ptr, b_ptr, sx_ptr, sw_ptr, bias_ptr, out_ptr, M, N, K,
                      HAS_BIAS: tl.constexpr, OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
                      ROUND: tl.constexpr):
    # a [M, K] int8 (activations), b [N, K] int8 (weights), out [M, N]: 16-bit outputs written as their int16 bits
    # (ROUND: `w8a8_triton.round_out`, the epilogue kernel's rounding)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)
    per_group = GROUP_M * tiles_n
    # FLATTEN: the tile loop and the K loop pipelined as one (the next tile's loads overlap this tile's epilogue)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=FLATTEN):
        group = tile // per_group
        first = group * GROUP_M
        rows_here = tl.minimum(tiles_m - first, GROUP_M)
        tm = first + (tile % per_group) % rows_here
        tn = (tile % per_group) // rows_here
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
        for s in range(steps):
            a = a_desc.load([tm * BLOCK_M, s * BLOCK_K])
            b = b_desc.load([tn * BLOCK_N, s * BLOCK_K])
            acc = tl.dot(a, b.T, acc, out_dtype=tl.int32)
        rows = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tn * BLOCK_N + tl.arange(0, BLOCK_N)
        y = acc.to(tl.float32) * tl.load(sx_ptr + rows, mask=rows < M, other=0.0)[:, None]
        y = y * tl.load(sw_ptr + cols, mask=cols < N, other=0.0)[None, :]
        if HAS_BIAS:
            y = y + tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        inside = (rows < M)[:, None] & (cols < N)[None, :]
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], ROUND(y, OUT), mask=inside)


# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, flatten): the tile shapes autotuning picks from on a GPU
CONFIGS = [(128, 256, 128, 8, 8, 3, False), (128, 256, 128, 8, 8, 4, False), (256, 128, 128, 8, 8, 3, False),
           (256, 128, 128, 8, 8, 4, False), (128, 256, 128, 16, 8, 3, False), (128, 256, 128, 8, 8, 3, True),
           (128, 256, 128, 8, 8, 4, True), (256, 128, 128, 8, 8, 3, True), (128, 128, 128, 8, 8, 4, False)]
INTERPRETED = (32, 32, 32, 2, 4, 1, False)  # Triton's CPU interpreter: small tiles (its cost grows with their area)


@functools.cache
def _allocator_set() -> bool:
    """Tensor descriptors made inside a kernel need scratch memory from the launcher: torch's allocator."""
    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8,
                                                                     device="cuda" if torch.cuda.is_available()
                                                                     else "cpu"))
    return True


def reason(x8: torch.Tensor, w8: torch.Tensor, out_dtype: torch.dtype | None = None,
           bias: torch.Tensor | None = None) -> str | None:
    """Why the kernel cannot take these operands (None: it can). With `out_dtype` (and the bias it would add), on a GPU
    also whether a tile shape of `CONFIGS` fits its shared memory (`fitting`)."""
    if not (x8.is_cuda or interpreting()):
        return "cpu"
    if x8.dtype != torch.int8 or w8.dtype != torch.int8:
        return f"operands {x8.dtype}, {w8.dtype} (int8 codes expected)"
    k = x8.shape[1]
    if k % ALIGN or w8.shape[1] != k:
        return f"K={k} not a multiple of {ALIGN} (tensor descriptors)"
    if x8.is_cuda and torch.cuda.get_device_capability(x8.device) < (9, 0):
        return "compute capability < 9.0 (tensor descriptors: the TMA engine)"
    if x8.is_cuda and out_dtype is not None and not interpreting():
        fits = fitting(x8.device, w8.shape[0], k, out_dtype, None if bias is None else bias.dtype)
        if not fits.configs:
            return fits.refusal
    return None


def _call(config, pointers: tuple, m: int, n: int, k: int, out_dtype, has_bias: bool, programs: int):
    """(arguments, compile-time arguments and launch options) of tile shape `config`'s kernel: `pointers` = x8, w8,
    sx, sw, bias (or any fp32 pointer without one), the output."""
    bm, bn, bk, group, warps, stages, flatten = config
    return (*pointers, m, n, k), dict(
        HAS_BIAS=has_bias, OUT=OUT_CODES[out_dtype], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        PROGRAMS=programs, FLATTEN=flatten, ROUND=build(round_out), num_warps=warps, num_stages=stages,
        enable_fp_fusion=False)


def _kernel():
    return build(_int8_gemm_kernel, do_not_specialize=["M"])


def _launch(config, x8, w8, sx, sw, bias, out_dtype, out, dst):
    (m, k), n = x8.shape, w8.shape[0]
    tiles = triton.cdiv(m, config[0]) * triton.cdiv(n, config[1])
    programs = min(tiles, _sms(x8.device)) if x8.is_cuda else min(tiles, 4)
    b = bias.contiguous() if bias is not None else sw
    args, options = _call(config, (x8, w8, sx, sw, b, dst), m, n, k, out_dtype, bias is not None, programs)
    _kernel()[(programs,)](*args, **options)
    return out


@functools.cache
def _sms(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclass(frozen=True)
class Fitting:
    """The tile shapes of `CONFIGS` whose kernel fits a GPU's shared memory per block (`limit` bytes), in `CONFIGS`'
    order, and what each config's compiled kernel takes (`shared`)."""

    limit: int
    shared: dict

    @functools.cached_property  # asked on every int8 linear call: computed once per Fitting
    def configs(self) -> list[tuple]:
        return [c for c in CONFIGS if self.shared.get(c, self.limit + 1) <= self.limit]

    @property
    def refusal(self) -> str:
        """The one line saying why no tile shape runs here."""
        return (f"no tile shape fits the {self.limit} bytes of shared memory a block may take on this GPU (the "
                f"smallest takes {min(self.shared.values())})")


_FITTING: dict = {}  # (device index, N, K, output dtype, bias dtype) -> Fitting


def fitting(device: torch.device, n: int, k: int, out_dtype: torch.dtype, bias_dtype: torch.dtype | None) -> Fitting:
    """Which tile shapes of `CONFIGS` fit `device`'s shared memory per block (`triton_build.shared_limit`) for an
    [n, k] int8 weight, this output dtype and bias: each config's kernel compiled for that GPU as a launch on these
    operands would compile it, and Triton's own figure for it (`metadata.shared`), never launched. A config that does
    not fit is never tried there; one that does not compile is a bug, raised (never taken for one that does not
    fit)."""
    index = cuda_index(device)
    key = (index, n, k, out_dtype, bias_dtype)
    found = _FITTING.get(key)
    if found is None:
        shared = {config: int(_compiled_shared(index, n, k, out_dtype, bias_dtype, config)) for config in CONFIGS}
        found = _FITTING[key] = Fitting(shared_limit(torch.device("cuda", index)), shared)
    return found


def _compiled_shared(index: int, n: int, k: int, out_dtype, bias_dtype, config) -> int:
    """Shared memory per block of `config`'s kernel for these operands on GPU `index`: compiled (Triton's `warmup`, the
    kernel a launch would run, from the same cache), not launched."""
    from triton.runtime.jit import MockTensor

    sms = _sms(index)
    pointers = (MockTensor(torch.int8), MockTensor(torch.int8), MockTensor(torch.float32), MockTensor(torch.float32),
                MockTensor(bias_dtype or torch.float32),
                MockTensor(torch.float32 if out_dtype == torch.float32 else torch.int16))
    args, options = _call(config, pointers, config[0] * sms, n, k, out_dtype, bias_dtype is not None, sms)
    with torch.cuda.device(index):
        return _kernel().warmup(*args, grid=(sms,), **options).metadata.shared


_TUNED: dict = {}  # `_key`: (device index, N, K, M bucket, output dtype, bias dtype) -> the fastest config


def int8_linear(x8: torch.Tensor, w8: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                out_dtype: torch.dtype, config: tuple | None = None) -> torch.Tensor:
    """x8 [M, K] int8 (row scales sx [M] fp32) times w8 [N, K] int8 (column scales sw [N] fp32), + bias [N] -> [M, N]
    in `out_dtype`, bitwise `w8a8.int8_epilogue(x8 @ w8ᵀ (exact), sx, sw, bias, out_dtype)`. `config`: a tile shape
    of `CONFIGS` (default: the one autotuning found fastest for this N, K and size of M on this GPU)."""
    _allocator_set()
    m, n = x8.shape[0], w8.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x8.device)
    if not m or not n:
        return out
    dst = out if out_dtype == torch.float32 else out.view(torch.int16)
    args = (x8.contiguous(), w8.contiguous(), sx.contiguous(), sw.contiguous(), bias, out_dtype, out, dst)
    if interpreting() and not x8.is_cuda:
        return _launch(config or INTERPRETED, *args)
    if config is not None:
        return _launch(config, *args)
    key = _key(x8, w8, out_dtype, bias)
    best = _TUNED.get(key)
    if best is None:
        best = _TUNED[key] = _autotune(args)
    return _launch(best, *args)


def _key(x8: torch.Tensor, w8: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> tuple:
    # the output dtype (and the bias) are part of the key: the epilogue's tile passes through shared memory, twice the
    # bytes in fp32, so a tile shape that fits a 16-bit output can be out of shared memory for an fp32 one
    return (x8.device.index, w8.shape[0], x8.shape[1], x8.shape[0].bit_length(), out_dtype,
            None if bias is None else bias.dtype)


def tuned(x8: torch.Tensor, w8: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> tuple | None:
    """The config autotuning chose for these operands' shapes, output dtype and bias on their GPU (None: not tuned
    yet, or interpreted)."""
    return _TUNED.get(_key(x8, w8, out_dtype, bias))


def _autotune(args) -> tuple:
    """The fastest on these operands of the tile shapes that fit their GPU (`fitting`: the others are never launched
    there), each run twice to settle, then timed by triton's do_bench."""
    from triton.testing import do_bench

    x8, w8, bias, out_dtype = args[0], args[1], args[4], args[5]
    fits = fitting(x8.device, w8.shape[0], x8.shape[1], out_dtype, None if bias is None else bias.dtype)
    if not fits.configs:
        raise RuntimeError(f"int8 GEMM: {fits.refusal}")
    times = {}
    for config in fits.configs:
        _launch(config, *args)
        times[config] = do_bench(lambda config=config: _launch(config, *args), warmup=5, rep=20)
    return min(times, key=times.get)
