"""budget_attn's fused selection kernel (`h3direct/dit/budget_select_triton.py`): run by Triton's CPU interpreter it
chooses what `budget_attention.choose` chooses from every row's block masses (`block_masses` with all 64 rows), and
each row's true mass outside its kept blocks stays within the budget where the estimate is exact; compiled for
sm_90, sm_100 and sm_121 its products run on the tensor cores within each target's shared memory per block; on a GPU
it chooses what the torch rule chooses on the same inputs. `*_catches_*`: the comparison fails on a planted error.
"""

from __future__ import annotations

import pytest
import torch

from h3direct.dit import budget_attention as BA
from h3direct.dit import budget_select_triton as K
from h3direct.dit.budget_options import BUDGET_BLOCK, BudgetOptions
from tests.test_budget_attention import dense_block_masses, local_qk, uniform_subblocks
from tests.triton_targets import assert_fits_and_uses, compile_for

needs_triton = pytest.mark.skipif(K.triton is None, reason="needs Triton (the `test` extra installs it on x86_64 "
                                                           "Linux) to run the kernel in its CPU interpreter")
MMA = {(9, 0): r"wgmma\.mma_async\S*\.tf32", (10, 0): r"tcgen05\.mma\S*kind::tf32",
       (12, 1): r"mma\.sync\S*\.tf32\.tf32"}
# the kernel's masses against the torch rule's (both fp32, other summation orders), absolute
MASS_ATOL = 1e-5


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def kernel(q, k, mass, pb):
    """The kernel's choice from q, k [B, H, S, D], given what `select` gives it."""
    pooled, log_len = BA.pooled_keys(k.reshape(-1, *k.shape[2:]))
    return K.select_blocks(q, pooled, log_len, BA.mass_edges(q.device), mass, pb)


