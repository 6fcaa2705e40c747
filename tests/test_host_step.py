"""A denoising step after the first reads nothing back from the device, and its numbers do not change for it.

The host-side planning of a step (layout, per-row timesteps, condition rows, rope table, text tags) used to read σ and
the tags back from the device and to copy host lists to it, each a synchronization on a GPU. `SyncSpy` counts, at the
Python level, every call that is one on a GPU (item, tolist, float/int/bool/index of a tensor, nonzero, cpu, numpy,
torch.tensor(..., device=...), torch.cuda.synchronize); the tests check that a warm `Denoiser` call makes none and that
its outputs are bitwise those of the uncached path (today's op order), for several σ.
"""

from __future__ import annotations

import traceback
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from h3direct.dit.denoiser import Denoiser, model_forward
from h3direct.dit.loader import load_dit
from h3direct.dit.timesteps import audio_sigma, host_stream_times, sigma_from_timestep
from h3direct.sampling import host_sigma
from h3direct.sampling.sampler import sample
from h3direct.sampling.schedules import SCHEDULERS, FlowSigmas, scheduler_sigmas
from h3direct.traces.evaluate import conditioning_of
from h3direct.traces.inputs import load_inputs

FIX = Path(__file__).resolve().parents[1] / "fixtures"
SCALE = 12.0 / 3.0


class SyncSpy:
    """While active, records each Python-level call that synchronizes host and device on a GPU (with where it came
    from), then lets it run."""

    METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "nonzero", "cpu", "numpy")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self._mp = monkeypatch
        self.active = False

    def _note(self, what: str):
        if self.active:
            frame = traceback.extract_stack(limit=4)[0]
            self.calls.append(f"{what} at {Path(frame.filename).name}:{frame.lineno}")

    def __enter__(self):
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def wrapped(t, *a, _orig=original, _name=name, **k):
                self._note(f"Tensor.{_name}")
                return _orig(t, *a, **k)

            self._mp.setattr(torch.Tensor, name, wrapped)
        make, nonzero = torch.tensor, torch.nonzero

        def tensor(data, *a, **k):
            if k.get("device") is not None:
                self._note("torch.tensor(..., device=...)")
            return make(data, *a, **k)

        def nz(*a, **k):
            self._note("torch.nonzero")
            return nonzero(*a, **k)

        self._mp.setattr(torch, "tensor", tensor)
        self._mp.setattr(torch, "nonzero", nz)
        self._mp.setattr(torch.cuda, "synchronize", lambda *a, **k: self._note("torch.cuda.synchronize"))
        self.active = True
        return self

    def __exit__(self, *exc):
        self.active = False
        self._mp.undo()


@pytest.fixture(scope="module")
def setup():
    model = load_dit(FIX / "h3_fx_bf16.safetensors")
    inp = load_inputs(FIX / "inputs_fx_ref2va.safetensors")
    cond = conditioning_of(inp)
    # vision pads (tag 0) inside the prompt: the text segment splits into several modulation runs
    cond.text_token_tags = torch.tensor([1, 1, 0, 0, 0, 1, 1, 1])
    with torch.no_grad():
        ctx = model.preprocess_text(inp["text_states"])
    return model, ctx, cond, inp["video_noise"], inp["audio_noise"]


def _uncached_x0(model, ctx, cond, xv, xa, sigma):
    """The step as it was computed before any caching: no invariants, σ's plan read back from the tensor."""
    s = sigma.reshape(-1)[:1].float()
    timestep = (s * 1000.0).float()
    with torch.no_grad():
        out_v, out_a = model_forward(model, xv.to(model.compute_dtype), xa.to(model.compute_dtype), timestep, ctx,
                                     cond, audio_scale=SCALE)
    return xv - out_v.float() * s.reshape(1, 1, 1, 1, 1), xa - out_a.float() * s.reshape(1, 1, 1, 1)


