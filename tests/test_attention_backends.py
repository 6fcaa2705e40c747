"""Attention backends on the CPU: sol_attn's option mapping onto comfy-kitchen's real `sol_attn`, its documented
fallback (counted) and strict mode, one-line unavailability, and dtype-aware probing (a bf16-only backend is run
in bf16 against fp32 traces, never skipped and never handed fp32)."""

from __future__ import annotations

import inspect
from pathlib import Path

import comfy_kitchen as ck  # the `kitchen` extra (>= 0.2.40: sol_attn), installed by CI
import pytest
import torch

from h3direct.app.env import read_options
from h3direct.counts import counting
from h3direct.dit import attention as A
from h3direct.dit.options import AttentionOptions, Options
from h3direct.dit.sol_options import SolOptions
from h3direct.errors import BackendUnavailable, ConfigError, RequestError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def sol_options(env: dict) -> SolOptions:
    """sol_attn's options as the command line's edge reads them from the environment."""
    return Options.from_flat(read_options(env)).attention.sol_attn


def test_sol_defaults_map_onto_kernel_arguments():
    opts = sol_options({})
    kw = opts.kernel_kwargs(prefix_rows=1180)
    # 1,180 conditioning rows (text 256 + reference 510 + audio 414) -> key blocks [0, 19) are sinks; their query
    # blocks (rows [0, 1216)) attend every key exactly through the rows backend, so the kernel routes every block
    assert kw == {"tau": 1.3, "tail": True, "token_aug": 0, "topk_ratio": 0.0, "sink_blocks": [0, 19]}
    assert opts.exact_query_rows(1180, rows=20050) == 19 * 64 and opts.exact_query_rows(1180, rows=1000) == 1000
    # the kernel has them as its exact query blocks when it computes them itself
    assert sol_options({"H3_SOL_ROWS_BACKEND": "kernel"}).kernel_kwargs(prefix_rows=1180)["sink_q"] == [0, 19]
    assert opts.rows_elsewhere == "sdpa" and SolOptions(rows_backend="kernel").rows_elsewhere is None
    assert SolOptions(exact_rows=False).rows_elsewhere is None
    none = opts.kernel_kwargs(prefix_rows=None)
    assert "sink_blocks" not in none and "sink_q" not in none and opts.exact_query_rows(None, rows=64) == 0
    assert sol_options({"H3_SOL_EXACT_ROWS": "0"}).exact_query_rows(1180, rows=20050) == 0


@pytest.mark.parametrize("env, key, want", [
    ({"H3_SOL_TAU": "2.0"}, "tau", 2.0),
    ({"H3_SOL_THRESH_TYPE": "topk", "H3_SOL_TOPK_RATIO": "0.25"}, "topk_ratio", 0.25),
    ({"H3_SOL_TOPK_RATIO": "0.25"}, "topk_ratio", 0.0),  # only with THRESH_TYPE=topk
    ({"H3_SOL_TAIL": "0"}, "tail", False),
    ({"H3_SOL_TOKEN_AUG": "128"}, "token_aug", 128),
    ({"H3_SOL_SINKS": "none"}, "sink_blocks", None),
    ({"H3_SOL_EXACT_ROWS": "0", "H3_SOL_ROWS_BACKEND": "kernel"}, "sink_q", None),
], ids=["tau", "topk", "topk-needs-type", "tail", "token_aug", "no-sinks", "routed-rows"])
def test_sol_env_mapping(env, key, want):
    assert sol_options(env).kernel_kwargs(prefix_rows=100).get(key) == want


