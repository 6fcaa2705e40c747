"""Scoped call counts (`h3direct.counts`): a collector holds its own calls, and collectors add up (a service's
running total of its finished jobs)."""

from __future__ import annotations

from h3direct.counts import CallCounts, count_attention, count_fp8_linear, counting


def test_a_collector_holds_its_own_calls_and_collectors_add_up():
    count_attention("sdpa", "kernel")  # no collector open: counted nowhere
    with counting() as job:
        count_attention("sol_attn", "kernel")
        count_fp8_linear("scaled_mm")
        with counting() as probe:  # a one-off call inside the job is not the job's
            count_attention("sol_attn", "fallback to fa3: short")
    assert job.as_dict() == {"attention": {"sol_attn": {"kernel": 1}}, "fp8_linear": {"scaled_mm": 1}}
    assert probe.as_dict() == {"attention": {"sol_attn": {"fallback to fa3: short": 1}}}
    total = CallCounts()
    for counted in (job.as_dict(), probe.as_dict(), job.as_dict(), {}):
        total.add(counted)
    assert total.as_dict() == {"attention": {"sol_attn": {"kernel": 2, "fallback to fa3: short": 1}},
                               "fp8_linear": {"scaled_mm": 2}}
    assert CallCounts().as_dict() == {}
