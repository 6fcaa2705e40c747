"""Test helper: the DGX Spark image (`Dockerfile.spark`) on its GPU, as the runtime's probes see it, without either.

- `sage_build(arch_list)`: what SageAttention 2's setup.py at `tools/build_sageattention.sh`'s pinned revision builds
  for a TORCH_CUDA_ARCH_LIST: its gencode targets and its extension modules. Written down from thu-ml/SageAttention's
  setup.py at that revision (the TORCH_CUDA_ARCH_LIST parsing, the `HAS_SM*` flags and the `CUDAExtension`s each one
  adds): upstream facts, not h3direct's.
- `install_sageattention(root, modules)`: a stand-in `sageattention` package holding those modules, importable from
  `root` (empty modules: no probe calls into them).
- `run_sage_script(tmp_path, *args)`: `tools/build_sageattention.sh` run for real, with stand-ins for nvcc, the
  source tree and pip: the TORCH_CUDA_ARCH_LIST and pip arguments it builds with.
- `on_a_spark(monkeypatch, tmp_path)`: a GB10 (compute capability 12.1, 128 GB shared with the CPU) at the seams the
  probes read (`torch.cuda`'s availability, capability, properties; `triton_build.capability`), and the image's
  packages: SageAttention 2 as `tools/build_sageattention.sh --arch 12.1` builds it, comfy-kitchen with CUDA kernels
  for it (its own checks answer yes: the image installs its aarch64 wheel with sm_120f kernels), cuDNN, Triton; no
  FlashAttention 3.
"""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SAGE_SCRIPT = ROOT / "tools" / "build_sageattention.sh"
SPARK = (12, 1)
SPARK_MEMORY = 128 * 10**9  # GB10: 128 GB of LPDDR5X, the CPU's memory too

# SageAttention's setup.py: each arch it accepts -> the arch-specific target it compiles ("90a" etc.), and the
# extensions a build adds when any of the given archs is among those it was asked for
_SAGE_TARGETS = {"8.0": "80", "8.6": "86", "8.9": "89", "9.0": "90a", "10.0": "100a", "12.0": "120a", "12.1": "121a"}
_SAGE_EXTENSIONS = (
    ("_qattn_sm80", {"8.0", "8.6", "8.9", "9.0", "10.0", "12.0", "12.1"}),
    ("_qattn_sm89", {"8.9", "9.0", "10.0", "12.0", "12.1"}),
    ("_qattn_sm90", {"9.0"}),
    ("_fused", set(_SAGE_TARGETS)),  # added unconditionally
)


@dataclass(frozen=True)
class SageBuild:
    gencodes: tuple[str, ...]  # nvcc's -gencode values
    modules: frozenset[str]  # sageattention.<module> extensions


def sage_build(arch_list: str) -> SageBuild:
    """What SageAttention's setup.py builds for TORCH_CUDA_ARCH_LIST=`arch_list`."""
    archs = set()
    for item in re.split(r"[;,]", arch_list):
        it = item.strip().lower().replace("sm_", "").replace("compute_", "").replace("a", "")
        if it.endswith("+ptx"):
            it = it[:-4]
        if len(it) == 2 and it.isdigit():
            it = f"{it[0]}.{it[1]}"
        if it:
            archs.add(it)
    known = sorted(a for a in archs if a in _SAGE_TARGETS)
    gencodes = tuple(f"arch=compute_{_SAGE_TARGETS[a]},code=sm_{_SAGE_TARGETS[a]}" for a in known)
    modules = frozenset(name for name, needs in _SAGE_EXTENSIONS if name == "_fused" or needs & set(known))
    return SageBuild(gencodes, modules)


def install_sageattention(root: Path, modules) -> Path:
    """A stand-in SageAttention 2 package under `root` with these extension modules; `root` to put on sys.path."""
    pkg = root / "sageattention"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        "from . import _fused  # noqa: F401  (core.py imports its quantizers at import, as the real package does)\n"
        "def sageattn(*a, **k):\n    raise AssertionError('a probe must not call it')\n"
        "sageattn_qk_int8_pv_fp8_cuda = sageattn\n")
    for name in modules:
        (pkg / f"{name}.py").write_text("")
    return root


def _forget(prefix: str) -> None:
    for name in [n for n in sys.modules if n == prefix or n.startswith(prefix + ".")]:
        del sys.modules[name]


def gb10_properties() -> types.SimpleNamespace:
    """torch.cuda.get_device_properties of a GB10, as far as the runtime reads it (whether its driver calls it
    integrated is not known here: it says not, and the capability decides)."""
    return types.SimpleNamespace(name="NVIDIA GB10", major=SPARK[0], minor=SPARK[1], total_memory=SPARK_MEMORY,
                                 is_integrated=False, multi_processor_count=48,
                                 shared_memory_per_block_optin=99 * 1024)


