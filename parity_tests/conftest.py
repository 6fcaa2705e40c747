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

import shutil

import pytest

from parity_tests import session
from parity_tests.discovery import (
    FIXTURES,
    find_dit_cases,
    find_generate_cases,
    find_vae_cases,
    recording,
    unused_files,
)
from parity_tests.plugin import (
    gate_attention,
    gate_fp8,
    gate_sage_class,
    given_trace_dirs,
    replay_context,
    trace_roots,
)

# What fixtures/ holds (checked when the gate runs on its default roots): deleting a fixture trace, or a discovery
# change that stops pairing one, fails the run instead of shrinking it. Raise these when adding fixture traces.
FIXTURE_CASES = {"dit": 5, "vae": 5, "generate": 4}
KIND_OF_PARAM = {"dit_case": "dit", "vae_case": "vae", "gen_case": "generate"}
NO_CASE = "no-case"


class Cases:
    def __init__(self, dit, vae, gen, problems, roots):
        self.dit, self.vae, self.gen, self.problems, self.roots = dit, vae, gen, problems, roots
        self.unused = unused_files(roots, dit, vae, gen, problems)

    def of(self, kind: str) -> list:
        return {"dit": self.dit, "vae": self.vae, "generate": self.gen}[kind]

    def recording(self, case) -> tuple[str, str]:
        """(the recording `case` belongs to, what its rows judge): `discovery.recording` among its kind's cases; a
        case of none of them (the e2e frames gate's model) is its own, judged as its report says."""
        kind = next((k for k in session.KINDS if case in self.of(k)), None)
        return recording(case, self.of(kind)) if kind else (case.id, "")

    def recordings(self, kind: str) -> int:
        return len({self.recording(c)[0] for c in self.of(kind)})

    def shortfall(self, config) -> str | None:
        """One line when the roots hold no case at all, or fewer than the committed fixtures (default roots)."""
        where = ", ".join(map(str, self.roots)) or "(no root)"
        if not (self.dit or self.vae or self.gen):
            why = "".join(f"\n  not gated: {line}" for line in self.problems + self.unused)
            return (f"parity gate: no DiT, VAE or generation trace case found in {where} (a case is a trace's "
                    f"manifest, `<name>.json` beside `<name>.safetensors`, with the files it names beside it or "
                    f"where it was recorded from){why}")
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
            if not config.getoption("--keep-traces"):
                config.add_cleanup(lambda: shutil.rmtree(roots[0], ignore_errors=True))
                session.of(config).notes.append(f"live traces in {roots[0]} removed at the end of the run "
                                                f"(--keep-traces keeps them for the report's replay commands)")
        dit, dit_problems = find_dit_cases(roots)
        vae, vae_problems = find_vae_cases(roots)
        gen, gen_problems = find_generate_cases(roots)
        config._h3_cases = Cases(dit, vae, gen, dit_problems + vae_problems + gen_problems, roots)
        run = session.of(config)
        run.found = ({k: (config._h3_cases.recordings(k), len(config._h3_cases.of(k))) for k in session.KINDS},
                     [str(r) for r in roots])
        run.problems = list(config._h3_cases.problems)
        run.unused = list(config._h3_cases.unused)
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    params = getattr(getattr(item, "callspec", None), "params", {})
    gated = next((v for p, v in params.items() if p in (*KIND_OF_PARAM, "e2e_path") and v is not None), None)
    if gated is not None and session.CASE_PROPERTY not in dict(item.user_properties):  # the summary counts these
        item.user_properties.append((session.CASE_PROPERTY, getattr(gated, "id", str(gated))))
    rep = yield
    if rep.when == "call" and not rep.skipped:
        for param, kind in KIND_OF_PARAM.items():
            if params.get(param) is not None:
                session.of(item.config).ran[kind].add(_cases(item.config).recording(params[param])[0])
    if rep.when == "call" and rep.failed and hasattr(gated, "id") and not getattr(item, "h3_concluded", False):
        # a case test that raised before it concluded (a kernel that does not build, say): a failed case run in the
        # report too, its error in place of a failing layer; pytest shows the traceback
        from parity_tests.results import CaseResult

        err = call.excinfo.value if call.excinfo is not None else None
        first = (str(err).strip().splitlines() or [""])[0]
        session.of(item.config).collector.add_case(
            CaseResult(gated, params.get("mode", ""), "", pending=f"raised {type(err).__name__}: {first}"[:300]))
    return rep


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
            "budgets": load_budgets(c.getoption("--budgets")), "replay": replay_context(c),
            "fp8_linear": gate_fp8(c), "no_twin": c.getoption("--no-twin"), "sage_class": gate_sage_class(c)}


@pytest.fixture
def conclude(request):
    """`conclude(result, history=None)`, how a case test ends: an approximate mode's new baseline written (`history`,
    `drift.History`), the result into the run's report whatever it is, then a pass, or a failure that shows the
    case's own report (the cause line, the rule, the worst element, the replay command) without pytest's traceback.
    A baseline this run created is one line, "baseline created: PATH", and the case is pending, not passed: nothing
    held it to a baseline yet."""

    def end(result, history=None) -> None:
        request.node.h3_concluded = True  # (a case test that raises before this is reported by the makereport hook)
        run = session.of(request.config)
        result.recording, result.judges = _cases(request.config).recording(result.case)
        created = None
        if history is not None and result.first_failure is None and not result.pending:
            created = history.record(result, request.getfixturevalue("ndarrays_regression"))
        if created:
            result.pending = created
            run.baselines.append(created)
        run.collector.add_case(result)
        if result.passed:
            return
        if created:
            pytest.fail(f"{created}; the next run is held to it", pytrace=False)
        if not result.layers and not result.notes:
            pytest.fail(f"{result.case.id}: nothing compared", pytrace=False)
        pytest.fail(result.report(), pytrace=False)

    return end
