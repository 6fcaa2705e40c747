"""WeightPrefetcher (h3direct.dit.linear): the next block linear's weight made ahead on a side stream.

The scheduling (which product is made when, hits, misses, at most two products alive) is checked on the CPU with
recording streams; a small model's forward through the prefetcher (inline streams on the CPU, the real side
stream on CUDA) must be bitwise the forward without it.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from h3direct.dit import linear as L
from h3direct.dit import model as model_mod
from h3direct.dit.loader import load_dit
from h3direct.dit.model import Conditioning

FIX = Path(__file__).resolve().parents[1] / "fixtures"
NVFP4_FIX = FIX / "h3_fx_curve_nvfp4.safetensors"


class Product:
    """A stand-in weight product: which layer made it, and the made-count (to tell a fresh one from a stale)."""

    def __init__(self, name, serial):
        self.name, self.serial = name, serial


class FakeLayer:
    _prefetch = None

    def __init__(self, name, made):
        self.name, self.made = name, made

    def prefetch_product(self, dtype):
        self.made.append(self.name)
        return Product(self.name, len(self.made))


class RecordingStreams:
    """Logs produce/consume; tracks every product ever made (weakly) to count the live ones."""

    def __init__(self):
        self.log, self.products, self.max_alive = [], [], 0

    def alive(self):
        return sum(r() is not None for r in self.products)

    def produce(self, make):
        p = make()
        self.products.append(weakref.ref(p))
        self.max_alive = max(self.max_alive, self.alive())
        self.log.append(("produce", p.name))
        return p, ("token", p.name)

    def consume(self, token):
        self.log.append(("consume", token[1]))


def _setup(names=("q0", "o0", "f1_0", "f2_0", "q1", "o1", "f1_1", "f2_1")):
    made = []
    layers = [FakeLayer(n, made) for n in names]
    streams = RecordingStreams()
    pf = L.WeightPrefetcher(layers, torch.bfloat16, streams).attach()
    return pf, layers, streams, made


def _call(pf, layer, streams):
    """What a layer's forward does: take the product (it must be its own), use it, drop it."""
    assert pf.serves(layer, torch.bfloat16)
    p = pf.take(layer)
    assert p.name == layer.name
    streams.max_alive = max(streams.max_alive, streams.alive())
    return p.serial


def test_in_order_every_product_is_made_ahead_and_waited_for():
    pf, layers, streams, made = _setup()
    L.reset_prefetch_stats()
    with pf.running():
        for layer in layers:
            _call(pf, layer, streams)
    assert made == [layer.name for layer in layers]  # each made once, in order, nothing made past the last
    assert L.prefetch_stats() == {"prefetched": len(layers)}
    # layer i's product is started before layer i-1's is consumed (overlap), and consumed before it is used
    expect = [("produce", "q0")]
    for a, b in zip(layers, layers[1:] + [None], strict=True):
        expect.append(("consume", a.name))
        if b is not None:
            expect.append(("produce", b.name))
    assert streams.log == expect
    assert streams.max_alive == 2
    assert not pf.active and pf._pending is None


def test_out_of_order_falls_back_in_place_and_counts():
    # mlp_chunks = 2: fc1, fc2, fc1, fc2 per block; then a layer skipped and one called twice
    pf, layers, streams, made = _setup()
    q0, o0, f1, f2, q1, o1, f1b, f2b = layers
    L.reset_prefetch_stats()
    with pf.running():
        for layer in (q0, o0, f1, f2, f1, f2, q1, f1b, f1b, f2b):
            _call(pf, layer, streams)
            gc.collect()
    stats = L.prefetch_stats()
    # hits: q0 o0 f1 f2 | f2 (after the in-place f1) q1 | f2b; misses: f1 (q1 pending), f1b (o1 pending),
    # f1b again (f2b pending)
    assert stats == {"prefetched": 7, "sync_missed": 3}
    assert streams.max_alive <= 2


def test_cold_unused_and_outside_a_forward():
    pf, layers, streams, made = _setup()
    L.reset_prefetch_stats()
    assert not pf.serves(layers[0], torch.bfloat16)  # outside running(): the layer makes its own
    with pf.running():
        pf._pending = None  # as if the first product had been dropped
        _call(pf, layers[0], streams)
        assert not pf.serves(layers[1], torch.float32)  # another dtype: not served
    assert L.prefetch_stats() == {"sync_cold": 1, "unused": 1}
    with pytest.raises(RuntimeError, match="reentrant"), pf.running(), pf.running():
        pass
    assert not pf.active


def _inputs(c, seed=0):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, c.latents_dim, 3, 12, 12, generator=g)
    audio = torch.randn(1, c.audio_latents_dim, 2, 16, generator=g)
    text = torch.randn(1, 8, c.text_dim, generator=g)
    return video, audio, text