@pytest.mark.parametrize("env, needle", [
    ({"H3_SOL_TAU": "-1"}, "H3_SOL_TAU='-1': must be a positive number"),
    ({"H3_SOL_TAU": "fast"}, "H3_SOL_TAU='fast'"),
    ({"H3_SOL_THRESH_TYPE": "row"}, "diag, topk"),
    ({"H3_SOL_TOPK_RATIO": "1.5"}, "(0, 1)"),
    ({"H3_SOL_TOKEN_AUG": "100"}, "multiple of 64"),
    ({"H3_SOL_STRICT": "maybe"}, "1/0, true/false, yes/no or on/off"),
    ({"H3_SOL_FALLBACK": "sol_attn"}, "another attention backend"),
    ({"H3_SOL_ROWS_BACKEND": "sage2"}, "sdpa, cudnn_sdpa, fa3, kernel"),
    ({"H3_SOL_INT8_QK": "1"}, "no precision switch"),
    ({"H3_SOL_INT8_PV": "0"}, "no precision switch"),
])
def test_sol_bad_options_are_one_line_errors(env, needle):
    with pytest.raises(ConfigError) as exc:
        sol_options(env)
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_sol_kwargs_match_comfy_kitchen_signature():
    """The mapped arguments are accepted by comfy-kitchen's sol_attn and change what it computes (its eager
    reference runs on the CPU)."""
    params = inspect.signature(ck.sol_attn).parameters
    opts = SolOptions(thresh_type="topk", topk_ratio=0.25)
    kw = opts.kernel_kwargs(prefix_rows=70)
    assert set(kw) <= set(params)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 512, 2, 128, generator=g).to(torch.bfloat16) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2).float() for x in (q, k, v)))
    with_sinks = ck.sol_attn(q, k, v, **kw).transpose(1, 2).float()
    no_sinks = ck.sol_attn(q, k, v, **SolOptions(thresh_type="topk", topk_ratio=0.25, sinks="none")
                           .kernel_kwargs(prefix_rows=70)).transpose(1, 2).float()
    assert not torch.equal(with_sinks, no_sinks)  # sink_blocks reached the kernel
    # with sinks covering the first two key blocks, those keys are attended exactly: the sparse result is closer
    err = lambda x: float((x - dense).norm() / dense.norm())  # noqa: E731
    assert err(with_sinks) < err(no_sinks) < 1.0


@pytest.mark.parametrize("rows_backend", ["sdpa", "kernel"])
def test_sol_rows_before_the_video_attend_exactly(rows_backend):
    """With exact_rows on (the default) the query blocks before the target video (text, references, audio) attend
    every key exactly: on attention without locality (random q, k) they equal dense attention, while routed rows do
    not. With an exact rows backend they are that backend's rows, over every key, and the video rows are the kernel's
    with every block routed; q, k, v are strided views of one qkv tensor, as the DiT hands them over."""
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(640, 3, 2, 128, generator=g)
    q, k, v = (qkv[:, i].unsqueeze(0).transpose(1, 2) for i in range(3))  # [1, 2, 640, 128] views
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    prefix = 150  # rows [0, 150) precede the video: query blocks [0, 3) are exact
    opts = AttentionOptions("sol_attn", sol_attn=SolOptions(rows_backend=rows_backend, min_tokens=0))
    with A.sequence_hints(prefix):
        out = A.sol_call(q, k, v, ck.sol_attn, opts)
    routed = ck.sol_attn(*(x.transpose(1, 2) for x in (q, k, v)),
                         **SolOptions(exact_rows=False).kernel_kwargs(prefix_rows=prefix)).transpose(1, 2)
    err = lambda x, rows: float((x[:, :, rows] - dense[:, :, rows]).norm() / dense[:, :, rows].norm())  # noqa: E731
    head, tail = slice(0, 192), slice(192, 640)
    assert err(out, head) < 1e-5 < err(routed, head)
    assert err(out, tail) > 1e-2  # the video rows stay sparse
    if rows_backend == "sdpa":
        assert torch.equal(out[:, :, head], A._sdpa(q[:, :, head], k, v))
        assert torch.equal(out[:, :, tail], routed[:, :, tail])


def test_sol_algorithm_has_the_exact_rows_whichever_backend_computes_them():
    """The gate's reference (comfy-kitchen's eager Sol-Attn under the backend's options) keeps the query blocks before
    the video exact for every rows backend: the kernel is judged against the algorithm, not against a routed one."""
    from h3direct.traces.kernels import sol_algorithm

    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 640, 128, generator=g) for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(1, 640, 256)
    for rows in ("sdpa", "fa3", "kernel"):
        ref = sol_algorithm(q, k, v, 150, SolOptions(rows_backend=rows))
        assert float((ref[:, :192] - dense[:, :192]).norm() / dense[:, :192].norm()) < 1e-5, rows
        assert float((ref[:, 192:] - dense[:, 192:]).norm() / dense[:, 192:].norm()) > 1e-2, rows