def torch_rule(q, k, mass, pb):
    """The torch side's choice from every row of each query block (what `select` runs off CUDA at samples 64)."""
    n = -(-q.shape[2] // BUDGET_BLOCK)
    forced = BA.forced_blocks(n, pb, True, q.device)
    return BA.choose(BA.block_masses(q[0].float(), k[0].float(), BUDGET_BLOCK), forced, mass)


def differs_near_an_edge(keep, want, q, k) -> bool:
    """Whether every key block the two choices disagree on has a mean mass within a relative 1e-4 of a bucket edge
    (where two summation orders may put it on either side), so that only such blocks differ."""
    means = BA.block_masses(q[0].float(), k[0].float(), BUDGET_BLOCK).mean(-2)
    edges = BA.mass_edges(means.device)
    near = ((means.unsqueeze(-1) - edges).abs() <= 1e-4 * edges).any(-1)
    return bool(near[keep != want].all())


def assert_same_choice(keep, dropped, want_keep, want_dropped, q, k):
    """The kernel's choice is the rule's: the blocks they disagree on lie on a bucket edge (`differs_near_an_edge`),
    and where a query block's row agrees, so does its dropped mass (fp32 sums in other orders)."""
    assert torch.equal(keep, want_keep) or differs_near_an_edge(keep, want_keep, q, k), \
        f"{int((keep != want_keep).sum())} of {keep.numel()} choices differ off the bucket edges"
    same = (keep == want_keep).all(-1)
    torch.testing.assert_close(dropped[same], want_dropped[same], rtol=0, atol=MASS_ATOL)


CASES = [  # (S, D, width, budget, sink blocks): partial last blocks, wide and sharp windows, sinks
    (700, 64, 16.0, 0.05, 0),
    (1000, 128, 64.0, 0.03, 3),
    (650, 64, 300.0, 0.05, 2),
    (1100, 128, 8.0, 0.2, 0),
]


@needs_triton
@pytest.mark.parametrize("s,d,width,mass,pb", CASES, ids=[f"S{c[0]}-D{c[1]}-w{c[2]:g}-m{c[3]}-pb{c[4]}" for c in CASES])
def test_the_kernel_chooses_what_the_torch_rule_chooses(s, d, width, mass, pb, interpret):
    q, k = (x.to(torch.bfloat16) for x in local_qk(s, d=d, width=width))
    keep, dropped = kernel(q, k, mass, pb)
    want_keep, want_dropped = torch_rule(q, k, mass, pb)
    n = -(-s // BUDGET_BLOCK)
    assert keep.dtype == torch.bool and keep.shape == (1, 2, n, n) and dropped.shape == (1, 2, n)
    assert_same_choice(keep[0], dropped[0], want_keep, want_dropped, q, k)
    assert 0.0 < float(keep.float().mean()) < 1.0 or width >= 300.0, "a case that keeps all or nothing tests little"


@needs_triton
def test_every_row_keeps_all_but_the_budget_of_its_true_mass(interpret):
    """Where the estimate is exact (every 16-token sub-block's keys equal), each of the 64 rows of every query block
    leaves at most the budget of its true mass outside the kept blocks, and `dropped` is the largest such mass."""
    q, k = local_qk(900, d=64, width=32.0)
    k = uniform_subblocks(k)
    q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    for mass in (0.01, 0.05):
        keep, dropped = kernel(q, k, mass, 0)
        n = -(-900 // BUDGET_BLOCK)
        rows = BA.sample_rows(900, BUDGET_BLOCK, "cpu")
        true = dense_block_masses(q[0].float(), k[0].float(), rows)  # [H, NQ, 64, NK]
        outside = (true * (~keep[0]).unsqueeze(2)).sum(-1)
        assert float(outside.max()) <= mass + 1e-5, (mass, float(outside.max()))
        torch.testing.assert_close(dropped[0].double(), outside.amax(-1), rtol=0, atol=1e-5)
        assert bool(keep[0][:, torch.arange(n), torch.arange(n)].all())


@needs_triton
def test_the_comparison_catches_a_planted_error(interpret, monkeypatch):
    """The budget doubled inside the kernel's call: its choice keeps fewer blocks than the torch rule, and the check
    above fails."""
    q, k = (x.to(torch.bfloat16) for x in local_qk(700, d=64, width=128.0))
    keep, dropped = kernel(q, k, 0.1, 0)
    want_keep, want_dropped = torch_rule(q, k, 0.05, 0)
    assert int(keep.sum()) < int(want_keep.sum())
    with pytest.raises(AssertionError, match="differ off the bucket edges"):
        assert_same_choice(keep[0], dropped[0], want_keep, want_dropped, q, k)
    # and a planted change of the masses alone, the choice kept: the dropped masses are compared
    with pytest.raises(AssertionError):
        assert_same_choice(want_keep, want_dropped + 1e-4, want_keep, want_dropped, q, k)


@needs_triton
def test_select_runs_the_kernel_at_every_row_and_torch_otherwise(monkeypatch, interpret):
    """`budget_attention.select` takes the kernel for budget_samples 64 where it runs (here: the interpreter, as if
    on CUDA), the torch rule otherwise, and both choose alike; the conditioning rows keep every block either way."""
    q, k = (x.to(torch.bfloat16) for x in local_qk(800, d=64, width=32.0))
    calls = []
    real = K.select_blocks
    monkeypatch.setattr(K, "select_blocks", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(BA, "fused_reason", lambda q, opts: None if opts.samples == BUDGET_BLOCK else "planted")
    fused = BA.select(q, k, 130, BudgetOptions(samples=64))
    assert calls == [1]
    monkeypatch.setattr(BA, "fused_reason", lambda q, opts: "planted: torch")
    eager = BA.select(q, k, 130, BudgetOptions(samples=64))
    assert calls == [1]
    assert torch.equal(fused.keep, eager.keep) or differs_near_an_edge(fused.keep[0], eager.keep[0], q, k)
    assert bool(fused.keep[:, :, :3].all()) and float(fused.dropped[:, :, :3].max()) == 0.0


def test_the_kernel_is_not_chosen_off_cuda_or_below_every_row():
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    assert "budget_samples=8" in BA.fused_reason(q, BudgetOptions(samples=8))
    assert BA.fused_reason(q, BudgetOptions(samples=64)) == "not CUDA"


@needs_triton
def test_the_kernel_refuses_inputs_it_is_not_built_for(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q = torch.zeros(1, 2, 256, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs on CUDA"):
        kernel(q, q, 0.05, 0)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.zeros(1, 2, 256, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim 32"):
        kernel(q, q, 0.05, 0)


# ---- compiled for the GPUs, on the CPU --------------------------------------------------------------------------

def _compile(cap: tuple[int, int], config: dict):
    """The kernel at D = 128 for sm_<cap>, as a launch at the DiT's shapes specializes it: pointers and the row
    strides 16-aligned, S, H, NQ, NK, NSUB, PB not."""
    from h3direct.dit.budget_attention import MASS_BUCKETS
    from h3direct.triton_build import build

    const = {"D": 128, "BLOCK": BUDGET_BLOCK, "SUBS": K.SUBS, "CHUNK": config["CHUNK"], "NB": MASS_BUCKETS,
             "INTERPRET": False, "DOT": build(K._dot), "RED": build(K._reduce), "SCAN": build(K._suffix_sum)}
    kinds = {"q_ptr": "*bf16", "keep_ptr": "*u8", "qk_scale": "fp32", "budget": "fp32"}
    return compile_for(K._select_kernel, cap, config, const, kinds, "*fp32", r"sq_[bhs]")


@needs_triton
@pytest.mark.parametrize("cap", list(MMA), ids=[f"sm_{a}{b}" for a, b in MMA])
def test_compiles_on_the_tensor_cores_within_shared_memory(cap, tmp_path, monkeypatch):
    """The launch config the table picks on each target: it compiles, its shared memory fits a block there, and its
    logits' products are that target's TF32 tensor-core instruction."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    config = K.LAUNCH.get(cap, K.DEFAULT_LAUNCH)
    compiled = _compile(cap, config)  # a compile error fails
    assert_fits_and_uses(compiled, cap, config, MMA[cap])


# ---- on a GPU (`pytest -m gpu`) ---------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("s,heads", [(6144, 4), (20050, 8)])
def test_compiled_kernel_chooses_what_the_torch_rule_chooses_on_cuda(s, heads, monkeypatch):
    """On this GPU's launch config, at a validation case's length and the workload's: the kernel's choice is the
    torch rule's on the same CUDA inputs (local attention, D = 128; `assert_same_choice`)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the rule in fp32
    q, k = (x.to("cuda", torch.bfloat16) for x in local_qk(s, d=128, heads=heads, width=48.0))
    keep, dropped = kernel(q, k, 0.05, 2)
    want_keep, want_dropped = torch_rule(q, k, 0.05, 2)
    assert_same_choice(keep[0], dropped[0], want_keep, want_dropped, q, k)
    assert 0.0 < float(keep.float().mean()) < 1.0
