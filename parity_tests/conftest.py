"""Parametrization of the parity gate over the discovered traces, the checks that it compares something, and the
parity report.

A gate that compares nothing must not pass:
- when the trace roots yield no DiT, VAE or generation case at all (or, with the default roots, fewer cases than the
  committed fixtures hold), the run stops with one line naming the roots searched;
- when the attention backend asked for (with its options) cannot run any DiT case on this device (`--device cuda`
  without a GPU, a GPU-only backend on the CPU, a backend whose fallback is not installed), the run stops before
  any compute with one line: why, and which backends run here;
- when the backend's calls all ran its documented fallback (sol_attn's short or head_dim calls, fa3_fp8's head_dim
  calls), or every FP8 linear on a GPU was emulated, the run fails at its end with one line: its kernel was
  compared nowhere.
A kind with no case in the given roots (say a folder of DiT traces only) has its tests deselected, not skipped, and
the terminal summary lists how many cases of each kind ran.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest

from parity_tests.discovery import FIXTURES, find_dit_cases, find_generate_cases, find_vae_cases
from parity_tests.plugin import gate_attention, gate_fp8, given_trace_dirs, report_dir, trace_roots
from parity_tests.report import ReportCollector

_collector = ReportCollector()

# What fixtures/ holds (checked when the gate runs on its default roots): deleting a fixture trace, or a discovery
# change that stops pairing one, fails the run instead of shrinking it. Raise these when adding fixture traces.
FIXTURE_CASES = {"dit": 5, "vae": 5, "generate": 4}
KIND_OF_PARAM = {"dit_case": "dit", "vae_case": "vae", "gen_case": "generate"}
NO_CASE = "no-case"


class Cases:
    def __init__(self, dit, vae, gen, problems, roots):
        self.dit, self.vae, self.gen, self.problems, self.roots = dit, vae, gen, problems, roots

    def of(self, kind: str) -> list:
        return {"dit": self.dit, "vae": self.vae, "generate": self.gen}[kind]

    def shortfall(self, config) -> str | None:
        """One line when the roots hold no case at all, or fewer than the committed fixtures (default roots)."""
        where = ", ".join(map(str, self.roots)) or "(no root)"
        if not (self.dit or self.vae or self.gen):
            return (f"parity gate: no DiT, VAE or generation trace case found in {where} "
                    f"(searched for trace_*.json manifests with their checkpoints and inputs)")
        if given_trace_dirs(config) is None and not config.getoption("--comfy-root"):
            short = []
            for kind, want in FIXTURE_CASES.items():
                got = sum(1 for c in self.of(kind) if c.trace.parent.resolve() == FIXTURES.resolve())
                if got < want:
                    short.append(f"{kind} {got} < {want}")
            if short:
                return (f"parity gate: fixtures/ yields fewer cases than it holds ({', '.join(short)}); "
                        f"roots searched: {where}")
        return None

    def unrunnable(self, config) -> str | None:
        """One line when the gate's DiT cases cannot run here at all with the backend asked for (None: some can)."""
        import torch

        from h3direct.dit.attention import available_backends
        from h3direct.dit.options import describe
        from parity_tests.models import run_dtype

        device = config.getoption("--device")
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            return (f"parity gate: --device {device}: no CUDA device here (torch.cuda.is_available() is False); "
                    f"run it on a GPU machine, or with --device cpu")
        attention = gate_attention(config)
        reasons = [run_dtype(attention, c.compute, device)[1] for c in self.dit]
        if not reasons or any(r is None for r in reasons):
            return None
        like = torch.empty(0, device=device, dtype=torch.bfloat16 if torch.device(device).type == "cuda"
                           else torch.float32)
        here = ", ".join(available_backends(like, attention)) or "none"
        return (f"parity gate: --attention {describe(attention)} cannot run any DiT case on {device}: {reasons[0]}; "
                f"attention backends that run here: {here}")


def _cases(config) -> Cases:
    if not hasattr(config, "_h3_cases"):
        roots = trace_roots(config)
        comfy = config.getoption("--comfy-root")
        if comfy:
            from parity_tests.live import record_live

            roots = [record_live(roots, comfy, config)]
        dit, dit_problems = find_dit_cases(roots)
        vae, vae_problems = find_vae_cases(roots)
        gen, gen_problems = find_generate_cases(roots)
        config._h3_cases = Cases(dit, vae, gen, dit_problems + vae_problems + gen_problems, roots)
    return config._h3_cases


def pytest_generate_tests(metafunc):
    config = metafunc.config
    for param, kind in KIND_OF_PARAM.items():
        if param not in metafunc.fixturenames:
            continue
        cases = _cases(config).of(kind)
        if kind == "vae":
            want = config.getoption("--vae-dtype")
            cases = [c for c in cases if want == "all" or c.dtype == want]
        if cases:
            metafunc.parametrize(param, cases, ids=[c.id for c in cases])
        else:  # deselected in pytest_collection_modifyitems: no case of this kind in the roots
            metafunc.parametrize(param, [None], ids=[NO_CASE])