def _forward(model, chunks, device="cpu"):
    video, audio, text = (t.to(device) for t in _inputs(model.config))
    with torch.inference_mode():
        ctx = model.preprocess_text(text, backend="sdpa")
        return model.forward_inner(video, audio, torch.tensor([700.0], device=device), ctx, Conditioning(),
                                   backend="sdpa", mlp_chunks=chunks)


def _inline_prefetcher(model, like):
    pf = model.weight_prefetcher
    if pf is None:
        pf = model.weight_prefetcher = L.WeightPrefetcher(L.prefetch_layers(model), like.dtype,
                                                         L.InlineStreams()).attach()
    return pf


@pytest.mark.parametrize("fp8", ["off", "stream"])
@pytest.mark.parametrize("chunks", [1, 2])
def test_model_forward_through_the_prefetcher_is_bitwise(monkeypatch, chunks, fp8):
    model = load_dit(NVFP4_FIX, nvfp4_mode="w4a16", fp8_linear=fp8)
    assert L.prefetcher_for(model, torch.zeros(1, dtype=torch.bfloat16)) is None  # never on the CPU
    want = _forward(model, chunks)
    monkeypatch.setattr(model_mod, "prefetcher_for", _inline_prefetcher)
    L.reset_prefetch_stats()
    got = _forward(model, chunks)
    n = len(L.prefetch_layers(model))
    assert n == 4 * model.config.num_layers
    stats = L.prefetch_stats()
    if chunks == 1:
        assert stats == {"prefetched": n}
    else:  # each block's second fc1 finds the next block's qkv pending (the last block's: nothing), the rest
        # (qkv, out, fc1, fc2 twice) is made ahead
        blocks = model.config.num_layers
        assert stats == {"prefetched": 5 * blocks, "sync_missed": blocks - 1, "sync_cold": 1}
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


def test_prefetcher_for_is_opt_in_and_off_without_per_call_weights(monkeypatch):
    bf16 = load_dit(FIX / "h3_fx_curve_bf16.safetensors")
    assert L.prefetch_layers(bf16) == []
    assert L.prefetch_layers(load_dit(NVFP4_FIX, nvfp4_mode="w4a4")) == []
    assert len(L.prefetch_layers(load_dit(NVFP4_FIX, nvfp4_mode="w4a16", fp8_linear="resident"))) == 0
    # off by default, decided before anything else (no CUDA needed): an activation that claims to be on CUDA gets
    # no prefetcher, nothing is attached to the layers, and their forwards take the plain path
    model = load_dit(NVFP4_FIX, nvfp4_mode="w4a16")
    cuda_like = SimpleNamespace(is_cuda=True, dtype=torch.bfloat16, device=torch.device("cuda", 0))
    for value in (None, "0", "true"):
        if value is None:
            monkeypatch.delenv(L.PREFETCH_ENV, raising=False)
        else:
            monkeypatch.setenv(L.PREFETCH_ENV, value)
        assert L.prefetcher_for(model, cuda_like) is None
    assert model.weight_prefetcher is None and all(m._prefetch is None for m in L.prefetch_layers(model))
    if torch.cuda.is_available():
        model = load_dit(NVFP4_FIX, nvfp4_mode="w4a16", device="cuda")
        like = torch.zeros(1, dtype=torch.bfloat16, device="cuda")
        monkeypatch.delenv(L.PREFETCH_ENV, raising=False)
        assert L.prefetcher_for(model, like) is None  # opt-in: it did not win on the H200
        monkeypatch.setenv(L.PREFETCH_ENV, "1")
        assert L.prefetcher_for(model, like) is not None
        monkeypatch.setenv(L.PREFETCH_ENV, "0")
        assert L.prefetcher_for(model, like) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the side stream)")
@pytest.mark.parametrize("fp8", ["off", "stream"])
@pytest.mark.parametrize("chunks", [1, 2])
def test_cuda_forward_with_prefetch_is_bitwise(monkeypatch, chunks, fp8):
    if fp8 == "stream" and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("fp8 stream needs compute capability >= 9")
    model = load_dit(NVFP4_FIX, compute_dtype="bf16", nvfp4_mode="w4a16", device="cuda", fp8_linear=fp8)
    monkeypatch.setenv(L.PREFETCH_ENV, "0")
    want = _forward(model, chunks, "cuda")
    monkeypatch.setenv(L.PREFETCH_ENV, "1")
    L.reset_prefetch_stats()
    got = _forward(model, chunks, "cuda")
    torch.cuda.synchronize()
    n = len(L.prefetch_layers(model))
    assert isinstance(model.weight_prefetcher.streams, L.CudaStreams)
    assert L.prefetch_stats().get("prefetched") == (n if chunks == 1 else 5 * model.config.num_layers)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
