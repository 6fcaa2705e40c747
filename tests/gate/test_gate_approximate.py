"""An approximate backend is judged in three parts (parity_tests/gate.py), and each can fail on its own.

No approximate kernel runs on a CPU, so each backend's registry entry is replaced for the test by a CPU stand-in of
the same kind: exact attention plus a seeded relative error of a chosen size (sage2, ck_int8: held against exact
attention), h3direct's torch emulation of FA3's FP8 scaling plus an error (fa3_fp8: held against that emulation),
comfy-kitchen's eager Sol-Attn plus an error (sol_attn: held against its algorithm). Then:

- (a) a linear of h3direct scaled by 1.01 fails the gate at that linear under every approximate backend;
- (b) the stand-in degraded beyond its backend's contract fails at the first attention site, as a kernel row;
- (c) free-running, the mode's x0 against the exact path is reported and measured for its baseline (the class rule
  and the drift rule that judge it: tests/gate/test_gate_class_and_drift.py);
and the stand-ins within their contracts pass everywhere.
"""

from __future__ import annotations

import pytest

from h3direct.dit import attention as A
from parity_tests.discovery import FIXTURES, find_dit_cases
from tests.gate.plants import stand_in_backend

BACKENDS = ["sage2", "ck_int8", "fa3_fp8", "sol_attn"]
SMALL, LARGE = 2e-4, 0.2  # relative error of the stand-in: well inside every contract / far outside


@pytest.fixture
def approximate(monkeypatch):
    """install(backend, eps, half_only=False): the backend's registry entry runs its CPU stand-in (`plants.py`),
    available on the CPU in any dtype, or (half_only) in bf16/fp16 only, as the real kernels."""
    def install(backend: str, eps: float, half_only: bool = False):
        monkeypatch.setitem(A._REGISTRY, backend, stand_in_backend(backend, eps, half_only))
    return install


@pytest.fixture(scope="module")
def case():
    cases, problems = find_dit_cases([FIXTURES])
    assert not problems
    return next(c for c in cases if c.compute == "bf16" and c.twin_fp32 is not None)