def test_spy_sees_syncs(monkeypatch, setup):
    """The detector can fail: a direct read, and the uncached path (which reads σ and the tags back), are seen."""
    model, ctx, cond, xv, xa = setup
    with SyncSpy(monkeypatch) as spy:
        float(torch.ones(1))
    assert spy.calls and "Tensor.__float__" in spy.calls[0]
    with SyncSpy(monkeypatch) as spy:
        _uncached_x0(model, ctx, cond, xv, xa, torch.tensor([0.5]))
    assert any("tolist" in c for c in spy.calls) and any("__float__" in c for c in spy.calls), spy.calls


def test_warm_step_reads_nothing_back(monkeypatch, setup):
    model, ctx, cond, xv, xa = setup
    den = Denoiser(model, ctx, cond, SCALE)
    sigma = torch.tensor([0.8])
    den(xv, xa, sigma)  # warm-up: reads σ once (then remembered on the tensor), builds the invariants
    with SyncSpy(monkeypatch) as spy:
        den(xv, xa, sigma)  # the same σ tensor
        den(xv, xa, host_sigma.tag(torch.tensor([0.3]), 0.3))  # a new σ, tagged as the sampler does
    assert spy.calls == []
    # an untagged new σ is read back (once), which the spy sees
    with SyncSpy(monkeypatch) as spy:
        den(xv, xa, torch.tensor([0.6]))
    assert len(spy.calls) == 1, spy.calls


def test_cached_steps_bitwise_equal_uncached(setup):
    """Warm calls give bitwise the uncached path's x0, σ after σ (the cache freezes nothing that depends on σ;
    σ = 1 has t_video = t_audio, so one time-embedding row fewer)."""
    model, ctx, cond, xv, xa = setup
    den = Denoiser(model, ctx, cond, SCALE)
    outs = {}
    for s in (0.8, 0.3, 1.0, 0.8, 0.05):
        sigma = host_sigma.tag(torch.tensor([s]), s) if s < 0.5 else torch.tensor([s])
        got = den(xv, xa, sigma)
        want = _uncached_x0(model, ctx, cond, xv, xa, torch.tensor([s]))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), f"sigma {s}: cached step differs from uncached"
        outs[s] = got
    assert not torch.equal(outs[0.8][0], outs[0.3][0]) and not torch.equal(outs[0.3][1], outs[0.05][1])


def test_invariants_follow_changed_inputs(setup):
    """A warm Denoiser whose inputs change under it (conditioning seed, text tags, keyframes / references, latent
    sizes) makes its invariants again: each call still equals the uncached path for the inputs it was given, and each
    change shows in the output (so a stale piece would be caught)."""
    model, ctx, cond, xv, xa = setup
    den = Denoiser(model, ctx, replace(cond), SCALE)
    sigma = 0.8
    previous = None
    for change in ("none", "seed", "tags", "keyframe", "video size", "audio size"):
        if change == "seed":  # noise-augmented condition rows (visual keep 0.999) depend on it
            den.cond = replace(den.cond, seed=den.cond.seed + 7)
        elif change == "tags":  # a new tag tensor: other modulation runs
            den.cond = replace(den.cond, text_token_tags=torch.tensor([1, 0, 0, 1, 1, 1, 0, 1]))
        elif change == "keyframe":  # the reference image becomes a first-frame keyframe: as many rows, other places
            (ref,) = den.cond.refs
            den.cond = replace(den.cond, refs=[], keyframes=[{"resolved_frame_index": 0, "latent": ref["latent"]}])
        elif change == "video size":  # a new layout, hence a new rope table
            xv = xv[:, :, :1]
        elif change == "audio size":
            xa = xa[..., :-1]
        got = den(xv, xa, host_sigma.tag(torch.tensor([sigma]), sigma))
        want = _uncached_x0(model, ctx, den.cond, xv, xa, torch.tensor([sigma]))
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), f"after a change of {change}: the warm step differs from the uncached one"
        if previous is not None and got[0].shape == previous[0].shape:
            assert not torch.equal(got[0], previous[0]), f"a change of {change} does not show in the output"
        previous = got
    assert den._layout.signature[1:] == (1, *xv.shape[3:], xa.shape[-1])


