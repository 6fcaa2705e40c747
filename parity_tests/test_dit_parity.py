"""The DiT merge gate: every recorded layer of every trace, teacher-forced and free-running; an approximate mode's
free run also against ComfyUI's fast mode of its class and against its own baseline (`drift.py`)."""

from __future__ import annotations

import pytest

from parity_tests.drift import History
from parity_tests.gate import NoTwin, run_dit_case
from parity_tests.models import run_dtype
from parity_tests.results import CaseResult

pytestmark = pytest.mark.parity


def test_traces_pair_up(trace_problems):
    """Every trace found must be runnable: a trace without its checkpoint/inputs is a broken gate, not a skip."""
    if trace_problems:
        pytest.fail("\n".join(trace_problems), pytrace=False)


@pytest.mark.parametrize("mode", ["teacher", "free"])
def test_dit_layers(dit_case, mode, gate_options, conclude, request):
    label = gate_options["attention_label"]
    compute, reason = run_dtype(gate_options["attention"], dit_case.compute, gate_options["device"])
    if reason is not None:  # a backend asked for and not run is a red gate, never a skip
        return conclude(CaseResult(dit_case, mode, label, notes=[f"--attention {label} cannot run it: {reason}"],
                                   pending="not run"))
    try:
        result = run_dit_case(dit_case, mode=mode, attention=gate_options["attention"], device=gate_options["device"],
                              budgets=gate_options["budgets"], replay=gate_options["replay"],
                              compute=compute, fp8_linear=gate_options.get("fp8_linear", "off"),
                              no_twin=gate_options["no_twin"], sage_class=gate_options["sage_class"])
    except NoTwin as exc:
        return conclude(CaseResult(dit_case, mode, label, notes=[str(exc)], pending="not run"))
    history = History(request.config, dit_case.trace.parent, dit_case.trace.stem, gate_options["device"],
                      gate_options["budgets"])
    history.judge(result)
    conclude(result, history)
