"""Host -> device copies that do not make the host wait for the GPU.

A plain `tensor.to("cuda")` from ordinary (pageable) host memory waits until the copy is done, and the copy waits
for every kernel queued before it: the host stalls, and the GPU idles afterwards until the host has queued new work.
`upload` stages small host tensors in pinned memory and copies asynchronously, in stream order; the pinned block is
kept by PyTorch's host allocator until the copy has run.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """`t` (a host tensor) on `device`, without a host-side wait on CUDA; other devices: `t.to(device)`."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
