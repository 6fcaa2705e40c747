"""The fused SwiGLU kernel is bitwise equal to eager silu·up on the GPU (the only place it runs)."""

import pytest
import torch
import torch.nn.functional as F

from h3direct.dit import fused

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the fused kernels run only there)")
@pytest.mark.skipif(fused.triton is None, reason="needs Triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fused_swiglu_bitwise(dtype):
    g = torch.Generator(device="cpu").manual_seed(0)
    a = (torch.randn(3001, 2 * 1536, generator=g) * 4).to("cuda", dtype)
    gate, up = a.chunk(2, dim=-1)
    assert torch.equal(fused.swiglu(a), F.silu(gate).mul_(up))
