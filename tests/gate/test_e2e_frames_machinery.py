"""The e2e frames gate's machinery on the CPU: no approximate backend runs in CI, so it runs on the bundled tiny
models with test-only approximate attentions: an INT8 Q/K emulation (SageAttention's per-block QK quantization, in
torch) and an exact attention with a controlled relative error, whose frames drift past a baseline as the error
grows."""

from __future__ import annotations

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


def _table():
    from parity_tests.budgets import load_budgets

    return load_budgets()


def _baseline(tmp_path, result):
    """Record `result`'s measured quality as its mode's baseline (what pytest-regressions writes on a first run)."""
    import numpy as np

    from parity_tests import drift

    store = drift.Store(tmp_path, "cpu", result.case.id)
    store.folder.mkdir(parents=True, exist_ok=True)
    np.savez(store.path(result.approx), **drift.data(result.approx, result.measured))
    return store


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


@cache
def _approx_run(path):
    return E.run_frames(E.E2EModel(), ["--attention", path])


def test_a_path_measures_frames_and_waveform_for_its_baseline(test_backends):
    """The frames and the waveform against the exact path's: reported (PSNR / SSIM, SNR), and measured for the
    path's baseline as rel-L2 with 2 low-precision paths (on the CPU the exact path is fp32: no rounding scale)."""
    r = E.judge(E.E2EModel(), "int8qk_emul", _approx_run("int8qk_emul"), _exact_run(), compute="fp32",
                reference="sdpa")
    assert r.passed and {x.name for x in r.layers} == {"frames", "waveform"}, r.report()
    assert set(r.measured) == {"frames", "waveform"} and r.approx == "int8qk_emul"
    q = r.measured["frames"]
    assert q.paths == 2 and q.scale == 0.0 and 0 < q.err < 0.2, q
    assert "PSNR mean" in r.layers[0].info


def test_the_drift_rule_bites_as_the_injected_error_grows(test_backends, tmp_path):
    """Attention with a controlled relative error: a baseline recorded at 1e-3 holds a rerun at 1e-3 and fails a
    run at 3e-2 (its frames and waveform both moved), naming the quantity; 30x more error lowers the PSNR."""
    from parity_tests import drift

    def run(path, label="noisy"):
        res = E.judge(E.E2EModel(), path, _approx_run(path), _exact_run(), compute="fp32", reference="sdpa")
        res.approx = label  # one mode whose error grew between two runs
        return res

    base = run("noisy_0.001")
    store = _baseline(tmp_path, base)
    again, worse = run("noisy_0.001"), run("noisy_0.03")
    drift.judge(again, store, _table())
    assert again.passed and {x.name for x in again.layers if x.part == "drift"} == {"drift.frames",
                                                                                  "drift.waveform"}, again.report()
    drift.judge(worse, store, _table())
    assert not worse.passed and worse.first_failure.name == "drift.frames", worse.report()
    assert "drift rule" in worse.first_failure.rule and "baseline" in worse.first_failure.info
    small, large = (base.frame_metrics, worse.frame_metrics)
    assert small["psnr_mean"] > large["psnr_mean"] + 10.0, (small, large)


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


def test_each_mode_has_its_own_baseline(tmp_path):
    """A path's label carries its options: sol_attn at another tau, or over FP8 linears, is another baseline."""
    from parity_tests import drift

    store = drift.Store(tmp_path, "cuda", "e2e_m")
    labels = [E.mode_label("sol_attn", {"sol_tau": 2.5}), E.mode_label("sol_attn", {"sol_tau": 1.3}),
              E.mode_label("sol_attn+fp8_linear", {"sol_tau": 2.5}), E.mode_label("sage2")]
    assert labels[0] == "sol_attn (sol_tau=2.5)" and labels[3] == "sage2"
    assert len({store.path(label) for label in labels}) == 4


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
    from h3direct.app.cli_flags import given, option_names
    from h3direct.dit.options import Options

    args = E.generate_parser().parse_args(E.E2EModel.load(None).argv() + flags)
    sol = Options.from_flat(given(args, option_names())).attention.sol_attn  # (sol_attn itself needs a GPU to run)
    assert sol.tau == 2.0 and sol.exact_rows is False
    # beside a backend that never reads them they are one line, not a silent no-op
    from h3direct.errors import ConfigError

    with pytest.raises(ConfigError, match="an option of sol_attn, which attention sdpa does not run"):
        parse(E.generate_parser().parse_args(E.E2EModel.load(None).argv() + ["--attention", "sdpa"] + flags[2:]),
              output=False)


def test_a_combined_path_runs_both_and_takes_only_its_own_fp8_entry():
    """`sol_attn+fp8_linear` (the contract's approximate path): --attention sol_attn --fp8-linear."""
    assert E.split_path("sol_attn+fp8_linear") == ("sol_attn", True)
    assert E.split_path("fp8_linear") == (None, True) and E.split_path("sol_attn") == ("sol_attn", False)
    assert E.path_flags("sol_attn+fp8_linear", "fa3") == ["--attention", "sol_attn", "--fp8-linear"]
    assert E.kind_of("sol_attn+fp8_linear") == "approximate" and E.kind_of("nope+fp8_linear") == "unknown"
    if E.knows_flag("--fp8-linear"):  # the attention half decides availability
        assert E.unavailable("sol_attn+fp8_linear", "cpu") == E.unavailable("sol_attn", "cpu")


def test_a_drift_replay_that_compares_nothing_is_refused(test_backends, tmp_path, capsys):
    """The drift replay of an e2e frames row: --quantity without the baseline it is held to is one line before any
    compute; a baseline holding neither quantity compares nothing, which is no verdict (exit 2), never a pass."""
    import numpy as np

    assert E.main(["compare", "--path", "noisy_0.001", "--quantity", "frames"]) == 2
    assert "give the --baseline" in capsys.readouterr().err
    empty = tmp_path / "empty.npz"
    np.savez(empty, mode=np.array("noisy_0.001"))
    assert E.main(["compare", "--path", "noisy_0.001", "--baseline", str(empty), "--drift", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "nothing compared" in err and "frames, waveform" in err, err
