"""The DiT merge gate: every recorded layer of every trace, teacher-forced and free-running; an approximate mode's
free run also against ComfyUI's fast mode of its class and against its own baseline (`drift.py`)."""

from __future__ import annotations

import pytest

from parity_tests.drift import History
from parity_tests.gate import NoTwin, run_dit_case
from parity_tests.models import run_dtype

pytestmark = pytest.mark.parity


def test_traces_pair_up(trace_problems):
    """Every trace found must be runnable: a trace without its checkpoint/inputs is a broken gate, not a skip."""
    assert not trace_problems, "\n".join(trace_problems)


@pytest.mark.parametrize("mode", ["teacher", "free"])
def test_dit_layers(dit_case, mode, gate_options, report, request, ndarrays_regression):
    compute, reason = run_dtype(gate_options["attention"], dit_case.compute, gate_options["device"])
    if reason is not None:  # a backend asked for and not run is a red gate, never a skip
        pytest.fail(f"{dit_case.id}: --attention {gate_options['attention_label']} cannot run it: {reason}",
                    pytrace=False)
    try:
        result = run_dit_case(dit_case, mode=mode, attention=gate_options["attention"], device=gate_options["device"],
                              budgets=gate_options["budgets"], comfy_root=gate_options["comfy_root"],
                              compute=compute, fp8_linear=gate_options.get("fp8_linear", "off"),
                              no_twin=gate_options["no_twin"], sage_class=gate_options["sage_class"])
    except NoTwin as exc:
        pytest.fail(str(exc), pytrace=False)
    history = History(request.config, dit_case.trace.parent, dit_case.trace.stem, gate_options["device"],
                      gate_options["budgets"])
    history.judge(result)
    report.add_case(result)
    assert result.layers or result.notes, f"{dit_case.id}: no comparable layer"
    assert result.passed or (not result.layers and result.notes), result.report()
    history.record(result, ndarrays_regression)
