"""Every Triton kernel the runtime launches on a GPU, compiled on the CPU for the GPUs the test lanes lack: the DGX
Spark (GB10, compute capability 12.1) and the B200 (10.0). The sm_90 compile tests of each kernel's own test file
cover Hopper.

The launches are the runtime's own: its entry points called at the full DiT's shapes (`H3Config` preset "full": the
block linears, hidden and MLP widths, heads) in each compute dtype a GPU runs (bf16, fp32), with the launch configs
its tables give a GPU of that compute capability (`triton_build.capability` set to it: the seam every table reads)
and, for the int8 GEMM, every tile shape autotuning considers. Each launch is intercepted (`JITFunction.__getitem__`),
its arguments specialized as Triton's launcher specializes them, and each distinct kernel compiled once through
Triton's whole compiler for the target. Checked for each (`problems`):

- it compiles (ptxas included);
- it fits the target's shared memory per block (`triton_build.SHARED_PER_BLOCK`), or, for the int8 GEMM's tile
  shapes, the dispatch leaves it out there (`int8_gemm.fitting`, fed the compiled figures);
- its PTX uses the units the kernel claims (`CLAIMS`): the tensor cores' MMA of the operand type (warpgroup MMA on
  9.0, tcgen05 on 10.x, mma.sync on 12.x), the TMA engine, the e4m3 and int8 conversions, and keeps the arithmetic its
  bits depend on (IEEE division, no fused multiply-add in the int8 epilogues). No runtime Triton kernel claims an e4m3
  MMA: the e4m3 GEMMs are cuBLAS's (`torch._scaled_mm`).

Kernels a target never launches (fa3_fp8's quantizers where fa3_fp8 is refused) are not compiled for it; the test says
why from the backend's own probe. `test_the_checks_fail_on_*` shows each check failing.
"""

from __future__ import annotations

import functools
import os
import re
import types
from contextlib import ExitStack
from dataclasses import dataclass
from unittest import mock

import pytest
import torch

triton = pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86_64 Linux)")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from h3direct import triton_build  # noqa: E402
from h3direct.checkpoint.keys import BLOCK_LINEARS, dit_keys  # noqa: E402
from h3direct.checkpoint.quant import hadamard, int8_gemm, nvfp4_triton, w8a8_triton  # noqa: E402
from h3direct.checkpoint.quant.nvfp4 import storage_shapes  # noqa: E402
from h3direct.config import H3Config  # noqa: E402
from h3direct.dit import block_sparse_triton, budget_select_triton, fp8_attention, fused  # noqa: E402
from h3direct.dit.timesteps import ModRun  # noqa: E402

TARGETS = {"sm_121": (12, 1), "sm_100": (10, 0)}  # DGX Spark (GB10), B200
RUNTIME_MODULES = (fused, w8a8_triton, int8_gemm, nvfp4_triton, fp8_attention, block_sparse_triton,
                   budget_select_triton)  # triton_build's users
COMPUTE_DTYPES = (torch.bfloat16, torch.float32)
ROWS = 64  # sequence rows of the recorded calls (no launch config depends on them)

