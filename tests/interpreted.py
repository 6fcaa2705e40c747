"""Test helper: a script run under Triton's interpreter (`TRITON_INTERPRET=1`, which must be set before Triton is
imported, hence a subprocess) that prints one line `RESULT <json>`; its result as a dict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(source: str) -> dict:
    pytest.importorskip("triton", reason="triton is not installed (the test extra has it on x86_64 Linux)")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    return json.loads(line[len("RESULT "):])