def pytest_collection_modifyitems(config, items):
    parity = [it for it in items if "parity" in it.keywords]
    if not parity:
        return
    cases = _cases(config)
    line = cases.shortfall(config)
    if line:
        raise pytest.UsageError(line)
    if any(_param(it, "dit_case") is not None for it in parity):
        line = cases.unrunnable(config)
        if line:
            raise pytest.UsageError(line)
    keep, drop = [], []
    for it in items:
        cs = getattr(it, "callspec", None)
        empty = cs is not None and any(p in cs.params and cs.params[p] is None for p in KIND_OF_PARAM)
        (drop if empty else keep).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _param(item, name):
    cs = getattr(item, "callspec", None)
    return cs.params.get(name) if cs is not None else None


_ran: dict[str, set[str]] = defaultdict(set)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    cs = getattr(item, "callspec", None)
    if cs is not None and rep.when == "call" and not rep.skipped:
        for param, kind in KIND_OF_PARAM.items():
            if cs.params.get(param) is not None:
                _ran[kind].add(cs.params[param].id)
    return rep


def _found(config) -> tuple[dict[str, int], list[str]] | None:
    """({kind: cases found}, roots) of this process's collection, or what an xdist worker reported."""
    if hasattr(config, "_h3_cases"):
        cases = config._h3_cases
        return {k: len(cases.of(k)) for k in ("dit", "vae", "generate")}, [str(r) for r in cases.roots]
    return getattr(config, "_h3_found", None)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    found = _found(config)
    if found is None:
        return
    found, roots = found
    ran = ", ".join(f"{k} {len(_ran[k])}/{found[k]}" for k in ("dit", "vae", "generate"))
    terminalreporter.write_line(f"parity cases run (of found): {ran}; roots: {', '.join(roots)}")
    if getattr(config, "_h3_nothing_compared", None):
        terminalreporter.write_line(f"FAILED: {config._h3_nothing_compared}", red=True, bold=True)
    if getattr(config, "_h3_live_warning", None):
        terminalreporter.write_line(f"WARNING: {config._h3_live_warning}", yellow=True)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller, as each worker ends: its report rows, the cases it ran and found (`pytest_sessionfinish`
    then writes one report and judges the whole run, as without workers)."""
    part = getattr(node, "workeroutput", {}).get("h3_parity")
    if not part:
        return
    _collector.merge(part["rows"], part["cases"])
    for kind, ids in part["ran"].items():
        _ran[kind].update(ids)
    if part["found"] is not None:
        node.config._h3_found = part["found"]


@pytest.fixture(scope="session")
def trace_problems(request):
    return _cases(request.config).problems


@pytest.fixture(scope="session")
def gate_options(request):
    from h3direct.dit.options import describe
    from parity_tests.budgets import load_budgets

    c = request.config
    attention = gate_attention(c)
    return {"attention": attention, "attention_label": describe(attention), "device": c.getoption("--device"),
            "budgets": load_budgets(c.getoption("--budgets")), "comfy_root": c.getoption("--comfy-root"),
            "fp8_linear": gate_fp8(c), "no_twin": c.getoption("--no-twin"), "sage_class": c.getoption("--sage-class")}


@pytest.fixture(scope="session")
def report():
    return _collector


def kernel_compared_nowhere(config, cases: list[dict]) -> str | None:
    """One line when the run's approximate kernels never ran where the gate compared them: every call of the
    attention backend asked for ran its documented fallback, or (on a GPU) every FP8 linear was emulated."""
    import torch

    from h3direct.dit.options import BACKEND_OPTIONS, describe
    from parity_tests.results import attention_key

    attention = gate_attention(config)
    name = attention_key(attention)
    calls: dict[str, int] = defaultdict(int)
    for c in cases:
        for what, n in ((c.get("attention_calls") or {}).get(name) or {}).items():
            calls[what] += n
    fallback = {w: n for w, n in calls.items() if w.startswith("fallback to ")}
    if fallback and not calls.get("kernel"):
        ways = ", ".join(f"{w} ×{n}" for w, n in fallback.items())
        cls = BACKEND_OPTIONS.get(name)
        strict = (f"; --option {cls.PREFIX}_strict=on makes a fallback an error"
                  if cls is not None and "strict" in {f.name for f in dataclasses.fields(cls)} else "")
        return (f"parity gate: --attention {describe(attention)} ran its fallback in every call ({ways}): its kernel "
                f"was compared nowhere (cases must fit the kernel, e.g. sol_attn: head_dim 128, at least "
                f"sol_min_tokens tokens){strict}")
    fp8: dict[str, int] = defaultdict(int)
    for c in cases:
        for what, n in (c.get("fp8_linear_calls") or {}).items():
            fp8[what] += n
    if fp8 and not fp8.get("scaled_mm") and torch.device(config.getoption("--device")).type == "cuda":
        ways = ", ".join(f"{w} ×{n}" for w, n in fp8.items())
        return f"parity gate: --fp8-linear: every FP8 linear was emulated on the GPU ({ways}): no FP8 GEMM compared"
    return None


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller merges every worker's part, then judges
        config.workeroutput["h3_parity"] = {"rows": _collector.rows, "cases": _collector.cases,
                                            "ran": {k: sorted(v) for k, v in _ran.items()}, "found": _found(config)}
        return
    if _collector.rows:
        _collector.write(report_dir(session.config))
    line = kernel_compared_nowhere(session.config, _collector.cases) if _collector.cases else None
    if line:
        session.config._h3_nothing_compared = line
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
