"""A free-running row's replay reproduces the failure the gate printed it for: a bug the free run alone sees (the
audio carried into the model off by 5 %, which every teacher-forced layer, fed ComfyUI's recorded inputs, never meets)
fails the gate's free rows; the row's printed command, run as printed, re-runs the free step and fails with the
report's error, and names where the drift starts. The teacher-forced replay of the same layer passes: it is not the
command for that row."""

from __future__ import annotations

import shlex

import pytest

from h3direct.dit.denoiser import AudioCarry
from parity_tests.discovery import FIXTURES, find_dit_cases
from parity_tests.gate import run_dit_case

LAYER = "blocks.1.mlp.fc2.out"


def _case(compute: str):
    cases, _ = find_dit_cases([FIXTURES])
    return next(c for c in cases if c.id.endswith(f"trace_fx_bf16_ref2va_{compute}"))


@pytest.fixture
def carry_bug(monkeypatch):
    own = AudioCarry.own
    monkeypatch.setattr(AudioCarry, "own", lambda self, carried: own(self, carried) * 1.05)


def _run(command: str, capsys) -> tuple[int, str]:
    """The printed command, run as printed (in this process, so that the planted bug is in it too)."""
    from oracle.__main__ import main

    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "oracle"], command
    capsys.readouterr()
    rc = main(argv[3:])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("compute", ["fp32", "bf16"])
def test_a_free_only_failure_replays_as_printed(compute, carry_bug, capsys):
    case = _case(compute)
    assert run_dit_case(case, mode="teacher").passed, "the planted bug must be one that teacher forcing never sees"
    free = run_dit_case(case, mode="free")
    row = next(r for r in free.layers if r.name == LAYER and r.part == "exact")
    assert not row.passed, row.line()
    assert "--mode free" in row.replay, row.replay
    rc, out = _run(row.replay, capsys)
    assert rc == 1, out
    line = next(ln for ln in out.splitlines() if ln.startswith(f"[h3direct free] {LAYER}:"))
    assert f"rel_l2 {row.rel_l2:.3e}" in line and "OVER BUDGET" in line, (row.line(), line)
    if compute == "bf16":  # the ratio rule: the same errors against ComfyUI's fp32 twin as the report's
        assert f"vs fp32: ours {row.vs_fp32[0]:.3e}, ComfyUI {row.vs_fp32[1]:.3e}" in line, (row.line(), line)
    assert "drifted: h3direct" in out.splitlines()[-1], out
    # where the drift starts: the first free-run tensor out of the rule is the audio handed to the model, while
    # every teacher-forced layer up to the row is within it
    drift = out[out.index("where the drift starts:"):]
    assert "first recorded tensor out of the rule: dit_inner.in.audio:" in drift, drift
    assert "teacher-forced: all" in drift and "within the rule" in drift, drift
    first_free = next(r for r in free.layers if not r.passed)
    assert first_free.name == "dit_inner.in.audio", first_free.line()
    # the teacher-forced replay of the same layer (the command the gate used to print for this row) passes
    rc, out = _run(_teacher_form(row.replay), capsys)
    assert rc == 0 and "all within budget" in out, out


@pytest.fixture
def mlp_bug(monkeypatch):
    """Every DiT h3direct loads (the gate's and the replay's) with blocks.0.mlp's output off by 1 %."""
    from h3direct.dit import loader
    from parity_tests.models import model

    load = loader.load_dit

    def bent(*a, **k):
        dit = load(*a, **k)
        dit.get_submodule("blocks.0.mlp").register_forward_hook(lambda m, i, out: out * 1.01)
        return dit

    model.cache_clear()
    monkeypatch.setattr(loader, "load_dit", bent)
    yield
    model.cache_clear()


def test_a_teacher_forced_failure_is_named_where_the_drift_starts(mlp_bug, capsys):
    """A layer off by 1 % fails teacher-forced and free; the free row's replay names that layer (teacher-forced) as
    where the drift starts, ahead of the tensors it spoiled downstream."""
    case = _case("fp32")
    free = run_dit_case(case, mode="free")
    row = next(r for r in free.layers if r.name == LAYER)
    assert not row.passed, row.line()
    rc, out = _run(row.replay, capsys)
    assert rc == 1, out
    drift = out[out.index("where the drift starts:"):]
    assert "teacher-forced, first layer out of the rule: blocks.0.mlp.out:" in drift, drift
    assert "first recorded tensor out of the rule: blocks.0.mlp.out:" in drift, drift


def _teacher_form(command: str) -> str:
    """The same row's teacher-forced command: no --mode free, no --twin (teacher forcing measures against each
    layer's own fp32 evaluation)."""
    words = shlex.split(command)
    words.remove("--mode")
    words.remove("free")
    if "--twin" in words:
        i = words.index("--twin")
        del words[i:i + 2]
    return shlex.join(words)
