"""A Spark-shaped run on a Hopper GPU (`bash benchmarks/run_gpu.sh spark` puts this folder first on PYTHONPATH, so
every Python the part starts imports this first): the two facts of a GB10 (DGX Spark) that change what the runtime
picks, on an sm_90 GPU that has neither.

- no FlashAttention-3: FA3 is built for Hopper only, so on a GB10 `fa3` and `fa3_fp8` are unavailable; here their
  module does not import, and every choice that would take them (the exact rows and fallbacks of the sparse
  backends, the frontier's exact role, the tiers) takes what a GB10 runs instead;
- 99 KiB of shared memory per block (12.x): the int8 GEMM's autotuning launches only the tile shapes whose compiled
  kernel fits that (`h3direct.triton_build.SHARED_PER_BLOCK`, what `int8_gemm.fitting` reads), as on a GB10.

What it cannot make Spark-like: the GPU's rates (no FP4 tensor cores here, so NVFP4 runs W4A16 as on any sm_90),
its unified memory, its arch-specific code paths (Triton compiles for sm_90 here: the int8 GEMM's Hopper tile shapes
(TMA, warpgroup MMA) take more shared memory than the Spark's `mma.sync` ones, so within 99 KiB none fits here and
the int8 linears run cuBLASLt's GEMM, where on the Spark 4 of the 9 fit: `tests/test_kernel_targets.py`).
"""

import importlib.abc
import importlib.machinery
import sys

HIDDEN = ("fa3_fwd_interface", "fa3_fwd", "fa3_fwd_config")  # the fa3-fwd wheel's modules
SHARED_TABLE = "h3direct.triton_build"  # patched as it is imported: nothing (torch included) is imported here, so a
# process that must set things up before torch loads (ComfyUI's allocator choice, `oracle.comfy_env`) still can


class _SparkShape(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            raise ImportError(f"{name}: hidden in a Spark-shaped run (FA3 is Hopper-only; a GB10 has none)")
        if name == SHARED_TABLE:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _SparkShared(spec.loader)
            return spec
        return None


class _SparkShared(importlib.abc.Loader):
    """`h3direct.triton_build` as it is, then the Hopper's shared memory per block set to the GB10's."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        module.SHARED_PER_BLOCK[(9, 0)] = module.SHARED_PER_BLOCK[(12, 1)]


sys.meta_path.insert(0, _SparkShape())
