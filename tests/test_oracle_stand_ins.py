"""Stand-ins import but refuse to compute (checked in a fresh interpreter that lacks the real packages)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

CODE = """
import sys
from oracle.stand_ins import install_stand_ins, StandInUsed, is_stand_in
missing = install_stand_ins()
assert 'torchvision' in missing, missing
import torchvision, torchvision.transforms.functional as F
from torchvision import transforms
assert is_stand_in(torchvision)
class Sub(transforms.Compose): pass
try:
    F.resize(1, 2)
except StandInUsed as e:
    print('refused:', e)
else:
    sys.exit('stand-in computed something')
"""


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="real torchvision installed")
def test_stand_in_imports_but_refuses_calls() -> None:
    r = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "refused: torchvision.transforms.functional.resize was called" in r.stdout
