"""A kernel's own compile test for the GPUs, on the CPU: the kernel through Triton's whole compiler for sm_<cap>, as a
launch at the DiT's shapes specializes it, and the checks every such test makes of the result (the target's PTX, its
shared memory per block, its tensor-core instruction). Used by the budget_attn kernels' tests; every other runtime
kernel is compiled for the Spark and the B200 by `test_kernel_targets.py`."""

from __future__ import annotations

import inspect
import re


def compile_for(kernel, cap: tuple[int, int], config: dict, const: dict, kinds: dict, pointer: str,
                aligned: str):
    """`kernel` (the plain function `triton_build.build` JIT-compiles) at `const`, its other parameters typed by
    `kinds` ({name: Triton type}; other pointers `pointer`, the rest i32); the pointers and the parameters whose
    names match `aligned` (a regex: the strides a launch's shapes make 16-aligned) specialized as 16-divisible; the
    launch options of `config` (num_warps, num_stages) and `triton_build.FP_OPTIONS`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from h3direct.triton_build import FP_OPTIONS, build

    params = list(inspect.signature(kernel).parameters)
    sig = {p: "constexpr" if p in const else kinds.get(p, pointer if p.endswith("_ptr") else "i32") for p in params}
    divisible = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(params)
                 if p.endswith("_ptr") or re.fullmatch(aligned, p)}
    options = {key: value for key, value in config.items() if key in ("num_warps", "num_stages")}
    return triton.compile(ASTSource(build(kernel), sig, const, divisible),
                          target=GPUTarget("cuda", cap[0] * 10 + cap[1], 32), options={**options, **FP_OPTIONS})


def assert_fits_and_uses(compiled, cap: tuple[int, int], config: dict, mma: str) -> None:
    """The compiled kernel targets sm_<cap>, fits its shared memory per block (`triton_build.SHARED_PER_BLOCK`) and
    its PTX has the tensor-core instruction `mma` (a regex)."""
    from h3direct.triton_build import SHARED_PER_BLOCK

    ptx, sm = compiled.asm["ptx"], f"sm_{cap[0]}{cap[1]}"
    assert f".target {sm}" in ptx
    assert compiled.metadata.shared <= SHARED_PER_BLOCK[cap], \
        f"{config}: {compiled.metadata.shared} bytes of shared memory > {SHARED_PER_BLOCK[cap]} a block on {sm}"
    assert re.search(mma, ptx), f"no {mma} in the {sm} PTX"
