"""Parametrization of the parity gate over the discovered traces, and the parity report."""

from __future__ import annotations

import pytest

from h3direct.traces.discovery import find_dit_cases, find_vae_cases, trace_roots
from parity_tests.report import ReportCollector

_collector = ReportCollector()


def _cases(config):
    if not hasattr(config, "_h3_cases"):
        roots = trace_roots(config)
        comfy = config.getoption("--comfy-root")
        if comfy:
            from parity_tests.live import record_live

            roots = [record_live(roots, comfy, config)]
        dit, dit_problems = find_dit_cases(roots)
        vae, vae_problems = find_vae_cases(roots)
        config._h3_cases = (dit, vae, dit_problems + vae_problems, roots)
    return config._h3_cases


def pytest_generate_tests(metafunc):
    config = metafunc.config
    if "dit_case" in metafunc.fixturenames:
        dit, _, _, roots = _cases(config)
        if not dit:
            metafunc.parametrize("dit_case", [pytest.param(None, marks=pytest.mark.skip(
                reason=f"no DiT traces found in {', '.join(map(str, roots)) or 'any --trace-dir'}"))])
        else:
            metafunc.parametrize("dit_case", dit, ids=[c.id for c in dit])
    if "vae_case" in metafunc.fixturenames:
        _, vae, _, roots = _cases(config)
        want = config.getoption("--vae-dtype")
        vae = [c for c in vae if want == "all" or c.dtype == want]
        if not vae:
            metafunc.parametrize("vae_case", [pytest.param(None, marks=pytest.mark.skip(
                reason=f"no VAE traces ({want}) found in {', '.join(map(str, roots))}"))])
        else:
            metafunc.parametrize("vae_case", vae, ids=[c.id for c in vae])


@pytest.fixture(scope="session")
def trace_problems(request):
    return _cases(request.config)[2]


@pytest.fixture(scope="session")
def gate_options(request):
    c = request.config
    from h3direct.traces.budgets import load_budgets

    return {"attention": c.getoption("--attention"), "device": c.getoption("--device"),
            "budgets": load_budgets(c.getoption("--budgets")), "comfy_root": c.getoption("--comfy-root")}


@pytest.fixture(scope="session")
def report():
    return _collector


def pytest_sessionfinish(session, exitstatus):
    if _collector.rows:
        _collector.write(session.config.getoption("--parity-report"))
