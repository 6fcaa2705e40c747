"""Build-time pip helpers of Dockerfile.spark (stdlib only; runs in the base image before h3direct is installed).

    python pip_setup.py constraints --pyproject pyproject.toml --out FILE [--require SPEC ...] [--extras A,B]
        Checks that no extra to be installed (--extras) pins a package against a --require line, and the base
        image (a CUDA >= 13 torch that satisfies the project's torch requirement, a Python the project supports);
        then writes a pip constraints file that keeps the base's torch: `torch==<its version>`, the base's own
        constraints ($PIP_CONSTRAINT, as NGC images set it) and each --require line.
    python pip_setup.py extra NAME --pyproject pyproject.toml [--exclude PKG ...]
        Prints the requirements of one optional-dependency group, minus the excluded packages, one a line.

A base or a pin that does not fit is one line on stderr and exit 2, before anything is installed.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib

MIN_CUDA_MAJOR = 13  # GB10 (sm_121) kernels need CUDA 13


def _fail(message: str):
    print(f"pip_setup: {message}", file=sys.stderr)
    raise SystemExit(2)


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # pip always carries a copy
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version


def _name(spec: str) -> str:
    """Normalized distribution name of a requirement line (PEP 503)."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    return re.sub(r"[-_.]+", "-", m.group(1)).lower() if m else ""


def _project(pyproject: str) -> dict:
    with open(pyproject, "rb") as f:
        return tomllib.load(f)["project"]


def check_base(project: dict) -> str:
    """The base's torch version; one line and exit 2 when the base does not fit."""
    Requirement, Version = _packaging()
    python_req = project.get("requires-python")
    here = ".".join(map(str, sys.version_info[:3]))
    if python_req:
        from_spec = Requirement(f"python{python_req}").specifier
        if not from_spec.contains(here, prereleases=True):
            _fail(f"the base image's Python {here} does not satisfy requires-python {python_req}")
    try:
        import torch
    except ImportError:
        _fail("the base image has no torch; pass --build-arg BASE=<a CUDA 13 PyTorch image>")
    cuda = torch.version.cuda
    if cuda is None or int(cuda.split(".")[0]) < MIN_CUDA_MAJOR:
        _fail(f"the base image's torch {torch.__version__} is built for CUDA {cuda or 'none'}; "
                 f"the DGX Spark (sm_121) needs CUDA >= {MIN_CUDA_MAJOR}")
    for dep in project.get("dependencies", []):
        req = Requirement(dep)
        # pip accepts an installed pre-release (NGC ships torch X.Y.0a0+...) if it meets the specifier
        if req.name == "torch" and not req.specifier.contains(Version(torch.__version__), prereleases=True):
            _fail(f"the base image's torch {torch.__version__} does not satisfy the project's "
                     f"'{dep}'; pip would replace it. Pass --build-arg BASE=<an image with a newer torch>")
    return torch.__version__


def check_requires(project: dict, extras: list[str], required: list[str]) -> None:
    """One line and exit 2 when an installed extra pins a package (`==`) to a version a --require line excludes."""
    Requirement, Version = _packaging()
    groups = project.get("optional-dependencies", {})
    for extra_name in extras:
        if extra_name not in groups:
            continue  # pip warns about an unknown extra itself
        for dep in groups[extra_name]:
            pinned = Requirement(dep)
            for spec in required:
                want = Requirement(spec)
                if _name(want.name) != _name(pinned.name):
                    continue
                exact = [s.version for s in pinned.specifier if s.operator == "=="]
                if exact and not want.specifier.contains(Version(exact[0]), prereleases=True):
                    _fail(f"pyproject's extra {extra_name!r} pins {dep!r}, but this image needs {spec!r}; "
                          f"bump the pin in pyproject.toml")


def constraints(args) -> int:
    project = _project(args.pyproject)
    check_requires(project, [e for e in args.extras.split(",") if e], args.require)
    lines = [f"torch=={check_base(project)}"]
    base = os.environ.get("PIP_CONSTRAINT", "")
    for path in base.split():
        if os.path.isfile(path) and os.path.abspath(path) != os.path.abspath(args.out):
            with open(path) as f:
                lines += [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")
                          and _name(ln) != "torch"]
    lines += args.require
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"pip_setup: wrote {args.out}: " + "; ".join(lines[:1] + args.require), file=sys.stderr)
    return 0


def extra(args) -> int:
    groups = _project(args.pyproject).get("optional-dependencies", {})
    if args.name not in groups:
        _fail(f"pyproject.toml has no extra {args.name!r} (has: {', '.join(groups)})")
    excluded = {_name(e) for e in args.exclude}
    for spec in groups[args.name]:
        if _name(spec) not in excluded:
            print(spec)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pip_setup", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("constraints")
    c.add_argument("--pyproject", default="pyproject.toml")
    c.add_argument("--out", required=True)
    c.add_argument("--require", action="append", default=[], metavar="SPEC")
    c.add_argument("--extras", default="", help="comma-separated extras that will be installed (checked against "
                                                "--require)")
    e = sub.add_parser("extra")
    e.add_argument("name")
    e.add_argument("--pyproject", default="pyproject.toml")
    e.add_argument("--exclude", action="append", default=[], metavar="PKG")
    args = p.parse_args(argv)
    return constraints(args) if args.cmd == "constraints" else extra(args)


if __name__ == "__main__":
    sys.exit(main())
