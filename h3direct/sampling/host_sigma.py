"""Host copies of the sampler's sigmas, so that a model call can plan its step without reading the GPU back.

A step's σ decides things the host must know before it launches any work (which time embeddings, which adaLN rows
per run). The sampler knows every σ on the host; the tensor it hands the model may live on the GPU, and reading that
back (`float(t)`, `.item()`) stalls the host until the GPU has drained every queued kernel. `tag(t, value)` records
on the tensor object that its elements equal `value`; `value_of(t)` returns it, or None when the tensor carries no
tag or has been modified in place since it was tagged (its version counter moved). Inference tensors have no version
counter: their tag is taken on trust, so only the code that made such a tensor should tag it, right after making it.
"""

from __future__ import annotations

import torch

_ATTR = "_h3_host_sigma"


def _version(t: torch.Tensor) -> int | None:
    return None if t.is_inference() else t._version


def tag(t: torch.Tensor, value: float) -> torch.Tensor:
    """Record that every element of `t` equals the host float `value`; returns `t`."""
    setattr(t, _ATTR, (float(value), _version(t)))
    return t


def value_of(t: torch.Tensor) -> float | None:
    """The value `tag` recorded on `t`, or None (untagged, or changed in place since)."""
    record = getattr(t, _ATTR, None)
    if record is None:
        return None
    value, version = record
    if version is not None and t._version != version:
        return None
    return value


def read(t: torch.Tensor) -> float:
    """The host value of `t`'s first element (as float32): the tag when there is one, else read back from the
    device (a synchronization on a GPU), and then remembered on `t` when its version counter can vouch for it."""
    value = value_of(t)
    if value is None:
        value = float(t.reshape(-1)[0].float())
        if not t.is_inference():
            tag(t, value)
    return value
