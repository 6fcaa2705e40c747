"""DiT blocks with FP8 block linears, for the tests of the fused e4m3 path (CPU: test_fused_kernels, GPU:
test_fused_gpu)."""

from __future__ import annotations

import torch

from h3direct.counts import counting
from h3direct.dit.linear import FP8Linear


def make_fp8(blk):
    """`blk` with its four block linears made FP8 (resident e4m3 weights), in place; returns it."""
    for parent, name in ((blk.attn, "qkv_proj"), (blk.attn, "out_proj"), (blk.mlp, "fc1"), (blk.mlp, "fc2")):
        setattr(parent, name, FP8Linear.from_module(getattr(parent, name), "resident"))
    return blk


def e4m3_path_is_the_tensor_path(blk, inputs, gemm: str) -> torch.Tensor:
    """Runs the fused block twice: as is (qkv_proj, fc1 and fc2 take e4m3 rows from the kernels, out_proj quantizes
    its input itself), and with a forward hook on those three linears (hooks see tensors, so every activation is
    handed over as one). Asserts both the GEMM counts (`gemm`: the path name, "scaled_mm" / "emulated (cpu)") and
    bitwise equal outputs; returns the output."""
    x, *rest = inputs
    with counting() as calls:
        ours = blk(x.clone(), *rest)
    assert calls.fp8_linear == {f"{gemm}, e4m3 input": 3, gemm: 1}, calls.fp8_linear
    hooks = [m.register_forward_pre_hook(lambda m, args: None) for m in (blk.attn.qkv_proj, blk.mlp.fc1, blk.mlp.fc2)]
    try:
        with counting() as calls:
            plain = blk(x.clone(), *rest)
        assert calls.fp8_linear == {gemm: 4}, calls.fp8_linear
    finally:
        for h in hooks:
            h.remove()
    assert torch.equal(ours, plain), float((ours.double() - plain.double()).abs().max())
    return ours


def refuse_e4m3_outputs(monkeypatch) -> None:
    """Makes any e4m3 output of the fused kernels an error (for the exact path's tests)."""
    from h3direct.dit import fused

    def refuse(*args, **kwargs):
        raise AssertionError("an e4m3 output on the exact path")

    monkeypatch.setattr(fused, "swiglu_e4m3", refuse)
    monkeypatch.setattr(fused, "_e4m3_rows", refuse)