def gpu_seams(capability: tuple[int, int], properties) -> list[tuple[object, str, object]]:
    """(object, attribute, stand-in) for each seam where the runtime's probes and launch tables see a CUDA GPU: CUDA
    available, device 0 current, its compute capability (torch's and `triton_build.capability`), its properties."""
    from h3direct import triton_build

    return [(torch.cuda, "is_available", lambda: True), (torch.cuda, "current_device", lambda: 0),
            (torch.cuda, "get_device_capability", lambda device=None: capability),
            (triton_build, "capability", lambda index: capability),
            (torch.cuda, "get_device_properties", lambda device=None: properties)]


def on_a_spark(monkeypatch, tmp_path: Path, sage_modules=None) -> None:
    """The Spark image on a GB10, at the probes' seams (module docstring); `sage_modules`: the SageAttention build's
    extensions (default: what `tools/build_sageattention.sh --arch 12.1` builds)."""
    from h3direct.checkpoint.quant import kitchen

    for obj, name, value in gpu_seams(SPARK, gb10_properties()):
        monkeypatch.setattr(obj, name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    if sage_modules is None:
        sage_modules = sage_build(run_sage_script(tmp_path, "--arch", "12.1").arch_list).modules
    _forget("sageattention")
    monkeypatch.syspath_prepend(str(install_sageattention(tmp_path / "sage", sage_modules)))
    monkeypatch.setitem(sys.modules, "comfy_kitchen", _kitchen())
    monkeypatch.setitem(sys.modules, "fa3_fwd_interface", None)  # not in the image: FlashAttention 3 is Hopper-only
    kitchen.kitchen_op.cache_clear()


def leave_the_spark() -> None:
    """After `on_a_spark` (its monkeypatch undone): forget the stand-in modules imported and the kitchen lookups
    cached under it."""
    from h3direct.checkpoint.quant import kitchen

    _forget("sageattention")
    kitchen.kitchen_op.cache_clear()


def _kitchen() -> types.ModuleType:
    """comfy-kitchen >= 0.2.40 with its CUDA kernels for the GPU: its checks answer yes, its kernels are not called."""
    ck = types.ModuleType("comfy_kitchen")

    def kernel(*a, **k):
        raise AssertionError("a probe must not call a kernel")

    ck.int8_attention, ck.sol_attn, ck.dequantize_nvfp4, ck.scaled_mm_nvfp4 = kernel, kernel, kernel, kernel
    ck.int8_attention_is_available = lambda device=None: True
    ck.sol_attn_is_available = lambda device=None: True
    return ck


@dataclass(frozen=True)
class ScriptRun:
    returncode: int
    stderr: str
    arch_list: str | None  # the TORCH_CUDA_ARCH_LIST SageAttention's setup.py ran under (None: it did not run)
    pip_args: tuple[str, ...]


def run_sage_script(tmp_path: Path, *args: str) -> ScriptRun:
    """`tools/build_sageattention.sh ARGS` run for real with stand-ins: an `nvcc` that only tells its version, a
    SageAttention tree at the pinned revision holding an empty setup.py, and a Python whose `pip wheel` records the
    environment and arguments it got and leaves an empty wheel."""
    import subprocess

    rev = re.search(r"^SAGE_REV=([0-9a-f]{40})", SAGE_SCRIPT.read_text(), re.MULTILINE).group(1)
    run_dir = tmp_path / f"sage-run-{len(list(tmp_path.glob('sage-run-*')))}"
    bin_dir, src, record = run_dir / "bin", run_dir / "src", run_dir / "record.txt"
    bin_dir.mkdir(parents=True)
    src.mkdir()
    (src / "setup.py").write_text("")
    (src / ".h3-source-rev").write_text(rev + "\n")
    (bin_dir / "nvcc").write_text('#!/bin/sh\necho "Cuda compilation tools, release 13.0, V13.0.88"\n')
    (bin_dir / "python").write_text(
        '#!/bin/sh\nprintf "%s\\n" "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST" "$@" > "$H3_SAGE_RECORD"\n'
        'while [ $# -gt 0 ]; do [ "$1" = "-w" ] && : > "$2/sageattention-2.2.0-cp312-cp312-linux_aarch64.whl"; '
        'shift; done\n')
    for f in ("nvcc", "python"):
        (bin_dir / f).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(bin_dir / "python"), "H3_SAGE_RECORD": str(record),
           "HOME": str(run_dir)}
    proc = subprocess.run(["bash", str(SAGE_SCRIPT), *args, "--src", str(src), "--out", str(run_dir / "wheels")],
                          env=env, capture_output=True, text=True, timeout=60)
    if not record.exists():
        return ScriptRun(proc.returncode, proc.stderr, None, ())
    lines = record.read_text().splitlines()
    return ScriptRun(proc.returncode, proc.stderr, lines[0].split("=", 1)[1], tuple(lines[1:]))