def test_sol_rows_backend_must_run_here(monkeypatch):
    """An exact rows backend that cannot run here makes sol_attn unavailable, naming the option at fault (the
    kernel itself stands in as available; fa3 cannot run on the CPU)."""
    monkeypatch.setattr(A, "sol_kernel_reason", lambda like: None)
    like = torch.empty(0, dtype=torch.bfloat16)
    opts = AttentionOptions("sol_attn", sol_attn=SolOptions(rows_backend="fa3", fallback="sdpa"))
    reason = A.unavailable_reason(opts, like)
    assert reason.startswith("its exact rows' backend sol_rows_backend 'fa3' cannot run: ") and "\n" not in reason
    for ok in (SolOptions(rows_backend="sdpa", fallback="sdpa"), SolOptions(rows_backend="fa3", exact_rows=False,
                                                                            fallback="sdpa")):
        assert A.unavailable_reason(AttentionOptions("sol_attn", sol_attn=ok), like) is None


def test_sol_rows_backends_are_the_exact_backends():
    """rows_backend's choices are the registry's exact backends (and the kernel): one list, checked here."""
    from h3direct.dit.sol_options import ROWS_BACKENDS

    exact = {n for n in A.backends() if A._REGISTRY[n].exact}
    assert set(ROWS_BACKENDS) - {"kernel"} == exact


def test_sol_without_kernel_is_unavailable_not_substituted():
    opts = AttentionOptions("sol_attn", sol_attn=SolOptions(fallback="sdpa"))
    like = torch.empty(0, dtype=torch.bfloat16)
    reason = A.unavailable_reason(opts, like)
    assert reason is not None and ("CUDA" in reason or "sol_attn" in reason)
    q = torch.randn(1, 2, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailable, match="attention backend 'sol_attn' cannot run"):
        A.attention(q, q, q, opts)


def test_sol_documented_fallback_is_counted_and_strict_refuses():
    """Calls the kernel cannot take (head_dim 32, or shorter than sol_min_tokens) run sol_fallback and are
    counted (in the caller's scoped collector); the rest run the kernel (here comfy-kitchen's own eager sol_attn
    reference, the CPU form of the algorithm), with the sinks of the current sequence; sol_strict turns fallbacks
    into errors."""
    opts = AttentionOptions("sol_attn", sol_attn=SolOptions(fallback="sdpa", min_tokens=256, rows_backend="kernel"))
    q = torch.randn(1, 2, 64, 32, dtype=torch.bfloat16)
    with counting() as calls:
        assert torch.equal(A.sol_call(q, q, q, ck.sol_attn, opts), A._sdpa(q, q, q))
        assert calls.as_dict()["attention"] == {"sol_attn": {"fallback to sdpa: head_dim": 1}}
        short = torch.randn(1, 2, 128, 128, dtype=torch.bfloat16)
        A.sol_call(short, short, short, ck.sol_attn, opts)
        assert calls.attention["sol_attn"]["fallback to sdpa: short"] == 1
        long = torch.randn(1, 2, 320, 128, dtype=torch.bfloat16)
        with A.sequence_hints(70):
            out = A.sol_call(long, long, long, ck.sol_attn, opts)
        want = ck.sol_attn(*(x.transpose(1, 2) for x in (long, long, long)), tau=1.3, sink_blocks=[0, 2],
                           sink_q=[0, 2]).transpose(1, 2)
        assert torch.equal(out, want) and calls.attention["sol_attn"]["kernel"] == 1
    strict = AttentionOptions("sol_attn", sol_attn=SolOptions(fallback="sdpa", min_tokens=256, strict=True))
    with pytest.raises(BackendUnavailable, match="sol_strict forbids it"):
        A.sol_call(q, q, q, ck.sol_attn, strict)


@pytest.mark.parametrize("name, prefix, gate", [("sol_attn", "sol", "sol_kernel_reason"),
                                                ("fa3_fp8", "fp8_attn", "_fa3_available")])
