"""The `shared` marker (parity_tests/plugin.py): a test that reads ../shared/oracle, the project's shared data beside
the checkout, is deselected and counted in one summary line when that folder is not there (CI's clean clone), never
skipped; with the folder there, it runs. The folder is discovery's SHARED_ORACLE: a conftest of the temporary test
folder points it elsewhere, as a checkout elsewhere would."""

from __future__ import annotations

from pathlib import Path

from test_gate_options import _pytest

TESTS = """
import pytest


@pytest.mark.shared
def test_reads_shared():
    pass


@pytest.mark.parametrize("n", [pytest.param(1, marks=pytest.mark.shared), 2])
def test_one_param_reads_shared(n):
    pass


def test_plain():
    pass
"""


def _run(folder: Path, shared: Path):
    (folder / "conftest.py").write_text("from pathlib import Path\n\nfrom parity_tests import discovery\n\n"
                                        f"discovery.SHARED_ORACLE = Path({str(shared)!r})\n")
    (folder / "test_uses_shared.py").write_text(TESTS)
    return _pytest(["-rs", str(folder)], folder)


def test_without_the_shared_folder_its_tests_are_deselected_and_counted(tmp_path):
    missing = tmp_path / "no_such_folder"
    r = _run(tmp_path, missing)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("2 passed, 2 deselected in"), out[-2000:]
    lines = [ln for ln in out.splitlines() if "shared-data test(s) deselected" in ln]
    assert lines == [f"2 shared-data test(s) deselected: no {missing} (../shared/oracle, the project's shared data "
                     f"beside the checkout, not part of the repository)"], out[-2000:]
    assert "SKIPPED" not in out and " skipped" not in out, out[-2000:]


def test_with_the_shared_folder_its_tests_run(tmp_path):
    there = tmp_path / "oracle"
    there.mkdir()
    r = _run(tmp_path, there)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert out.strip().splitlines()[-1].startswith("4 passed in"), out[-2000:]
    assert "deselected" not in out, out[-2000:]
