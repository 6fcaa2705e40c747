"""The quality gate's machinery on the CPU: no approximate backend runs in CI, so it runs on the bundled tiny models
with test-only approximate attentions: an INT8 Q/K emulation (SageAttention's per-block QK quantization, in torch)
and an exact attention with a controlled relative error, whose frames cross a quality floor as the error grows."""

from __future__ import annotations

import contextlib
import math
from functools import cache

import pytest
import torch

from h3direct.errors import H3Error
from parity_tests import e2e_frames as E

# ---- the machinery on the CPU ---------------------------------------------------------------------

def _int8_qk(q, k, v, block: int = 64):
    """SageAttention-style INT8 Q/K (symmetric, one scale per head and 64-token block; K mean-smoothed), exact PV."""
    def quant(x):
        b, h, s, d = x.shape
        pad = (-s) % block
        xp = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).reshape(b, h, -1, block, d)
        scale = xp.abs().amax(dim=(-1, -2), keepdim=True).clamp_min(1e-12) / 127.0
        return (torch.round(xp / scale).clamp(-127, 127) * scale).reshape(b, h, -1, d)[:, :, :s].to(x.dtype)

    k = k - k.mean(dim=2, keepdim=True)  # softmax-invariant smoothing of K, as SageAttention does
    return torch.nn.functional.scaled_dot_product_attention(quant(q), quant(k), v)