def test_stale_tag_is_not_used():
    t = host_sigma.tag(torch.tensor([0.5]), 0.5)
    assert host_sigma.value_of(t) == 0.5
    t.mul_(2.0)  # changed in place after tagging: the tag no longer vouches for it
    assert host_sigma.value_of(t) is None and host_sigma.read(t) == 1.0


def _sigma_cases() -> list[float]:
    g = torch.Generator().manual_seed(0)
    cases = FlowSigmas(12.0).table.tolist() + torch.rand(2000, generator=g).tolist()
    for name in SCHEDULERS:
        cases += scheduler_sigmas(name, 30).tolist()
    return cases + [1.0, 0.0, 1e-7, 1e-6, 0.999, 0.001]


def test_host_times_equal_the_tensor_path_cpu():
    """The host mirror of σ → (t_video, t_audio) equals the float32 tensor ops on the CPU, bit for bit."""
    bad = []
    for s in _sigma_cases():
        ts = (torch.tensor([s]).float() * 1000.0).float()
        sv = sigma_from_timestep(ts)
        want = (float(1.0 - sv), float(1.0 - audio_sigma(sv, 12.0, 3.0)))
        if host_stream_times(s, shift_video=12.0, shift_audio=3.0, device_type="cpu") != want:
            bad.append(s)
    assert not bad, f"{len(bad)} sigmas differ, e.g. {bad[:5]}"


def test_host_times_cuda_mirror_is_the_reciprocal_product():
    """The CUDA branch: the timestep times the float32 reciprocal of 1000 (how CUDA divides by a host scalar), the
    rest as on the CPU — checked here against those float32 ops done on CPU tensors (the GPU script checks the GPU)."""
    recip = torch.tensor(1.0 / 1000.0, dtype=torch.float32)
    bad, differs = [], 0
    for s in _sigma_cases():
        ts = (torch.tensor([s]).float() * 1000.0).float()
        sv = (ts[0] * recip).clamp(min=1e-6)
        want = (float(1.0 - sv), float(1.0 - audio_sigma(sv, 12.0, 3.0)))
        got = host_stream_times(s, shift_video=12.0, shift_audio=3.0, device_type="cuda")
        bad += [s] if got != want else []
        differs += got != host_stream_times(s, shift_video=12.0, shift_audio=3.0, device_type="cpu")
    assert not bad, f"{len(bad)} sigmas differ, e.g. {bad[:5]}"
    assert differs > 0  # the two devices' roundings really differ somewhere: the branch matters
    assert host_stream_times(0.5, shift_video=12.0, shift_audio=3.0, device_type="mps") is None


@pytest.mark.parametrize("sampler", ["euler", "heun", "dpmpp_2m"])
def test_sampler_loop_reads_back_once_and_tags_sigmas(monkeypatch, sampler):
    """The loop's read-backs do not grow with the step count, and each σ handed to the model carries its value."""
    seen = []

    def denoise(xv, xa, sigma):
        seen.append((host_sigma.value_of(sigma), sigma))
        return xv * 0.5, xa * 0.5

    counts = []
    for steps in (2, 5):
        sig = scheduler_sigmas("simple", steps)
        with SyncSpy(monkeypatch) as spy:
            sample(denoise, torch.ones(1, 2, 1, 2, 2), torch.ones(1, 3, 2, 2), sig, sampler=sampler,
                   callback=lambda info: None)
        counts.append(len(spy.calls))
    assert counts[0] == counts[1], counts
    assert seen and all(v is not None and v == float(t.reshape(-1)[0]) for v, t in seen)


# ---- on a GPU (`pytest -m gpu`): the real synchronizations, the device's own float32 rounding ----------------------

def _cuda_syncs(fn) -> list[str]:
    """The synchronizing CUDA calls torch reports (sync debug mode) while fn() runs, each with the h3direct line
    that made it."""
    import warnings

    found: list[str] = []

    def note(message, category, filename, lineno, file=None, line=None):
        site = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(traceback.extract_stack()[:-1])
                     if "/h3direct/" in f.filename), "outside h3direct")
        found.append(f"{str(message).splitlines()[0][:90]} ({site})")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return found


