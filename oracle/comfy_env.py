"""Locate a ComfyUI checkout and import it in-process with the oracle's settings (device, dtype, attention).

ComfyUI reads its command-line flags once, when `comfy.cli_args` is imported, and picks the attention function
when `comfy.ldm.modules.attention` is imported. `open_comfy` therefore sets the flags on ComfyUI's own `args`
object before anything else of ComfyUI is imported, and refuses to reconfigure an already-imported ComfyUI.

Two settings (`SETTINGS`): "oracle" (the default; what traces are recorded under) turns on deterministic algorithms
(and cuBLAS's fixed workspace), turns off cudnn.benchmark, TF32, smart memory and dynamic VRAM; "user" leaves
ComfyUI's own defaults as `main.py` starts it (nothing deterministic, torch's TF32 defaults, smart memory,
`set_cudnn_benchmark()`), for timing ComfyUI as its users run it. Two parts of main.py's start need the process
before torch is imported: its CUDA allocator choice (`prepare_user_process` applies it) and DynamicVRAM
(comfy-aimdo), which an in-process import leaves off (`describe()` says so).
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from h3direct.errors import H3Error

ENV_ROOT = "H3_COMFY_ROOT"
SETTINGS = ("oracle", "user")
ENV_COMMIT = "H3_COMFY_COMMIT"

# attention name -> ComfyUI flag (attribute of comfy.cli_args.args); "default" sets none
ATTENTION_FLAGS: dict[str, str | None] = {
    "pytorch": "use_pytorch_cross_attention",
    "sage": "use_sage_attention",
    "flash": "use_flash_attention",
    "split": "use_split_cross_attention",
    "sub_quad": "use_quad_cross_attention",
    "ck": "use_ck_attention",
    "default": None,
}

# files whose content identifies the H3 implementation (hashed into the manifest)
H3_SOURCES = (
    "comfy/ldm/minimax/model.py",
    "comfy/ldm/minimax/vae.py",
    "comfy/ldm/minimax/audio_vae.py",
    "comfy_extras/nodes_minimax_h3.py",
    "comfy/model_detection.py",
    "comfy/model_base.py",
    "comfy/samplers.py",
    "comfy/ops.py",
    "comfy/quant_ops.py",
)


@dataclass
class ComfyEnv:
    """An imported ComfyUI and the settings it was imported with."""

    root: Path
    device: str
    compute_dtype: str
    attention: str
    commit: str
    stand_ins: list[str]
    settings: str = "oracle"
    bf16_patched: bool = False
    modules: dict[str, ModuleType] = field(default_factory=dict)

    def __getattr__(self, name: str) -> ModuleType:  # env.sd, env.samplers, ...
        mods = self.__dict__.get("modules", {})
        if name in mods:
            return mods[name]
        raise AttributeError(name)

    def attention_function(self) -> str:
        """Name of the attention function the H3 model code will call."""
        mm = importlib.import_module("comfy.ldm.minimax.model")
        return getattr(mm.optimized_attention, "__name__", repr(mm.optimized_attention))

    def gpu_fields(self) -> dict[str, Any]:
        """The GPU ComfyUI ran on (name, compute capability, CUDA / cuDNN versions); empty on the CPU."""
        import torch

        if self.device != "cuda":
            return {}
        major, minor = torch.cuda.get_device_capability()
        return {
            "gpu_name": torch.cuda.get_device_name(),
            "gpu_capability": f"{major}.{minor}",
            "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(),
        }

    def nvfp4_mode(self) -> str:
        """How ComfyUI runs NVFP4 linears here: w4a4 (FP4 GEMM) on compute capability >= 10, else w4a16."""
        import torch

        if self.device == "cuda" and torch.cuda.get_device_capability()[0] >= 10:
            return "w4a4"
        return "w4a16"

    def describe(self) -> dict[str, Any]:
        import torch

        try:
            import comfy_kitchen

            ck_version = getattr(comfy_kitchen, "__version__", None) or _dist_version("comfy-kitchen")
        except ImportError:  # pragma: no cover - comfy-kitchen is required by ComfyUI's H3 code
            ck_version = None
        return {
            "comfy_root": str(self.root),
            "python": sys.executable,  # ComfyUI's environment: the replay commands the gate prints run ComfyUI there
            "device": self.device,
            **self.gpu_fields(),
            "torch": torch.__version__,
            "comfy_kitchen": ck_version,
            "deterministic": self.settings == "oracle",
            "stand_ins": self.stand_ins,
            "bf16_patched": self.bf16_patched,
            "num_threads": torch.get_num_threads(),
            "h3_sources_sha256": source_digest(self.root),
            **({} if self.settings == "oracle" else {
                "settings": self.settings,
                "dynamic_vram": False,  # comfy-aimdo's allocator is set up by main.py before torch loads
                "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}),
        }


def _dist_version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "unknown"


def resolve_root(root: str | Path | None) -> Path:
    """`--comfy-root`, else $H3_COMFY_ROOT; must contain comfy/ldm/minimax/model.py."""
    value = root if root else os.environ.get(ENV_ROOT)
    if not value:
        raise H3Error(f"no ComfyUI checkout given: pass --comfy-root or set {ENV_ROOT}")
    path = Path(value).expanduser().resolve()
    if not path.is_dir():
        raise H3Error("ComfyUI root is not a directory", path=path)
    if not (path / "comfy" / "sd.py").is_file():
        raise H3Error("not a ComfyUI checkout (no comfy/sd.py)", path=path)
    if not (path / "comfy" / "ldm" / "minimax" / "model.py").is_file():
        raise H3Error("this ComfyUI has no MiniMax H3 code (comfy/ldm/minimax/model.py missing)", path=path)
    return path


def comfy_commit(root: Path) -> str:
    """git HEAD of the checkout (short), else $H3_COMFY_COMMIT, else 'unknown'."""
    if (root / ".git").exists():
        try:
            out = subprocess.run(
                ["git", "-C", str(root), "rev-parse", "--short=8", "HEAD"],
                capture_output=True,
                text=True,
                timeout=10,
                check=True,
            )
            return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return os.environ.get(ENV_COMMIT, "unknown")


def comfy_version(root: Path) -> str:
    """ComfyUI's release (`comfyui_version.py`), else 'unknown'."""
    p = root / "comfyui_version.py"
    text = p.read_text() if p.is_file() else ""
    found = [line.split("=", 1)[1].strip().strip("'\"") for line in text.splitlines() if line.startswith("__version__")]
    return found[0] if found else "unknown"


