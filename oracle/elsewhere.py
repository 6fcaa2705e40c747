"""ComfyUI in its own Python environment: `python -m oracle CMD --comfy-python PY` runs the ComfyUI side of CMD with
PY (the user's ComfyUI install, e.g. the DGX Spark's ComfyUI image, or a venv made from ComfyUI's requirements), so
recording never changes the runtime's packages (ComfyUI pins its own comfy-kitchen; h3direct's sol_attn needs a newer
one).

PY gets this install's `oracle` and `h3direct` packages on its path (a folder of two links, nothing installed into
it); they need what every ComfyUI environment has (torch, safetensors, numpy, einops). `record`, `record-vae` and
`record-generate` run whole in PY; `replay` runs its ComfyUI side in PY and its h3direct side (`--direct`) here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from h3direct.errors import H3Error

ENV_PYTHON = "H3_COMFY_PYTHON"
FLAG = "--comfy-python"
PACKAGES = ("oracle", "h3direct")  # what PY imports from this install


def add_argument(parser) -> None:
    parser.add_argument(FLAG, metavar="PYTHON",
                        help=f"the Python of ComfyUI's own environment: ComfyUI runs there, this environment's "
                             f"packages stay as they are (default: ${ENV_PYTHON}, else this Python)")


def python_of(args) -> str | None:
    """--comfy-python, else $H3_COMFY_PYTHON; None when neither names another interpreter than this one."""
    given = getattr(args, "comfy_python", None) or os.environ.get(ENV_PYTHON) or None
    if given is None:
        return None
    found = shutil.which(given) or (given if Path(given).is_file() else None)
    if found is None or not os.access(found, os.X_OK):
        raise H3Error(f"{FLAG} {given}: not an executable Python")
    if os.path.abspath(found) == os.path.abspath(sys.executable):  # (not realpath: a venv's python is a link)
        return None
    return found


def without_flag(argv: list[str]) -> list[str]:
    """argv without --comfy-python and its value (either form)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == FLAG:
            skip = True
        elif not a.startswith(FLAG + "="):
            out.append(a)
    return out


def run(python: str, argv: list[str]) -> int:
    """`PY -m oracle ARGV` with this install's packages on PY's path; its output goes where ours goes."""
    with tempfile.TemporaryDirectory(prefix="h3_oracle_path_") as folder:
        for name in PACKAGES:
            module = sys.modules.get(name) or __import__(name)
            os.symlink(Path(module.__file__).resolve().parent, Path(folder) / name)
        env = {**os.environ, ENV_PYTHON: "",
               "PYTHONPATH": os.pathsep.join(p for p in (folder, os.environ.get("PYTHONPATH")) if p)}
        sys.stdout.flush()
        try:
            return subprocess.run([python, "-m", "oracle", *without_flag(argv)], env=env).returncode
        except OSError as exc:
            raise H3Error(f"{FLAG} {python}: cannot run it ({exc.strerror})") from None