# ---- what each kernel claims of the GPU, and the instructions that show it in PTX, by the target's major version ----
MMA = {  # the tensor cores' MMA of an operand type
    "s8": {9: r"wgmma\.mma_async\S*\.s32\.s8\.s8", 10: r"tcgen05\.mma\S*kind::i8", 12: r"mma\.sync\S*\.s32\.s8\.s8\.s32"},
    "bf16": {9: r"wgmma\.mma_async\S*\.bf16", 10: r"tcgen05\.mma\S*kind::f16", 12: r"mma\.sync\S*\.bf16\.bf16"},
    "tf32": {9: r"wgmma\.mma_async\S*\.tf32", 10: r"tcgen05\.mma\S*kind::tf32", 12: r"mma\.sync\S*\.tf32\.tf32"},
}
NO_FMA = ("no fused multiply-add (its products round as torch's)", r"fma\.rn\.f32", False)
NO_APPROX_DIVISION = ("no approximate division (Triton's `/`)", r"div\.(full|approx)", False)
CLAIMS = {  # kernel -> (what, PTX pattern (by major version), present or absent); from each kernel's module docstring
    "_int8_gemm_kernel": [("int8 MMA", MMA["s8"], True),
                          ("TMA loads", dict.fromkeys((9, 10, 12), r"cp\.async\.bulk\.tensor"), True), NO_FMA],
    "_int8_epilogue_kernel": [NO_FMA],
    "_rotate_encode_kernel": [("bf16 MMA", MMA["bf16"], True), NO_APPROX_DIVISION],
    "_rotate_quant_rows_kernel": [("bf16 MMA", MMA["bf16"], True), NO_APPROX_DIVISION],
    "_quant_rows_kernel": [NO_APPROX_DIVISION],
    "_dequant_kernel": [NO_APPROX_DIVISION],
    "_quantize_rotated_kernel": [("tf32 MMA", MMA["tf32"], True)],
}
ENCODER_CLAIMS = {  # a kernel handed an encoder writes its codes with the GPU's conversion
    "encode_e4m3": [("e4m3 conversion", r"cvt\.rn\.satfinite\.e4m3x2\.f32", True)],
    "encode_int8": [("int8 rounding (rint)", r"cvt\.rni\.f32\.f32", True)],
}
# ... and its scales' reciprocals by IEEE division, as torch divides
IEEE_DIVISION = [("IEEE division", r"div\.rn\.f32", True)]


# ---- recording the runtime's launches ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Launch:
    """One distinct kernel launch: what `triton.compile` needs to build it as the launcher would."""

    kernel: str
    fn: JITFunction
    signature: tuple  # ((name, type), ...)
    constexprs: tuple  # ((name, value), ...)
    attrs: tuple  # ((index, attributes), ...)
    options: tuple  # ((name, value), ...)

    @property
    def consts(self) -> dict:
        return dict(self.constexprs)

    @property
    def label(self) -> str:
        shown = {k: v for k, v in self.constexprs if isinstance(v, (int, bool)) and k.isupper()}
        types_ = {k: v for k, v in self.signature if k.endswith("_ptr")}
        return f"{self.kernel} {shown} {dict(self.options)} {types_}"

    def group(self) -> str:
        module = self.fn.fn.__module__.rsplit(".", 1)[-1]
        if self.kernel == "_int8_gemm_kernel":
            return f"{module}:{'fp32' if self.consts['OUT'] == 0 else '16-bit'}"
        return module


