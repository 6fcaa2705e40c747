"""Test helper: the benchmark contracts' command lines as a user runs them (`python -m benchmarks.compare`, in a
subprocess or, for the many crafted results, its `main` on the same argv in this process: the same exit code and
output without a second interpreter importing torch) and the crafting of results that break one rule."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def compare(result, contract: Path, tmp: Path | None = None, *, subprocess_: bool = False
            ) -> subprocess.CompletedProcess:
    """`benchmarks.compare` on `result` (a file, or a dict written to tmp/r.json with inf and NaN as JSON's
    Infinity / NaN, as json.dumps writes them); `subprocess_`: as `python -m benchmarks.compare`, else its `main`."""
    if isinstance(result, dict):
        path = tmp / "r.json"
        path.write_text(json.dumps(result))
        result = path
    argv = ["--contract", str(contract), "--result", str(result)]
    if subprocess_:
        return subprocess.run([sys.executable, "-m", "benchmarks.compare", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
    from benchmarks.compare import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def has(out: str, needle: str) -> bool:
    """needle is in out, whitespace runs compared as one space (compare pads its columns)."""
    return " ".join(needle.split()) in " ".join(out.split())


def broken(result: dict, where: str, value) -> dict:
    """`result` with result[a][b]... = value for where = "a.b..."."""
    *keys, last = where.split(".")
    d = result
    for k in keys:
        d = d[k]
    d[last] = value
    return result