def _run(case, backend, mode="teacher"):
    from parity_tests.gate import run_dit_case

    return run_dit_case(case, mode=mode, attention=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_within_contract_passes_all_three_parts(case, approximate, backend):
    approximate(backend, SMALL)
    teacher = _run(case, backend)
    assert teacher.passed, teacher.report()
    kernel = [r for r in teacher.layers if r.part == "kernel"]
    assert kernel and all(r.name.endswith(".attn.out_proj.in") for r in kernel)
    assert {r.part for r in teacher.layers} == {"exact", "kernel"}
    free = _run(case, backend, "free")
    assert free.passed, free.report()
    assert {r.name for r in free.layers if r.part == "quality"} == {"quality.x0.video", "quality.x0.audio"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_broken_linear_fails_under_every_approximate_backend(case, approximate, backend):
    """(a): blocks.1.mlp.fc1 scaled by 1.01 in h3direct: the gate fails there, not at an attention site."""
    from parity_tests.models import model as load_model

    approximate(backend, SMALL)
    module = load_model(str(case.checkpoint), case.compute, "w4a16", "cpu").get_submodule("blocks.1.mlp.fc1")
    handle = module.register_forward_hook(lambda m, a, out: out * 1.01)
    try:
        result = _run(case, backend)
    finally:
        handle.remove()
    first = result.first_failure
    assert first is not None and first.name == "blocks.1.mlp.fc1.out" and first.part == "exact", result.report()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_degraded_kernel_fails_at_the_attention_site(case, approximate, backend):
    """(b): the stand-in's error beyond the contract fails at the first attention site, as a kernel row, while every
    exact comparison still passes."""
    approximate(backend, LARGE)
    result = _run(case, backend)
    first = result.first_failure
    assert first is not None and first.part == "kernel", result.report()
    assert first.name == "token_refiner.blocks.0.attn.out_proj.in", result.report()
    assert all(r.passed for r in result.layers if r.part == "exact")
    assert "--mode kernel" in first.replay and "--attention " + backend in first.replay


@pytest.mark.parametrize("backend", ["sage2", "sol_attn"])
def test_a_far_off_backend_is_measured_for_its_baseline(case, approximate, backend):
    """(c): free-running, x0 of a stand-in far off is reported against h3direct's exact path and measured, with the
    rounding scales the drift rule needs: the outputs against ComfyUI's fp32 twin (1 path), x0 against the exact
    path (2)."""
    approximate(backend, 0.8)
    result = _run(case, backend, "free")
    assert all(r.passed for r in result.layers if r.part == "exact")  # the exact run is unchanged
    quality = {r.name: r for r in result.layers if r.part == "quality"}
    assert set(quality) == {"quality.x0.video", "quality.x0.audio"}
    assert all(r.passed and r.limit == float("inf") and r.error > 0.1 for r in quality.values())
    m = result.measured
    assert m["x0.video"].err == quality["quality.x0.video"].error and m["x0.video"].paths == 2
    assert m["out.sampler.denoised.video"].paths == 1 and m["out.sampler.denoised.video"].scale > 0


def test_fp8_linears_are_held_to_the_e4m3_rounding_bound():
    """FP8 block linears (CPU emulation): each FP8 product is a kernel row within the e4m3 rounding bound; an FP8
    linear whose output is off by 10 % fails there."""
    from parity_tests.gate import run_dit_case
    from parity_tests.models import model as load_model

    cases, _ = find_dit_cases([FIXTURES])
    case = next(c for c in cases if c.weights.startswith("nvfp4") and c.compute == "fp32")
    result = run_dit_case(case, mode="teacher", fp8_linear="stream")
    assert result.passed, result.report()
    rows = [r for r in result.layers if r.part == "kernel"]
    assert {r.name for r in rows} >= {"blocks.1.mlp.fc1.out", "blocks.1.mlp.fc2.out"}
    assert all(0 < r.error < r.limit for r in rows)
    fp8 = load_model(str(case.checkpoint), case.compute, "w4a16", "cpu", "stream")
    handle = fp8.get_submodule("blocks.1.mlp.fc1").register_forward_hook(lambda m, a, out: out * 1.1)
    try:
        bad = run_dit_case(case, mode="teacher", fp8_linear="stream")
    finally:
        handle.remove()
    first = bad.first_failure
    assert first is not None and first.name == "blocks.1.mlp.fc1.out" and first.part == "kernel", bad.report()


@pytest.mark.parametrize("backend", ["sage2", "kj_head_sliced"])
def test_a_bf16_only_backend_on_an_fp32_case(approximate, monkeypatch, backend):
    """As the real kernels: the stand-in runs only bf16. On an fp32 case the exact parts stay fp32, the kernel sites
    and the quality run in bf16 (against the exact path in bf16); kj_head_sliced is held to its inner backend's
    contract and quality."""
    from parity_tests.gate import run_dit_case

    approximate("sage2", SMALL, half_only=True)
    cases, _ = find_dit_cases([FIXTURES])
    case = next(c for c in cases if c.compute == "fp32" and c.weights == "bf16")
    for mode in ("teacher", "free"):
        result = run_dit_case(case, mode=mode, attention=backend)
        assert result.passed, result.report()
        parts = {r.part for r in result.layers}
        assert parts == ({"exact", "kernel"} if mode == "teacher" else {"exact", "quality"}), parts


def test_the_backends_options_reach_the_kernel_and_its_reference(case, approximate, monkeypatch):
    """`pytest -m parity --attention sol_attn --option sol_tau=2.0`: the backend runs at that tau, the eager
    algorithm it is held against too, at every kernel site and in the quality run; the report and the replay
    commands name the option."""
    from h3direct.dit.options import Options
    from h3direct.traces import kernels
    from parity_tests.gate import run_dit_case

    approximate("sol_attn", SMALL)
    seen = []
    algorithm = kernels.sol_algorithm

    def spy(q, k, v, prefix_rows, options=None):
        seen.append(options.tau if options is not None else None)
        return algorithm(q, k, v, prefix_rows, options)

    monkeypatch.setattr(kernels, "sol_algorithm", spy)
    opts = Options.from_flat({"attention": "sol_attn", "sol_tau": 2.0}).attention
    teacher = run_dit_case(case, mode="teacher", attention=opts)
    assert teacher.passed, teacher.report()
    kernel = [r for r in teacher.layers if r.part == "kernel"]
    # each kernel site: the stand-in (the backend's run) and the gate's reference, both at the given tau
    assert len(seen) == 2 * len(kernel) and set(seen) == {2.0}, seen
    assert teacher.attention == "sol_attn (sol_tau=2)"
    assert all("--attention sol_attn --option sol_tau=2" in r.replay for r in kernel), kernel[0].replay
    seen.clear()
    free = run_dit_case(case, mode="free", attention=opts)
    assert free.passed, free.report()
    assert seen and set(seen) == {2.0}, seen