def _noisy(eps: float):
    def fn(q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        g = torch.Generator().manual_seed(out.numel())
        noise = torch.randn(out.shape, generator=g, dtype=torch.float32).to(out.dtype)
        return out + eps * noise * (out.norm() / noise.norm())  # relative error eps, seeded: both runs alike
    return fn


@pytest.fixture
def test_backends(monkeypatch):
    from h3direct.dit import attention as A

    def add(name, fn):  # registered for this test only (generate's --attention takes any registered backend)
        monkeypatch.setitem(A._REGISTRY, name, A.Backend(name, fn, A._always, exact=False))
    add("int8qk_emul", _int8_qk)
    for eps in (1e-3, 3e-2):
        add(f"noisy_{eps:g}", _noisy(eps))
    return add


@cache
def _exact_run():
    return E.run_frames(E.E2EModel(), ["--attention", "sdpa"])


def _entries(path: str, **floors) -> list[dict]:
    """A quality table for `path`: these frames floors, and a waveform floor every run passes."""
    base = {"mode": "quality", "compute": "*", "weights": "*", "attention": path, "twin": "*", "rule": "contract",
            "source": "test", "provenance": "test"}
    return [{**base, "kind": "frames", **floors}, {**base, "kind": "waveform", "sqnr_db": -100.0}]


@contextlib.contextmanager
def _table(entries):
    from parity_tests.budgets import table_of

    yield table_of(entries)


FIELDS = {"psnr_db": "psnr_mean", "psnr_min_db": "psnr_min", "ssim_mean": "ssim_mean", "ssim_min": "ssim_min"}


def test_exact_path_is_deterministic_and_the_approximate_one_is_not_identical(test_backends):
    """The comparison is meaningful: the exact pipeline reproduces itself bit for bit (frames PSNR inf), an
    approximate attention moves the frames (finite PSNR) but stays a small error (the pipeline is not chaotic)."""
    model = E.E2EModel()
    again = E.run_frames(model, ["--attention", "sdpa"])
    assert torch.equal(again.frames, _exact_run().frames)
    approx = E.run_frames(model, ["--attention", "int8qk_emul"])
    from parity_tests.vae_gate import frame_metrics

    fm = frame_metrics(approx.frames, _exact_run().frames)
    assert fm["frames"] == 22 and approx.frames.shape == (22, 64, 96, 3)
    assert 20.0 < fm["psnr_min"] <= fm["psnr_mean"] < math.inf, fm
    assert 0.5 < fm["ssim_min"] <= fm["ssim_mean"] < 1.0, fm


def test_each_frames_floor_bites_on_a_real_comparison(test_backends):
    """An entry with each floor just under the measured value passes; each floor just over it fails, naming it."""
    path = "int8qk_emul"
    base = E.compare_paths(E.E2EModel(), path, budgets=_table_under(path), exact_run=_exact_run())
    fm = base.frame_metrics
    assert base.passed, base.report()
    for fld, metric in FIELDS.items():
        with _table(_entries(path, **{fld: _beyond(fld, fm[metric], +1)})) as over:
            r = E.judge(E.E2EModel(), path, _approx_run(path), _exact_run(), over, compute="fp32", reference="sdpa")
        assert not r.passed, f"{fld} {_beyond(fld, fm[metric], +1)} over the measured {fm[metric]} passed"
        assert r.first_failure.name == "frames" and metric in r.first_failure.rule, r.report()


def _beyond(fld: str, value: float, sign: int) -> float:
    """A floor just over (sign +1) or under (-1) a measured value: 0.05 dB for PSNR, 10 % of 1 - SSIM for SSIM."""
    if fld.startswith("psnr"):
        return value + sign * 0.05
    return 1.0 - (1.0 - value) * (1.0 - sign * 0.1)


@cache
def _approx_run(path):
    return E.run_frames(E.E2EModel(), ["--attention", path])


def _table_under(path):
    from parity_tests.vae_gate import frame_metrics

    m = frame_metrics(_approx_run(path).frames, _exact_run().frames)
    floors = {fld: _beyond(fld, m[metric], -1) for fld, metric in FIELDS.items()}
    with _table(_entries(path, **floors)) as t:
        return t


def test_the_verdict_flips_as_the_injected_error_crosses_the_entry(test_backends):
    """Attention with a controlled relative error: 30x more error lowers the frames' PSNR and SSIM; an entry set
    between the two measurements passes the small error and fails the large one."""
    from parity_tests.vae_gate import frame_metrics

    small, large = (frame_metrics(_approx_run(p).frames, _exact_run().frames) for p in ("noisy_0.001", "noisy_0.03"))
    assert small["psnr_mean"] > large["psnr_mean"] + 10.0 and small["ssim_min"] > large["ssim_min"], (small, large)
    mid = {fld: (small[m] + large[m]) / 2 for fld, m in FIELDS.items()}
    for path, want in (("noisy_0.001", True), ("noisy_0.03", False)):
        with _table(_entries(path, **mid)) as t:
            r = E.compare_paths(E.E2EModel(), path, budgets=t, exact_run=_exact_run())
        assert r.passed is want, r.report()


def test_an_approximate_path_without_a_declared_quality_fails_before_running(test_backends, monkeypatch):
    """No declared quality (or one without a frames floor) is a one-line failure, before any compute."""
    monkeypatch.setattr(E, "run_frames", lambda *a, **k: pytest.fail("ran without a quality contract"))
    x0_only = {"mode": "quality", "kind": "x0", "compute": "*", "weights": "*", "attention": "int8qk_emul",
               "twin": "*", "rule": "contract", "sqnr_db": 20.0, "source": "test", "provenance": "test"}
    with _table([x0_only]) as t, pytest.raises(H3Error, match="no rule for"):
        E.compare_paths(E.E2EModel(), "int8qk_emul", budgets=t)
    wave_only = {**x0_only, "kind": "frames", "sqnr_db": 20.0}
    with _table([wave_only]) as t, pytest.raises(H3Error, match="no declared frames quality"):
        E.compare_paths(E.E2EModel(), "int8qk_emul", budgets=t)


def test_availability_is_judged_with_the_gate_options(monkeypatch):
    """`--option` values reach the e2e item's availability check: sol_attn whose documented fallback is sage2 (its
    default) cannot run without SageAttention, the same backend with `sol_fallback=sdpa` can (sol_attn's kernel stands
    in as available)."""
    from h3direct.dit import attention as A
    from h3direct.dit.options import AttentionOptions
    from h3direct.dit.sol_options import SolOptions

    monkeypatch.setattr(A, "sol_kernel_reason", lambda like: None)
    monkeypatch.setattr(E, "_probe", lambda device: torch.empty(0, dtype=torch.bfloat16))  # as on a GPU
    sage = A._REGISTRY["sage2"]
    monkeypatch.setitem(A._REGISTRY, "sage2", A.Backend("sage2", sage.fn, lambda like: "sageattention is not importable",
                                                        exact=False))
    assert "sol_fallback 'sage2'" in E.unavailable("sol_attn+fp8_linear", "cpu")
    opts = AttentionOptions("fa3", sol_attn=SolOptions(fallback="sdpa"))
    assert E.unavailable("sol_attn+fp8_linear", "cpu", opts) is None


def test_paths_and_references():
    from h3direct.dit.attention import backends, is_exact

    assert E.exact_reference("cpu") == "sdpa"
    assert E.kind_of("sdpa") == "exact" and E.kind_of("fp8_linear") == "approximate"
    assert E.kind_of("no_such_backend") == "unknown" and E.unavailable("no_such_backend", "cpu") is None
    for name in backends():  # every registered approximate backend is a path of the gate
        assert E.kind_of(name) == ("exact" if is_exact(name) else "approximate")
    assert E.path_flags("fp8_linear", "fa3") == ["--attention", "fa3", "--fp8-linear"]
    assert E.path_flags("sage2", "fa3") == ["--attention", "sage2"]
    assert E.unavailable("ck_int8", "cpu") is not None  # CPU CI: the GPU backends do not run (the gate skips them)
    if not E.knows_flag("--fp8-linear"):
        assert "no --fp8-linear" in E.unavailable("fp8_linear", "cpu")
    with pytest.raises(H3Error, match="generate flags"):
        E.run_frames(E.E2EModel(), ["--attention", "no_such_backend"])


def test_parallel_frame_metrics_equal_the_serial_ones():
    from parity_tests.vae_gate import frame_metrics

    g = torch.Generator().manual_seed(0)
    ref = torch.rand(4, 20, 24, 3, generator=g)
    ours = (ref + 0.01 * torch.randn(ref.shape, generator=g)).clamp(0, 1)
    assert E.frame_metrics(ours, ref, workers=2) == pytest.approx(frame_metrics(ours, ref), rel=1e-12)


def test_each_mode_is_held_to_its_own_declared_quality():
    """FP8 linears are keyed weights fp8_w8a8 (over an exact reference: attention "exact"); an approximate backend by
    its name; an entry for one backend never answers for another."""
    base = {"mode": "quality", "compute": "*", "twin": "*", "rule": "contract", "source": "test",
            "provenance": "test"}
    fp8 = {**base, "kind": "frames", "weights": "fp8_w8a8", "attention": "exact", "psnr_db": 31.0}
    sage = {**base, "kind": "frames", "weights": "*", "attention": "sage2", "psnr_db": 32.0}
    with _table([fp8, sage]) as t:
        assert E.quality_budget(t, "fp8_linear", "frames", "bf16").psnr_db == 31.0
        assert E.quality_budget(t, "sage2", "frames", "bf16").psnr_db == 32.0
        with pytest.raises(H3Error, match="no rule for"):
            E.quality_budget(t, "ck_int8", "frames", "bf16")


def test_the_gate_item_exists_only_for_an_approximate_path():
    """`--attention sdpa` (exact): no e2e frames item (deselected); `--attention ck_int8`: one item, skipped on a
    machine without CUDA with the reason."""
    from test_gate_options import REPO, _pytest

    base = ["-m", "parity", "-k", "vs_exact", "-rs", str(REPO / "parity_tests" / "test_e2e_frames.py")]
    exact = _pytest([*base, "--collect-only", "--attention", "sdpa"], REPO)
    assert exact.returncode == 5 and "test_e2e_frames_vs_exact" not in exact.stdout, exact.stdout[-2000:]
    approx = _pytest([*base, "--attention", "ck_int8"], REPO)
    if torch.cuda.is_available():
        return
    assert approx.returncode == 0 and "1 skipped" in approx.stdout, approx.stdout[-2000:]
    assert "ck_int8 needs a GPU: needs a CUDA device" in approx.stdout, approx.stdout[-2000:]


def test_a_paths_backend_options_become_generates_own_flags():
    """`--option sol_tau=2.0 --option sol_exact_rows=off` of the gate: the same options as generate parses them."""
    from h3direct.app.cli_generate import parse

    flags = E.path_flags("sol_attn", "sdpa", {"sol_tau": 2.0, "sol_exact_rows": False})
    assert flags == ["--attention", "sol_attn", "--sol-tau", "2.0", "--no-sol-exact-rows"]
    here = ["--attention", "sdpa"] + flags[2:]  # sol_attn needs a GPU: its options parse the same beside sdpa
    job = parse(E.generate_parser().parse_args(E.E2EModel.load(None).argv() + here), output=False)
    sol = job.options.attention.sol_attn
    assert sol.tau == 2.0 and sol.exact_rows is False


def test_a_combined_path_runs_both_and_takes_only_its_own_fp8_entry():
    """`sol_attn+fp8_linear` (the contract's approximate path): --attention sol_attn --fp8-linear, judged by an entry
    keyed weights fp8_w8a8, attention sol_attn -- neither sol_attn's own entry nor fp8_linear-over-exact's."""
    assert E.split_path("sol_attn+fp8_linear") == ("sol_attn", True)
    assert E.split_path("fp8_linear") == (None, True) and E.split_path("sol_attn") == ("sol_attn", False)
    assert E.path_flags("sol_attn+fp8_linear", "fa3") == ["--attention", "sol_attn", "--fp8-linear"]
    assert E.kind_of("sol_attn+fp8_linear") == "approximate" and E.kind_of("nope+fp8_linear") == "unknown"
    if E.knows_flag("--fp8-linear"):  # the attention half decides availability
        assert E.unavailable("sol_attn+fp8_linear", "cpu") == E.unavailable("sol_attn", "cpu")
    key = E.budget_key("sol_attn+fp8_linear", "frames", "bf16")
    assert (key["weights"], key["attention"]) == ("fp8_w8a8", "sol_attn")
    base = {"mode": "quality", "kind": "frames", "compute": "*", "twin": "*", "rule": "contract", "source": "test",
            "provenance": "test"}
    sol = {**base, "weights": "bf16", "attention": "sol_attn", "psnr_db": 30.0}
    fp8_exact = {**base, "weights": "fp8_w8a8", "attention": "exact", "psnr_db": 31.0}
    both = {**base, "weights": "fp8_w8a8", "attention": "sol_attn", "psnr_db": 32.0}
    with _table([sol, fp8_exact]) as t, pytest.raises(H3Error, match="no rule for"):
        E.quality_budget(t, "sol_attn+fp8_linear", "frames", "bf16")
    with _table([sol, fp8_exact, both]) as t:
        assert E.quality_budget(t, "sol_attn+fp8_linear", "frames", "bf16").psnr_db == 32.0