def prepare_user_process(root: str | Path | None = None) -> None:
    """What ComfyUI's `main.py` sets up before torch loads, for a process that will `open_comfy(settings="user")`:
    its CUDA allocator choice (ComfyUI's own `cuda_malloc` rule: PYTORCH_CUDA_ALLOC_CONF backend:cudaMallocAsync
    where it applies). Must run before `import torch`."""
    if "torch" in sys.modules:
        raise H3Error("prepare_user_process must run before torch is imported (it picks the CUDA allocator)")
    root = resolve_root(root)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    importlib.import_module("cuda_malloc")


def source_digest(root: Path) -> str:
    h = hashlib.sha256()
    for rel in H3_SOURCES:
        p = root / rel
        h.update(rel.encode())
        h.update(p.read_bytes() if p.is_file() else b"<missing>")
    return h.hexdigest()


class ComfyUnavailable(H3Error):
    """ComfyUI does not import in this Python: a package it needs is missing here (`missing_package`)."""


def missing_package(name: str) -> str:
    """One line for a package ComfyUI imports that this Python lacks: where ComfyUI should run instead."""
    return (f"ComfyUI needs the Python package {name!r}, which this Python ({sys.executable}) lacks: run ComfyUI in "
            f"its own environment with --comfy-python PY (README, 'Recording with ComfyUI'), or install ComfyUI's "
            f"requirements here (pyproject extra 'oracle', in an environment of its own: it pins ComfyUI's "
            f"comfy-kitchen)")


_OPENED: ComfyEnv | None = None