def _specialize(fn: JITFunction, args: tuple, kwargs: dict) -> Launch:
    """A recorded call as Triton's launcher specializes it for a CUDA GPU: pointer and integer divisibility by 16,
    integers equal to 1 and None as constants (the launcher's own `specialize_impl` with the CUDA backend's rules)."""
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    names = [p.name for p in fn.params]
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    signature, constexprs, attrs = [], [], []
    for i, p in enumerate(fn.params):
        value = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr:
            signature.append((p.name, "constexpr"))
            constexprs.append((p.name, value))
            continue
        ty, spec = native_specialize_impl(CUDABackend, value, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        signature.append((p.name, ty))
        if ty == "constexpr":
            constexprs.append((p.name, spec))
        elif spec:
            attrs.append(((i,), tuple(tuple(a) for a in CUDABackend.parse_attr(spec))))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return Launch(fn.fn.__name__, fn, tuple(signature), tuple(constexprs), tuple(attrs), options)


def _tensor(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, dtype=dtype)


def _dit_kernel_calls(device: torch.device) -> None:
    """Every kernel call of the DiT at its full size, with `device`'s launch configs (the entry points are called on
    CPU tensors, whose data no recorded launch reads)."""
    cfg = H3Config.from_name("full")
    keys = dit_keys(cfg)
    linears = [keys[f"blocks.0.{name}.weight"].shape for name in BLOCK_LINEARS]  # [N, K] of each block linear
    d, f, heads, head_dim = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads, cfg.attention_head_dim
    s, runs, table = ROWS, [ModRun(0, ROWS, 0)], fused.launch_table(device)
    for dt in COMPUTE_DTYPES:  # the fused kernels of a block
        x, w, mod = _tensor(s, d, dtype=dt), _tensor(d), _tensor(2, d, dtype=dt)
        for e4m3, suffix in ((False, ""), (True, "_e4m3")):
            fused.norm_modulate(x, w, cfg.norm_eps, mod, mod, runs, e4m3=e4m3, config=table["norm_modulate" + suffix])
            fused.residual_norm_modulate_(x, mod, _tensor(s, d, dtype=dt), w, cfg.norm_eps, mod, mod, runs,
                                          e4m3=e4m3, config=table["residual_norm_modulate" + suffix])
        fused.gated_residual_(x, mod, _tensor(s, d, dtype=dt), runs, config=table["gated_residual"])
        a = _tensor(s, 2 * f, dtype=dt)
        fused.swiglu_(a, config=table["swiglu"])
        fused.swiglu_e4m3(a, config=table["swiglu_e4m3"])
        qkv = _tensor(s, 3, heads, head_dim, dtype=dt)
        rope = _tensor(1, s, 1, cfg.rope_dim // 2, 2, 2, dtype=dt)
        fused.qk_norm_rope_(qkv[:, 0][None], qkv[:, 1][None], _tensor(head_dim), _tensor(head_dim), rope,
                            cfg.qk_norm_eps, config=table["qk_norm_rope"])
        for _, k in linears:  # the 8-bit linears' input quantizers, in each format
            for fmt in ("e4m3", "int8"):
                w8a8_triton.quantize_rows(_tensor(s, k, dtype=dt), fmt)
    for n, k in linears:
        signs, h = hadamard.operands(k, torch.device("cpu"), torch.bfloat16)  # the rotated int8 linears
        w8a8_triton.rotate_encode_int8(_tensor(n, k), signs, h, _tensor(n, dtype=torch.float32))
        w8a8_triton.rotate_quantize_rows_int8(_tensor(s, k), signs, h)
        x8, w8 = _tensor(s, k, dtype=torch.int8), _tensor(n, k, dtype=torch.int8)
        sx, sw = _tensor(s, dtype=torch.float32), _tensor(n, dtype=torch.float32)
        for dt in COMPUTE_DTYPES:  # the int8 GEMM in every tile shape autotuning considers; cuBLASLt's epilogue
            for config in int8_gemm.CONFIGS:
                int8_gemm.int8_linear(x8, w8, sx, sw, None, dt, config=config)
            w8a8_triton.int8_epilogue(_tensor(s, n, dtype=torch.int32), sx, sw, None, dt)
        shapes = storage_shapes((n, k))  # NVFP4 weights: W4A16's dequantization, the 8-bit linears' conversion
        packed = _tensor(*shapes["weight"], dtype=torch.uint8)
        scales = _tensor(*shapes["weight_scale"], dtype=torch.float8_e4m3fn)
        g = _tensor((), dtype=torch.float32)
        for dt in COMPUTE_DTYPES:
            nvfp4_triton.dequantize_nvfp4_triton(packed, scales, g, dt,
                                                 config=nvfp4_triton.launch_config("nvfp4_dequant", device))
        for fmt in ("e4m3", "int8"):
            nvfp4_triton.nvfp4_to_codes_triton(packed, scales, g, _tensor(shapes["weight"][0], dtype=torch.float32),
                                               fmt=fmt, config=nvfp4_triton.launch_config("nvfp4_e4m3", device))
    if fa3_fp8_refusal(device) is None:  # fa3_fp8's quantizers: q and k rotated, v smoothed
        x = _tensor(1, heads, s, head_dim)
        inverse = _tensor(1, heads, dtype=torch.float32)
        fp8_attention.quantize_triton(x, None, inverse, rotate=True)
        fp8_attention.quantize_triton(x, _tensor(1, heads, head_dim, dtype=torch.float32), inverse, rotate=False)


def _on(capability: tuple[int, int]) -> ExitStack:
    """A CUDA GPU of `capability` as the runtime's probes and launch tables see one (their seams)."""
    from tests.spark_image import gpu_seams

    stack = ExitStack()
    reported = types.SimpleNamespace(shared_memory_per_block_optin=triton_build.SHARED_PER_BLOCK[capability])
    for obj, name, value in gpu_seams(capability, reported):
        stack.enter_context(mock.patch.object(obj, name, value))
    return stack


def fa3_fp8_refusal(device: torch.device) -> str | None:
    """fa3_fp8's own probe on this device (None: it runs, and so do its quantizers)."""
    from h3direct.dit.attention import unavailable_reason

    return unavailable_reason("fa3_fp8", None)


@functools.cache
def launches(capability: tuple[int, int]) -> tuple[Launch, ...]:
    """The distinct launches of `_dit_kernel_calls` on a GPU of `capability`."""
    calls = []

    def record(self, grid):
        return lambda *args, **kwargs: calls.append(_specialize(self, args, kwargs))

    with _on(capability), mock.patch.object(JITFunction, "__getitem__", record), \
            mock.patch.dict("os.environ", {"TRITON_INTERPRET": "0"}):
        _dit_kernel_calls(torch.device("cuda", 0))
    return tuple(dict.fromkeys(calls))


# ---- compiling and checking --------------------------------------------------------------------------------------

@functools.cache
def compiled(launch: Launch, capability: tuple[int, int]):
    major, minor = capability
    return triton.compile(ASTSource(launch.fn, dict(launch.signature), launch.consts,
                                    {i: [list(a) for a in attr] for i, attr in launch.attrs}),
                          target=GPUTarget("cuda", 10 * major + minor, 32), options=dict(launch.options))


def claims(launch: Launch) -> list[tuple[str, dict | str, bool]]:
    """What the launch's PTX must (not) show: its kernel's `CLAIMS`, and those of an encoder it is handed."""
    out = list(CLAIMS.get(launch.kernel, []))
    encoder = getattr(getattr(launch.consts.get("ENCODE"), "fn", None), "__name__", None)
    if encoder in ENCODER_CLAIMS:
        out += ENCODER_CLAIMS[encoder] + IEEE_DIVISION
    return out


def problems(launch: Launch, kernel, capability: tuple[int, int], candidates: list | None = None) -> list[str]:
    """What is wrong with `launch` compiled for `capability` (`kernel`: the compiled kernel, or the exception its
    compilation raised); `candidates`: the int8 GEMM's tile shapes the dispatch tries there."""
    if isinstance(kernel, Exception):
        return [f"{launch.label}: does not compile: {type(kernel).__name__}: {str(kernel).splitlines()[:1]}"]
    out = []
    limit = triton_build.SHARED_PER_BLOCK[capability]
    shared = kernel.metadata.shared
    if launch.kernel == "_int8_gemm_kernel":
        tried = _gemm_config(launch) in candidates
        if tried and shared > limit:
            out.append(f"{launch.label}: takes {shared} bytes of shared memory, over the {limit} a block may take on "
                       f"sm_{capability[0]}{capability[1]}, and autotuning there tries it")
    elif shared > limit:
        out.append(f"{launch.label}: takes {shared} bytes of shared memory, over the {limit} a block may take on "
                   f"sm_{capability[0]}{capability[1]}")
    ptx = kernel.asm["ptx"]
    for what, pattern, present in claims(launch):
        pattern = pattern[capability[0]] if isinstance(pattern, dict) else pattern
        if bool(re.search(pattern, ptx)) != present:
            out.append(f"{launch.label}: claims {what}, but its PTX {'lacks' if present else 'has'} {pattern!r}")
    return out


def _gemm_config(launch: Launch) -> tuple:
    c, o = launch.consts, dict(launch.options)
    return (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["GROUP_M"], o["num_warps"], o["num_stages"], c["FLATTEN"])


def _compile_or_error(launch: Launch, capability):
    try:
        return compiled(launch, capability)
    except Exception as exc:  # noqa: BLE001 (a kernel that does not compile is a problem to report)
        return exc


def gemm_candidates(capability: tuple[int, int], out_dtype: torch.dtype) -> list[tuple]:
    """The tile shapes the int8 GEMM's autotuning tries on a GPU of `capability` for the DiT's qkv projection
    (`int8_gemm.fitting`, fed the shared memory of each config's kernel as compiled here)."""
    out = int8_gemm.OUT_CODES[out_dtype]
    kernels = {_gemm_config(x): x for x in launches(capability)
               if x.kernel == "_int8_gemm_kernel" and x.consts["OUT"] == out}
    n, k = dit_keys(H3Config.from_name("full"))["blocks.0.attn.qkv_proj.weight"].shape

    def shared(index, n_, k_, out_dtype_, bias_dtype, config):
        return compiled(kernels[config], capability).metadata.shared

    with _on(capability), mock.patch.object(int8_gemm, "_compiled_shared", shared), \
            mock.patch.object(int8_gemm, "_FITTING", {}):
        return int8_gemm.fitting(torch.device("cuda", 0), n, k, out_dtype, None).configs


def _groups() -> list[str]:
    return sorted({x.group() for cap in TARGETS.values() for x in launches(cap)} | {"fp8_attention"})


@pytest.fixture(autouse=True)
def _triton_cache(tmp_path_factory, monkeypatch):
    """Compiled kernels cached for this session, shared by its pytest-xdist workers (one session's base folder)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    monkeypatch.setenv("TRITON_CACHE_DIR", str(shared / "triton-targets"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


# ---- the tests -----------------------------------------------------------------------------------------------------

def test_every_runtime_kernel_is_launched_on_some_target():
    """The recorded calls reach every Triton kernel of the runtime's kernel modules (a kernel added without a call here
    fails this test); fa3_fp8's quantizers are launched on sm_90 only, which the kernels' own tests cover; budget_attn's
    block-sparse kernel and its selection kernel are compiled for these targets (and sm_90) with their launch tables'
    configs by their own tests (`test_compiles_on_the_tensor_cores_within_shared_memory` of
    `test_block_sparse_triton.py` and `test_budget_select_triton.py`)."""
    from tests.test_block_sparse_triton import MMA as BLOCK_SPARSE_TARGETS
    from tests.test_budget_select_triton import MMA as SELECT_TARGETS

    defined = {name for module in RUNTIME_MODULES for name, value in vars(module).items()
               if name.endswith("_kernel") and name != "_kernel" and (callable(value) or isinstance(value, JITFunction))}
    recorded = {x.kernel for cap in TARGETS.values() for x in launches(cap)}
    fa3_only = {"_quantize_kernel", "_quantize_rotated_kernel"}
    own_test = {"_block_sparse_kernel", "_select_kernel"}
    assert defined - fa3_only - own_test == recorded, (defined, recorded)
    assert fa3_only | own_test <= defined
    assert set(TARGETS.values()) <= set(BLOCK_SPARSE_TARGETS) & set(SELECT_TARGETS)


@pytest.mark.parametrize("group", _groups())
@pytest.mark.parametrize("target", TARGETS)
def test_kernels_compile_fit_and_use_their_units(target, group):
    capability = TARGETS[target]
    mine = [x for x in launches(capability) if x.group() == group]
    if group == "fp8_attention":  # not launched here: fa3_fp8 itself is refused, with its reason
        with _on(capability):
            why = fa3_fp8_refusal(torch.device("cuda", 0))
        assert why is not None and not mine, (why, [x.label for x in mine])
        assert "Hopper" in why
        return
    assert mine
    candidates = None
    if group.startswith("int8_gemm"):
        out_dtype = torch.float32 if group.endswith("fp32") else torch.bfloat16
        candidates = gemm_candidates(capability, out_dtype)
        limit = triton_build.SHARED_PER_BLOCK[capability]
        fits = [_gemm_config(x) for x in mine if compiled(x, capability).metadata.shared <= limit]
        assert candidates == [c for c in int8_gemm.CONFIGS if c in fits], "the dispatch's filter is not the compiler's"
        assert candidates, f"no int8 GEMM tile shape fits {target}: the dispatch would route the int8 linears away"
    found = [p for x in mine for p in problems(x, _compile_or_error(x, capability), capability, candidates)]
    assert not found, "\n".join(found)


def _gemm_launch(capability, fits: bool) -> Launch:
    limit = triton_build.SHARED_PER_BLOCK[capability]
    return next(x for x in launches(capability) if x.kernel == "_int8_gemm_kernel"
                and (compiled(x, capability).metadata.shared <= limit) == fits)


def test_the_checks_fail_on_a_kernel_that_does_not_fit_and_is_tried():
    """On the Spark an int8 GEMM tile shape over 99 KiB is a problem as soon as the dispatch would try it; a kernel of
    any other kind over the limit is one outright."""
    cap = TARGETS["sm_121"]
    big = _gemm_launch(cap, fits=False)
    kernel = compiled(big, cap)
    assert problems(big, kernel, cap, candidates=[]) == []
    found = problems(big, kernel, cap, candidates=list(int8_gemm.CONFIGS))
    assert len(found) == 1 and "autotuning there tries it" in found[0], found
    small = next(x for x in launches(cap) if x.kernel == "_gated_residual_kernel")
    over = types.SimpleNamespace(metadata=types.SimpleNamespace(shared=triton_build.SHARED_PER_BLOCK[cap] + 1),
                                 asm=compiled(small, cap).asm)
    found = problems(small, over, cap)
    assert len(found) == 1 and "shared memory" in found[0], found


def test_the_checks_fail_on_a_kernel_without_its_claimed_units_or_that_does_not_compile():
    cap = TARGETS["sm_121"]
    gemm = _gemm_launch(cap, fits=True)
    kernel = compiled(gemm, cap)
    no_mma = types.SimpleNamespace(metadata=kernel.metadata,
                                   asm={"ptx": re.sub(r"mma\.sync\S*", "nop", kernel.asm["ptx"])})
    found = problems(gemm, no_mma, cap, candidates=[_gemm_config(gemm)])
    assert len(found) == 1 and "int8 MMA" in found[0], found
    e4m3 = next(x for x in launches(cap) if x.kernel == "_quant_rows_kernel" and any(
        getattr(getattr(v, "fn", None), "__name__", "") == "encode_e4m3" for v in x.consts.values()))
    k = compiled(e4m3, cap)
    no_cvt = types.SimpleNamespace(metadata=k.metadata, asm={"ptx": k.asm["ptx"].replace("e4m3x2", "e5m2x2")})
    assert any("e4m3 conversion" in p for p in problems(e4m3, no_cvt, cap))
    # a signature the kernel cannot take (float codes into the int8 MMA): a compile error, reported
    broken = Launch(gemm.kernel, gemm.fn, tuple((n, "*fp32" if n == "a_ptr" else t) for n, t in gemm.signature),
                    gemm.constexprs, gemm.attrs, gemm.options)
    found = problems(broken, _compile_or_error(broken, cap), cap)
    assert len(found) == 1 and "does not compile" in found[0], found