@pytest.fixture(scope="module")
def cuda_setup():
    """The fixture model in bf16 on the GPU with its inputs there, the text tags on the device as the app hands
    them over."""
    model = load_dit(FIX / "h3_fx_bf16.safetensors", compute_dtype="bf16", device="cuda")
    inp = load_inputs(FIX / "inputs_fx_ref2va.safetensors")
    cond = conditioning_of(inp)
    cond = replace(cond, text_token_tags=torch.tensor([1, 1, 0, 0, 0, 1, 1, 1], device="cuda"),
                   refs=[{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in r.items()} for r in cond.refs])
    with torch.no_grad():
        ctx = model.preprocess_text(inp["text_states"].cuda())
    return model, ctx, cond, inp["video_noise"].cuda(), inp["audio_noise"].cuda()


@pytest.mark.gpu
def test_host_times_mirror_the_gpu_float32_ops():
    """The host mirror of σ -> (t_video, t_audio) for CUDA equals the GPU's own float32 ops, batched and per call."""
    sigmas = _sigma_cases()
    s = torch.tensor(sigmas, dtype=torch.float32, device="cuda")
    sv = ((s * 1000.0).float() / 1000.0).float().clamp(min=1e-6)
    tv, ta = (1.0 - sv).cpu().tolist(), (1.0 - audio_sigma(sv, 12.0, 3.0)).cpu().tolist()
    bad = [x for x, a, b in zip(sigmas, tv, ta, strict=True)
           if host_stream_times(x, shift_video=12.0, shift_audio=3.0, device_type="cuda") != (a, b)]
    assert not bad, f"{len(bad)} of {len(sigmas)} sigmas differ, e.g. {bad[:5]}"
    for x in sigmas[::97]:  # the per-call path (0-dim ops)
        v = sigma_from_timestep((torch.tensor([x], device="cuda").float() * 1000.0).float())
        want = (float(1.0 - v), float(1.0 - audio_sigma(v, 12.0, 3.0)))
        assert host_stream_times(x, shift_video=12.0, shift_audio=3.0, device_type="cuda") == want, x


@pytest.mark.gpu
def test_warm_step_on_cuda_makes_no_synchronizing_call(cuda_setup):
    model, ctx, cond, xv, xa = cuda_setup
    assert _cuda_syncs(lambda: torch.ones(1, device="cuda").item()), "the sync detector sees nothing"
    den = Denoiser(model, ctx, cond, SCALE)
    sigma = torch.tensor([0.8], device="cuda")
    with torch.no_grad():
        den(xv, xa, sigma)  # warm-up: reads σ once (remembered on the tensor), builds the invariants
        tagged = host_sigma.tag(torch.tensor([0.3]).cuda(), 0.3)
        torch.cuda.synchronize()
        warm = _cuda_syncs(lambda: (den(xv, xa, sigma), den(xv, xa, tagged)))
        uncached = _cuda_syncs(lambda: _uncached_x0(model, ctx, cond, xv, xa, torch.tensor([0.5], device="cuda")))
    assert warm == [], warm
    assert uncached, "the uncached path reads σ and the tags back: the detector must see it"


@pytest.mark.gpu
def test_cached_steps_on_cuda_bitwise_equal_uncached(cuda_setup):
    from h3direct.traces.metrics import bit_mismatch

    model, ctx, cond, xv, xa = cuda_setup
    den = Denoiser(model, ctx, cond, SCALE)
    with torch.no_grad():
        for s in (0.8, 0.3):
            got = den(xv, xa, host_sigma.tag(torch.tensor([s]).cuda(), s))
            want = _uncached_x0(model, ctx, cond, xv, xa, torch.tensor([s], device="cuda"))
            for g, w in zip(got, want, strict=True):
                assert (diff := bit_mismatch(g, w)) is None, f"sigma {s}: {diff}"
