"""pytest plugin of h3direct: the parity gate's options and the project's markers.

Registered as a `pytest11` entry point (pyproject.toml) under the name `parity_tests.plugin`, so the options exist
wherever pytest starts (any working directory, any rootdir): `pytest -m parity --trace-dir /data/traces` parses
`/data/traces` as the option's value, not as a test path. Without the installed entry point, load it with
`-p parity_tests.plugin` (the checkout's pyproject addopts does). The module name and the entry point name are
the same, so every route registers it once.

Parity options (the merge gate, `pytest -m parity`):
  --trace-dir DIR     traces to gate against (repeatable; relative to where pytest was started); default: the
                      committed fixtures/ and, when it sits beside the checkout, ../shared/oracle. A DIR may also be
                      a folder of such directories.
  --comfy-root R      live mode: record fresh ComfyUI traces first (into a temporary folder) and gate on them
  --comfy-python P    live mode: record with the Python of ComfyUI's own environment (`oracle --comfy-python`)
  --keep-traces       live mode: keep the recorded traces (removed at the end of the run by default)
  --attention NAME    h3direct attention backend to gate (default sdpa)
  --option NAME=VALUE an option of the attention backends, by its flat name (repeatable; e.g. sol_tau=2.0,
                      fp8_attn_smooth_v=off, head_slice_backend=fa3): the backend runs with it, its kernel
                      reference too (sol_attn's eager algorithm at that tau), and the report names it
  --vae-dtype D       VAE dtype(s) to gate: fp32, fp16 or all (default all)
  --device DEV        cpu (default) or cuda
  --budgets FILE      an alternative budgets table (default parity_tests/budgets.toml)
  --no-twin           gate bf16/fp16 traces that have no fp32 twin by rounding bounds (teacher sites only) instead
                      of refusing them
  --baselines DIR     where approximate modes' baselines live (default: beside each case's traces, in
                      `baselines/`; `drift.py`); pytest-regressions' --force-regen rewrites them
  --parity-report DIR where the report goes (default ./parity-report, in the folder pytest was started from)
  --fp8-linear[=M]    gate h3direct with FP8 W8A8 block linears (M: stream (bare flag) or resident), an approximate
                      mode: its linears against the e4m3 rounding bound, the rest exact, x0 against the exact path
  --e2e-path NAME     approximate path of the e2e frames gate (default: --attention): an attention backend or
                      fp8_linear (parity_tests/e2e_frames.py); an exact one generates no e2e frames item
  --e2e-model DIR     model folder of the e2e frames gate (python -m parity_tests.e2e_frames build; default: for
                      sol_attn on CUDA, that command's default folder built for the run; else the bundled tiny models)

Importing this module is cheap (no torch): pytest loads it in every run of the environment.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPORT_DIR = "parity-report"  # relative to the folder pytest was started in

MARKERS = {
    "parity": "compares h3direct with ComfyUI traces (the merge gate)",
    "comfy": "needs a ComfyUI checkout (--comfy-root or H3_COMFY_ROOT)",
    "shared": "needs ../shared/oracle, the project's shared data beside the checkout (deselected without it)",
    "gpu": "needs a CUDA GPU (deselected without one; `pytest -m gpu` is the GPU test lane)",
    "gpu2": "needs 2 CUDA GPUs (deselected with fewer)",
    "planted": "the gate lane's one planted-failure check (proves this run's gate can fail)",
}


# the flags a tier sets (its options and its rule), with their defaults. Their options default to None, so that a
# flag given explicitly is seen as given even at its default value (`option()` reads them): with --tier, any of them is
# an error.
TIER_SETS = {"--attention": "sdpa", "--option": [], "--fp8-linear": "off", "--fp8-linear-layers": None,
             "--fp8-linear-format": "e4m3", "--fp8-linear-rotate": "none", "--sage-class": False}


def pytest_addoption(parser):
    g = parser.getgroup("h3 parity")
    g.addoption("--trace-dir", action="append", default=None, metavar="DIR", help="trace directory (repeatable)")
    g.addoption("--comfy-root", default=None,
                help="ComfyUI checkout: live mode (record fresh traces, then gate); also used by comfy tests")
    g.addoption("--comfy-python", default=None, metavar="PYTHON",
                help="live mode: the Python of ComfyUI's own environment, which records (`oracle record "
                     "--comfy-python`); default: this one, or $H3_COMFY_PYTHON")
    g.addoption("--keep-traces", action="store_true",
                help="live mode: keep the traces it recorded (default: removed at the end of the run; the report's "
                     "replay commands point at them)")
    g.addoption("--attention", default=None, help="h3direct attention backend to gate (default sdpa)")
    g.addoption("--option", action="append", default=None, metavar="NAME=VALUE",
                help="an attention backend's option by its flat name (repeatable), e.g. sol_tau=2.0")
    g.addoption("--vae-dtype", default="all", choices=["all", "fp32", "fp16"], help="VAE dtype(s) to gate")
    g.addoption("--device", default="cpu", help="cpu or cuda")
    g.addoption("--budgets", default=None, help="budgets table (TOML)")
    g.addoption("--fp8-linear", nargs="?", const="stream", default=None,
                choices=["off", "stream", "resident"],
                help="gate FP8 W8A8 block linears (budgets keyed weights = fp8_w8a8)")
    g.addoption("--fp8-linear-layers", default=None, metavar="LIST",
                help="with --fp8-linear: which linears of every block are FP8 (comma list of qkv_proj, out_proj, fc1, "
                     "fc2; default all four), the runtime's option fp8_linear_layers")
    g.addoption("--fp8-linear-format", default=None, choices=["e4m3", "int8"],
                help="with --fp8-linear: the 8-bit number format (budgets keyed weights = int8_w8a8 for int8), the "
                     "runtime's option fp8_linear_format")
    g.addoption("--tier", default=None, metavar="NAME",
                help="gate a tier of the tiers file (its options, under its rule: exact, the class rule against "
                     "ComfyUI+sage, or its own baselines); not with --attention, --option or --fp8-linear")
    g.addoption("--tiers", default=None, metavar="FILE",
                help="the tiers file --tier reads (default: $H3_TIERS, else <cache>/tiers.json)")
    g.addoption("--fp8-linear-rotate", default=None, metavar="LIST",
                help="with --fp8-linear-format int8: which int8 linears rotate their input and weight (none, or a "
                     "comma list), the runtime's option fp8_linear_rotate")
    g.addoption("--sage-class", action="store_const", const=True, default=None,
                help="hold the approximate mode (any backend, options and linears) to the class rule against ComfyUI's "
                     "--use-sage-attention, as for sage2: what a mode that claims ComfyUI+sage's quality must meet")
    g.addoption("--e2e-path", default=None, help="approximate path of the e2e frames gate (default: --attention)")
    g.addoption("--e2e-model", default=None, metavar="DIR", help="model folder of the e2e frames gate")
    g.addoption("--no-twin", action="store_true",
                help="gate low-precision traces without ComfyUI's fp32 twin by rounding bounds instead of refusing")
    g.addoption("--baselines", default=None, metavar="DIR",
                help="approximate modes' baselines (default: a baselines/ folder beside each case's traces)")
    g.addoption("--parity-report", default=REPORT_DIR,
                help="where the parity report is written (relative paths: from where pytest was started)")


def given_trace_dirs(config) -> list[Path] | None:
    """The --trace-dir values as absolute paths (relative ones against the directory pytest was started in)."""
    given = config.getoption("--trace-dir")
    if not given:
        return None
    start = Path(config.invocation_params.dir)
    return [Path(os.path.abspath(start / Path(p).expanduser())) for p in given]


def pytest_load_initial_conftests(early_config, parser, args):
    """`pytest -m parity --trace-dir DIR` started outside the checkout, with no test path: run the installed gate
    (this package's tests) instead of collecting nothing from the working directory."""
    ns = early_config.known_args_namespace
    if not getattr(ns, "trace_dir", None) or getattr(ns, "file_or_dir", None) or getattr(ns, "pyargs", False):
        return
    here = Path(__file__).resolve().parent
    start = Path(early_config.invocation_params.dir).resolve()
    if start != here.parent and here.parent not in start.parents:
        args.append(str(here))


def trace_roots(config) -> list[Path]:
    """The trace roots of a pytest run: the --trace-dir folders, else the defaults (fixtures/, ../shared/oracle)."""
    given = given_trace_dirs(config)
    if given is not None:
        return given
    from parity_tests.discovery import default_roots

    return default_roots()


def pytest_configure(config):
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    missing = [str(p) for p in given_trace_dirs(config) or [] if not p.is_dir()]
    if missing:  # one line from pytest, before any collection
        raise pytest.UsageError(f"--trace-dir: not a directory: {', '.join(missing)}")
    baselines = baselines_dir(config)
    if baselines is not None and baselines.exists() and not baselines.is_dir():
        raise pytest.UsageError(f"--baselines: not a directory: {baselines}")
    gate_tier(config)
    gate_attention(config)
    gate_fp8(config)
    if getattr(config.option, "numprocesses", None) and config.getoption("--comfy-root"):
        raise pytest.UsageError("--comfy-root (the live gate records ComfyUI once): run it without -n")


def gate_tier(config):
    """--tier's `app.tiers.Tier` (read once, for the --device of the run), or None; a bad one, or one given with the
    options it sets, is pytest's one-line usage error."""
    if not hasattr(config, "_h3_tier"):
        config._h3_tier = _read_tier(config)
    return config._h3_tier


def _read_tier(config):
    from h3direct.app import tiers
    from h3direct.app.env import read_tiers
    from h3direct.errors import H3Error

    name, path = config.getoption("--tier"), config.getoption("--tiers")
    if name is None:
        if path is not None:
            raise pytest.UsageError("--tiers FILE: give --tier NAME too")
        return None
    mixed = [f for f in TIER_SETS if config.getoption(f) is not None]
    if mixed:
        raise pytest.UsageError(f"--tier {name}: the tier sets the options and the rule; not with {mixed[0]}")
    try:
        tier, _ = tiers.resolve(name, path or read_tiers(), config.getoption("--device"))
    except H3Error as exc:
        raise pytest.UsageError(f"--tier {name}: {exc}") from None
    return tier


def option(config, flag: str):
    """A flag of TIER_SETS as given, else its default."""
    value = config.getoption(flag)
    return TIER_SETS[flag] if value is None else value


def gate_sage_class(config) -> bool:
    """Whether the run's approximate mode is held to the class rule against ComfyUI+sage: --sage-class, or a tier
    whose rule is the class rule."""
    tier = gate_tier(config)
    return bool(option(config, "--sage-class") or (tier is not None and tier.rule == "class"))


def gate_attention(config):
    """--attention and its --option values (or --tier's options) as AttentionOptions; a bad one is pytest's one-line
    usage error."""
    from h3direct.dit.options import Options, check_in_effect, parse_assignments
    from h3direct.errors import H3Error

    tier = gate_tier(config)
    if tier is not None:
        return Options.from_flat(tier.options).attention
    try:
        given = parse_assignments(option(config, "--option"), only="attention")
        options = Options.from_flat({"attention": option(config, "--attention"), **given})
        check_in_effect(options, given, spell=lambda n: f"--option {n}")
        return options.attention
    except H3Error as exc:
        text = str(exc)
        raise pytest.UsageError(text if text.startswith("--option") else f"--option {text}") from None


def gate_fp8(config) -> str:
    """--fp8-linear, --fp8-linear-layers and --fp8-linear-format as the gate's one value (`models.fp8_spec`); a bad
    list is pytest's one-line usage error, and so are layers or a format without --fp8-linear (--tier: its options)."""
    from h3direct.dit.options import Options, fp8_flags_problem
    from parity_tests.models import fp8_spec

    tier = gate_tier(config)
    if tier is not None:
        k = Options.from_flat(tier.options).kernels
        return fp8_spec(k.fp8_linear, k.fp8_linear_layers, k.fp8_linear_format, k.fp8_linear_rotate)
    mode, layers = option(config, "--fp8-linear"), option(config, "--fp8-linear-layers")
    fmt, rotate = option(config, "--fp8-linear-format"), option(config, "--fp8-linear-rotate")
    problem = fp8_flags_problem(mode, layers, fmt, rotate)
    if problem is not None:
        raise pytest.UsageError(problem)
    return fp8_spec(mode, layers, fmt, rotate)


def baselines_dir(config) -> Path | None:
    """--baselines as an absolute path (a relative one against the folder pytest was started in), or None."""
    given = config.getoption("--baselines")
    return Path(os.path.abspath(Path(config.invocation_params.dir) / Path(given).expanduser())) if given else None


def report_dir(config) -> Path:
    """--parity-report as an absolute path (a relative one against the folder pytest was started in)."""
    return Path(os.path.abspath(Path(config.invocation_params.dir) / config.getoption("--parity-report")))


def comfy_root_of(config) -> str | None:
    return config.getoption("--comfy-root") or os.environ.get("H3_COMFY_ROOT") or None


def replay_context(config):
    """What every replay command of the run carries (`results.ReplayContext`): ComfyUI's checkout (--comfy-root or
    $H3_COMFY_ROOT) and the Python of its own environment (--comfy-python or $H3_COMFY_PYTHON; else, per trace, the
    Python that recorded it), or why no row can be re-run: the live gate's traces are removed at the end of the run
    unless --keep-traces keeps them."""
    from parity_tests.results import ReplayContext

    gone = ""
    if config.getoption("--comfy-root") and not config.getoption("--keep-traces"):
        gone = "the live gate's traces are removed at the end of the run (--keep-traces keeps them)"
    root = comfy_root_of(config)
    python = config.getoption("--comfy-python") or os.environ.get("H3_COMFY_PYTHON") or None
    if python and os.sep in python:  # a path, relative to where pytest was started: absolute in the commands
        python = os.path.abspath(Path(config.invocation_params.dir) / python)
    return ReplayContext(root, python, gone)


def _deselect(config, items: list, drop: list) -> int:
    """Take `drop` out of the run as deselected (pytest counts them; nothing is skipped); returns how many."""
    if drop:
        config.hook.pytest_deselected(items=drop)
        gone = set(map(id, drop))
        items[:] = [it for it in items if id(it) not in gone]
    return len(drop)


def pytest_collection_modifyitems(config, items):
    # `comfy` tests are the live re-check against a ComfyUI checkout; without one they are deselected (listed in the
    # summary), not skipped: each claim they make is checked in CI against ComfyUI's committed answers
    # (fixtures/comfy/, fixtures/trace_*), by a twin test that needs no ComfyUI.
    if comfy_root_of(config) is None:
        config._h3_comfy_deselected = _deselect(config, items, [it for it in items if it.get_closest_marker("comfy")])
    # `shared` tests read ../shared/oracle, the project's shared data beside the checkout (not in the repository):
    # without it they are deselected and counted, never skipped
    needs_shared = [it for it in items if it.get_closest_marker("shared")]
    if needs_shared:
        from parity_tests import discovery

        if not discovery.SHARED_ORACLE.is_dir():
            config._h3_shared_deselected = (_deselect(config, items, needs_shared), discovery.SHARED_ORACLE)
    # GPU tests run where the GPUs are (`pytest -m gpu`): elsewhere they are deselected and counted, never skipped
    gpu = [it for it in items if it.get_closest_marker("gpu") or it.get_closest_marker("gpu2")]
    if gpu:
        import torch

        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        drop = [it for it in gpu if n == 0 or (n < 2 and it.get_closest_marker("gpu2"))]
        config._h3_gpu_deselected = (_deselect(config, items, drop), n)
    # the e2e frames gate compares an approximate path with the exact one: for an exact path it has no item
    _deselect(config, items, [it for it in items if getattr(it, "callspec", None) is not None
                              and "e2e_path" in it.callspec.params and it.callspec.params["e2e_path"] is None])


DESELECTED = ("_h3_gpu_deselected", "_h3_comfy_deselected", "_h3_shared_deselected")


def pytest_sessionfinish(session, exitstatus):
    from parity_tests import session as run

    config = session.config
    if hasattr(config, "workeroutput"):  # an xdist worker: its part, for the controller's report and summary
        config.workeroutput["h3_deselected"] = {  # plain values: they travel through execnet
            k: ([x if isinstance(x, int) else str(x) for x in v] if isinstance(v, tuple) else v)
            for k in DESELECTED if (v := getattr(config, k, None)) is not None}
        if run.active(config):
            config.workeroutput["h3_parity"] = run.worker_part(config)
    elif run.active(config):  # the process that ends the run: one report, the run's judgement
        run.finish(session, report_dir(config), gate_attention(config))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist's controller, as each worker ends: every worker collects the same items, so any worker's deselections
    are the run's; its gate part is merged into the run's (`session.py`)."""
    from parity_tests import session as run

    output = getattr(node, "workeroutput", {})
    for k, v in output.get("h3_deselected", {}).items():
        setattr(node.config, k, tuple(v) if isinstance(v, list) else v)
    if output.get("h3_parity"):
        run.merge(node.config, output["h3_parity"])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from parity_tests import session as run

    dropped, gpus = getattr(config, "_h3_gpu_deselected", (0, 0))
    if dropped:
        where = "no CUDA device here" if gpus == 0 else f"{gpus} CUDA device here, these need 2"
        terminalreporter.write_line(f"{dropped} GPU test(s) deselected: {where}; `pytest -m gpu` (and `-m gpu2` on two "
                                    f"GPUs) runs them on a GPU machine")
    n = getattr(config, "_h3_comfy_deselected", 0)
    if n:
        terminalreporter.write_line(
            f"{n} comfy live re-check(s) deselected: no ComfyUI checkout (set H3_COMFY_ROOT or pass --comfy-root); "
            f"their claims ran against ComfyUI's committed answers (fixtures/comfy/, fixtures/trace_*)")
    n, where = getattr(config, "_h3_shared_deselected", (0, None))
    if n:
        terminalreporter.write_line(
            f"{n} shared-data test(s) deselected: no {where} (../shared/oracle, the project's shared data beside the "
            f"checkout, not part of the repository)")
    if run.active(config):  # last: where the report is
        for text, markup in run.summary(config, terminalreporter):
            terminalreporter.write_line(text, **markup)


@pytest.fixture(scope="session")
def comfy_root(request) -> str:
    """The ComfyUI checkout of the run (--comfy-root, else H3_COMFY_ROOT), for `comfy` tests: without one they are
    deselected, so a test that gets here without a root is not marked `comfy`."""
    root = comfy_root_of(request.config)
    if root is None:
        pytest.fail("the comfy_root fixture is for tests marked `comfy` (deselected without a ComfyUI checkout)")
    return root