def test_fallback_backend_is_part_of_availability(monkeypatch, name, prefix, gate):
    """With its kernel runnable (gate patched open on the CPU), a backend with a documented fallback is available
    only when that fallback is another registered backend that can run here too; strict mode needs no fallback."""
    monkeypatch.setattr(A, gate, lambda like: None)
    like = torch.empty(0, dtype=torch.bfloat16)

    def opts(**kw):
        return Options.from_flat({"attention": name, **{f"{prefix}_{k}": v for k, v in kw.items()}}).attention

    assert A.unavailable_reason(opts(fallback="sdpa"), like) is None
    reason = A.unavailable_reason(opts(fallback="no_such_backend"), like)
    assert f"{prefix}_fallback 'no_such_backend'" in reason and "\n" not in reason
    reason = A.unavailable_reason(opts(fallback="fa3"), like)  # registered, but not on the CPU
    assert reason.startswith(f"its fallback {prefix}_fallback 'fa3' cannot run: ") and "\n" not in reason
    with pytest.raises(RequestError, match="another attention backend"):
        opts(fallback=name)  # itself: refused by the option's own rule, never a recursion
    assert A.unavailable_reason(opts(fallback="no_such_backend", strict=True), like) is None


@pytest.mark.parametrize("name", ["fa3", "sage2", "cudnn_sdpa", "ck_int8"])
def test_gpu_backends_say_why_on_cpu(name):
    reason = A.unavailable_reason(name, torch.empty(0, dtype=torch.bfloat16))
    assert reason is not None and "\n" not in reason
    with pytest.raises(BackendUnavailable, match=f"attention '{name}' cannot run"):
        A.check_backend(name, torch.empty(0, dtype=torch.bfloat16))


def test_sage1_is_not_sage2(monkeypatch, tmp_path):
    """PyPI's sageattention 1.x (Triton) has `sageattn` but not SageAttention 2's CUDA entry points."""
    pkg = tmp_path / "sageattention"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("def sageattn(*a, **k):\n    raise AssertionError('SA1 must not run')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    like = torch.empty(0, dtype=torch.bfloat16, device="meta")
    monkeypatch.setattr(A, "_cuda_only", lambda like: None)
    assert "SageAttention 1" in A._sage2_available(like)


def test_half_only_backend_runs_fp32_traces_in_bf16():
    """An exact backend that runs only bf16/fp16 is gated on fp32 traces in bf16 (budget compute key bf16@fp32, ratio
    rule against ComfyUI's own bf16 trace of the case) and never receives fp32 tensors."""
    from parity_tests.discovery import find_dit_cases
    from parity_tests.gate import run_dit_case
    from parity_tests.models import run_dtype

    seen = set()

    def half_only_sdpa(q, k, v):
        seen.add(q.dtype)
        return A._sdpa(q, k, v)

    A.register("test_half_only", half_only_sdpa, A._half_only, exact=True)
    try:
        cases, _ = find_dit_cases([FIXTURES])
        low = {c.twin_fp32.name for c in cases if c.twin_fp32 is not None and c.compute == "bf16"}
        case = next(c for c in cases if c.compute == "fp32" and c.trace.name in low)
        compute, reason = run_dtype("test_half_only", case.compute, "cpu")
        assert (compute, reason) == ("bf16", None)
        for mode in ("teacher", "free"):
            res = run_dit_case(case, mode=mode, attention="test_half_only", compute=compute)
            assert res.compute == "bf16@fp32" and res.layers and res.passed, res.report()
            out = [r for r in res.layers if r.name.startswith("dit_inner.out.")]
            # bf16 against fp32: an error of bf16 size, not fp32 round-off and not garbage
            assert out and all(1e-4 < r.rel_l2 < 5e-2 for r in out)
        assert seen == {torch.bfloat16}
    finally:
        A._REGISTRY.pop("test_half_only", None)


def test_gate_report_lists_counted_attention_calls(tmp_path):
    from parity_tests.discovery import find_dit_cases
    from parity_tests.report import ReportCollector
    from parity_tests.results import CaseResult

    cases, _ = find_dit_cases([FIXTURES])
    res = CaseResult(cases[0], "free", "sol_attn", attention_calls={"sol_attn": {"fallback to sage2: head_dim": 6}})
    rep = ReportCollector()
    rep.add_case(res)
    text = (rep.write(tmp_path) / "report.md").read_text()
    assert "## Attention calls" in text and "sol_attn: fallback to sage2: head_dim 6" in text
