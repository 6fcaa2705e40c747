"""End-to-end frames gate of the approximate paths (issue 12; machinery in parity_tests/e2e_frames.py).

`pytest -m parity --device cuda --attention NAME [--e2e-model DIR]`: when NAME is an approximate path (sage2,
ck_int8, sol_attn, kj_head_sliced over sage2, fa3_fp8, ...; `--e2e-path fp8_linear` for the FP8 block linears), one
4-step generation on the device's exact path and one on NAME, same seed and inputs, decoded to frames: PSNR / SSIM
mean and min over frames against NAME's e2e frames entry in budgets.toml. For an exact NAME there is no item (the
exact path against itself would compare a run with itself; exact backends are gated against ComfyUI's traces by
test_dit_parity / test_e2e_parity instead). Skips: no CUDA device, or NAME cannot run here (with the reason).

On the CPU (CI) no approximate backend runs, so the same machinery runs on the bundled tiny models with test-only
approximate attentions: an INT8 Q/K emulation (SageAttention's per-block QK quantization, in torch) and an exact
attention with a controlled relative error, whose frames cross a budget entry as the error grows.
"""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch

from h3direct.errors import H3Error
from parity_tests import e2e_frames as E

pytestmark = pytest.mark.parity


def pytest_generate_tests(metafunc):
    if "e2e_path" in metafunc.fixturenames:
        c = metafunc.config
        path = c.getoption("--e2e-path") or c.getoption("--attention")
        if E.kind_of(path) == "exact":  # deselected by the plugin: nothing approximate to compare
            metafunc.parametrize("e2e_path", [None], ids=[f"{path}-exact"])
        else:
            metafunc.parametrize("e2e_path", [path], ids=[path])


@pytest.fixture(scope="session")
def e2e_model(request):
    return E.E2EModel.load(request.config.getoption("--e2e-model"))


def test_e2e_frames_vs_exact(e2e_path, e2e_model, gate_options, report):
    device = gate_options["device"]
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    why = E.unavailable(e2e_path, device)
    if why is not None:
        pytest.skip(f"{e2e_path} cannot run here: {why}")
    result = E.compare_paths(e2e_model, e2e_path, device=device, budgets=gate_options["budgets"])
    report.add_case(result)
    if E.split_path(e2e_path)[0] == "sol_attn":  # (also over FP8 linears) its budget is about the sparse kernel
        calls = result.attention_calls.get("sol_attn", {})
        assert calls.get("kernel", 0) > 0, (f"sol_attn ran only its fallback on {e2e_model.about} ({calls}): use "
                                            f"--e2e-model with a head_dim-128 model at >= H3_SOL_MIN_TOKENS tokens")
    assert result.passed, result.report()


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
    from h3direct.app import generate
    from h3direct.dit import attention as A

    def add(name, fn):  # registered for this test only, and a choice of generate's --attention
        monkeypatch.setitem(A._REGISTRY, name, A.Backend(name, fn, A._always, exact=False))
        monkeypatch.setattr(generate, "ATTENTION", (*generate.ATTENTION, name))
    add("int8qk_emul", _int8_qk)
    for eps in (1e-3, 3e-2):
        add(f"noisy_{eps:g}", _noisy(eps))
    return add


@cache
def _exact_run():
    return E.run_frames(E.E2EModel(), ["--attention", "sdpa"])


def _entry(path: str, **floors) -> dict:
    return {"mode": "e2e", "kind": "frames", "compute": "fp32", "weights": "bf16", "attention": path, **floors,
            "provenance": "test"}


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
        with E.budgets_with([_entry(path, **{fld: _beyond(fld, fm[metric], +1)})]) as over:
            b = E.frames_budget(over, path, "fp32", "bf16")
            r = E.judge(E.E2EModel(), path, _approx_run(path), _exact_run(), b, compute="fp32", reference="sdpa")
        assert not r.passed, f"{fld} {_beyond(fld, fm[metric], +1)} over the measured {fm[metric]} passed"
        assert r.first_failure.rule.startswith(("PSNR", "SSIM")), r.report()


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
    with E.budgets_with([_entry(path, **floors)]) as t:
        return t


def test_the_verdict_flips_as_the_injected_error_crosses_the_entry(test_backends):
    """Attention with a controlled relative error: 30x more error lowers the frames' PSNR and SSIM; an entry set
    between the two measurements passes the small error and fails the large one."""
    from parity_tests.vae_gate import frame_metrics

    small, large = (frame_metrics(_approx_run(p).frames, _exact_run().frames) for p in ("noisy_0.001", "noisy_0.03"))
    assert small["psnr_mean"] > large["psnr_mean"] + 10.0 and small["ssim_min"] > large["ssim_min"], (small, large)
    mid = {fld: (small[m] + large[m]) / 2 for fld, m in FIELDS.items()}
    for path, want in (("noisy_0.001", True), ("noisy_0.03", False)):
        with E.budgets_with([_entry(path, **mid)]) as t:
            r = E.compare_paths(E.E2EModel(), path, budgets=t, exact_run=_exact_run())
        assert r.passed is want, r.report()