def open_comfy(
    root: str | Path | None = None, *, device: str = "cpu", compute_dtype: str = "fp32", attention: str = "pytorch",
    settings: str = "oracle",
) -> ComfyEnv:
    """Import ComfyUI from `root` configured for `device` (cpu|cuda), `compute_dtype` (fp32|bf16|fp16), `attention`,
    under the oracle's settings or a user's (`SETTINGS`, module docstring)."""
    global _OPENED
    root = resolve_root(root)
    if device not in ("cpu", "cuda"):
        raise H3Error(f"--device {device!r}: expected cpu or cuda")
    if compute_dtype not in ("fp32", "bf16", "fp16"):
        raise H3Error(f"--compute-dtype {compute_dtype!r}: expected fp32, bf16 or fp16")
    if attention not in ATTENTION_FLAGS:
        raise H3Error(f"--attention {attention!r}: expected one of {', '.join(ATTENTION_FLAGS)}")
    if settings not in SETTINGS:
        raise H3Error(f"ComfyUI settings {settings!r}: expected one of {', '.join(SETTINGS)}")
    if _OPENED is not None:
        same = (_OPENED.root, _OPENED.device, _OPENED.attention, _OPENED.settings) == (root, device, attention,
                                                                                        settings)
        if not same:
            raise H3Error("ComfyUI is already imported in this process with other settings; use a new process")
        _set_compute_dtype(_OPENED, compute_dtype)
        return _OPENED
    if "comfy" in sys.modules:  # ComfyUI's `comfy` is a namespace package (no __init__.py): compare its __path__
        loaded = [Path(p).resolve() for p in getattr(sys.modules["comfy"], "__path__", [])]
        if loaded != [root / "comfy"]:
            raise H3Error(f"a different 'comfy' package is already imported ({', '.join(map(str, loaded))})")

    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise H3Error("--device cuda requested but torch.cuda.is_available() is False")

    from oracle.stand_ins import install_stand_ins

    stand_ins = install_stand_ins()
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        cli_args = importlib.import_module("comfy.cli_args")
    except ModuleNotFoundError as exc:
        raise ComfyUnavailable(missing_package(exc.name)) from None
    args = cli_args.args
    args.cpu = device == "cpu"
    oracle = settings == "oracle"
    args.deterministic = oracle
    args.disable_smart_memory = oracle
    # fp32 on a GPU: ComfyUI would otherwise pick bf16/fp16 by itself
    args.force_fp32 = device == "cuda" and compute_dtype == "fp32"
    for flag in ATTENTION_FLAGS.values():
        if flag:
            setattr(args, flag, False)
    if ATTENTION_FLAGS[attention]:
        setattr(args, ATTENTION_FLAGS[attention], True)
    if hasattr(args, "disable_dynamic_vram"):  # (user settings too: DynamicVRAM needs main.py's start)
        args.disable_dynamic_vram = True
    if oracle:
        if device == "cuda":  # cuBLAS is deterministic only with a fixed workspace (read when its handle is created)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        if device == "cuda":
            torch.backends.cudnn.benchmark = False
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False

    mods: dict[str, ModuleType] = {}
    names = {
        "model_management": "comfy.model_management",
        "sd": "comfy.sd",
        "samplers": "comfy.samplers",
        "utils": "comfy.utils",
        "nested_tensor": "comfy.nested_tensor",
        "patcher_extension": "comfy.patcher_extension",
        "attention": "comfy.ldm.modules.attention",
        "h3_model": "comfy.ldm.minimax.model",
    }
    for key, name in names.items():
        try:
            mods[key] = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("comfy"):
                raise ComfyUnavailable(missing_package(exc.name)) from None
            raise H3Error(f"ComfyUI checkout is incomplete: cannot import {name} ({exc})", path=root) from None
    if not oracle:  # main.py's start: cudnn.benchmark as its --fast flags say (off by default)
        mods["model_management"].set_cudnn_benchmark()
    env = ComfyEnv(
        root=root,
        device=device,
        compute_dtype=compute_dtype,
        attention=attention,
        commit=comfy_commit(root),
        stand_ins=stand_ins,
        settings=settings,
        modules=mods,
    )
    _set_compute_dtype(env, compute_dtype)
    _OPENED = env
    return env


_ORIGINAL_BF16 = None


def _set_compute_dtype(env: ComfyEnv, compute_dtype: str) -> None:
    """bf16 on CPU: ComfyUI never picks it by itself, so `should_use_bf16` is forced (recorded as bf16_patched)."""
    global _ORIGINAL_BF16
    mm = env.modules["model_management"]
    if _ORIGINAL_BF16 is None:
        _ORIGINAL_BF16 = mm.should_use_bf16
    env.compute_dtype = compute_dtype
    if compute_dtype == "bf16" and env.device == "cpu":
        mm.should_use_bf16 = lambda *a, **k: True
        env.bf16_patched = True
    else:
        mm.should_use_bf16 = _ORIGINAL_BF16
        env.bf16_patched = False