def test_an_approximate_path_without_an_entry_fails_before_running(test_backends, monkeypatch):
    """No catch-all: no e2e frames entry (or one without a frames floor) is a one-line failure, before any compute."""
    monkeypatch.setattr(E, "run_frames", lambda *a, **k: pytest.fail("ran without a budget"))
    with pytest.raises(H3Error, match=r"no calibrated budget for \(e2e, fp32, bf16, int8qk_emul\)"):
        E.compare_paths(E.E2EModel(), "int8qk_emul")  # the committed table
    rel_only = {"mode": "e2e", "kind": "*", "compute": "fp32", "weights": "bf16", "attention": "int8qk_emul",
                "rel_l2": 0.1, "provenance": "test"}
    with E.budgets_with([rel_only]) as t, pytest.raises(H3Error, match="has no PSNR/SSIM floor"):
        E.compare_paths(E.E2EModel(), "int8qk_emul", budgets=t)


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


def test_fp8_linear_takes_only_an_entry_keyed_fp8_w8a8():
    floors = {"psnr_db": 30.0, "provenance": "test"}
    own = {"mode": "e2e", "kind": "frames", "compute": "bf16", "weights": "*", "attention": "fa3", **floors}
    with E.budgets_with([own]) as t, pytest.raises(H3Error, match="not keyed weights = 'fp8_w8a8'"):
        E.frames_budget(t, "fp8_linear", "bf16", "bf16", "fa3")
    keyed = {**own, "weights": "fp8_w8a8"}
    with E.budgets_with([own, keyed]) as t:
        assert E.frames_budget(t, "fp8_linear", "bf16", "bf16", "fa3").match["weights"] == "fp8_w8a8"
        with pytest.raises(H3Error, match=r"no calibrated budget for \(e2e, bf16, bf16, sage2\)"):
            E.frames_budget(t, "sage2", "bf16", "bf16", "fa3")


def test_proposed_floors_keep_a_margin_of_at_most_2x():
    """benchmarks/e2e_frames.py's proposal: each floor allows more error than measured, never more than 2x of it
    (RMS pixel error for PSNR, 1 - SSIM for SSIM)."""
    from benchmarks.e2e_frames import propose

    for worst in ({"psnr_mean": 41.234, "psnr_min": 37.05, "ssim_mean": 0.99731, "ssim_min": 0.9812},
                  {"psnr_mean": 77.62, "psnr_min": 76.21, "ssim_mean": 0.99999933, "ssim_min": 0.99999909}):
        p = propose(worst)
        for fld, metric in FIELDS.items():
            if fld.startswith("psnr"):
                ratio = 10.0 ** ((worst[metric] - p[fld]) / 20.0)  # allowed RMS error / measured
            else:
                ratio = (1.0 - p[fld]) / (1.0 - worst[metric])
            assert 1.0 < ratio <= 2.0, (fld, worst[metric], p[fld], ratio)


def test_the_gate_item_exists_only_for_an_approximate_path():
    """`--attention sdpa` (exact): no e2e frames item (deselected); `--attention ck_int8`: one item, skipped on a
    machine without CUDA with the reason."""
    from parity_tests.test_gate_options import REPO, _pytest

    base = ["-m", "parity", "-k", "vs_exact", "-rs", str(REPO / "parity_tests" / "test_e2e_frames.py")]
    exact = _pytest([*base, "--collect-only", "--attention", "sdpa"], REPO)
    assert exact.returncode == 5 and "test_e2e_frames_vs_exact" not in exact.stdout, exact.stdout[-2000:]
    approx = _pytest([*base, "--attention", "ck_int8"], REPO)
    if torch.cuda.is_available():
        return
    assert approx.returncode == 0 and "1 skipped" in approx.stdout, approx.stdout[-2000:]
    assert "ck_int8 cannot run here: needs a CUDA device" in approx.stdout, approx.stdout[-2000:]


def test_a_combined_path_runs_both_and_takes_only_its_own_fp8_entry():
    """`sol_attn+fp8_linear` (the contract's approximate path): --attention sol_attn --fp8-linear, judged by an entry
    keyed weights fp8_w8a8, attention sol_attn -- neither sol_attn's own entry nor fp8_linear-over-fa3's."""
    assert E.split_path("sol_attn+fp8_linear") == ("sol_attn", True)
    assert E.split_path("fp8_linear") == (None, True) and E.split_path("sol_attn") == ("sol_attn", False)
    assert E.path_flags("sol_attn+fp8_linear", "fa3") == ["--attention", "sol_attn", "--fp8-linear"]
    assert E.kind_of("sol_attn+fp8_linear") == "approximate" and E.kind_of("nope+fp8_linear") == "unknown"
    if E.knows_flag("--fp8-linear"):  # the attention half decides availability
        assert E.unavailable("sol_attn+fp8_linear", "cpu") == E.unavailable("sol_attn", "cpu")
    assert E.budget_key("sol_attn+fp8_linear", "bf16", "bf16", "fa3")["attention"] == "sol_attn"
    floors = {"psnr_db": 30.0, "provenance": "test"}
    sol = {"mode": "e2e", "kind": "frames", "compute": "bf16", "weights": "*", "attention": "sol_attn", **floors}
    fp8_fa3 = {**sol, "weights": "fp8_w8a8", "attention": "fa3"}
    with E.budgets_with([sol, fp8_fa3]) as t, pytest.raises(H3Error, match="not keyed weights = 'fp8_w8a8'"):
        E.frames_budget(t, "sol_attn+fp8_linear", "bf16", "bf16", "fa3")
    both = {**sol, "weights": "fp8_w8a8"}
    with E.budgets_with([sol, fp8_fa3, both]) as t:
        b = E.frames_budget(t, "sol_attn+fp8_linear", "bf16", "bf16", "fa3")
        assert (b.match["weights"], b.match["attention"]) == ("fp8_w8a8", "sol_attn")
