"""H3Pipeline wiring on the bundled tiny models: seeds, tasks, caches, and a hand-composed sampling loop.

The reference loop below is written from the facts, not from our sampler: ComfyUI draws the initial noise
with one CPU generator seeded with the seed (video then audio, float32 N(0,1)), samples on the flow schedule
sigma(t) = s·t / (1 + (s − 1)·t) (s = 12, 'simple' picks t = 1 − floor(k·1000/steps)/1000), Euler steps
x ← x + (x − x0)/σ · (σ_next − σ) in the space where audio is carried ×(12/3), and un-carries audio at the end.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from h3direct.app import bundled
from h3direct.errors import H3Error
from h3direct.sampling.caches import CacheSettings
from parity_tests.discovery import SHARED_ORACLE

W, H, FRAMES = 96, 64, 5
# the reference loop computes its sigmas in float64 and rounds once; ComfyUI's (and our) float32 table may
# differ by an ulp per sigma, which moves the latents by ~1e-7 relative. Not a parity budget: a wiring check.
WIRING_RTOL = 1e-5


@pytest.fixture(scope="session")
def bundle_dir(cache_env):
    return bundled.ensure().root


@pytest.fixture(scope="session")
def pipe(bundle_dir):
    from h3direct.app.pipeline import H3Pipeline

    b = bundled.ensure(bundle_dir)
    return H3Pipeline.from_files(b.dit, b.video_vae, b.audio_vae, b.text_encoder, tokenizer=b.tokenizer,
                                 video_vae_config=b.video_vae_config, audio_vae_config=b.audio_vae_config,
                                 device="cpu")


def _gen(pipe, **kw):
    from h3direct.app.request import GenerateRequest

    args = dict(width=W, height=H, frames=FRAMES, steps=2, seed=0, prompt="a red ball")
    args.update(kw)
    run = {k: args.pop(k) for k in ("decode", "callback") if k in args}
    cache = args.pop("cache", None)
    if cache is not None:
        args.update(cache_mode=cache.mode, cache_threshold=cache.threshold, cache_start_percent=cache.start_percent,
                    cache_end_percent=cache.end_percent, cache_subsample_factor=cache.subsample_factor)
    return pipe.generate(GenerateRequest(**args), decode=run.get("decode", False), callback=run.get("callback"))


def _rel(a, b):
    return float((a - b).norm() / b.norm())


# ---- the bundle ----------------------------------------------------------------------------------

def test_bundle_complete_and_reused(bundle_dir):
    b = bundled.ensure(bundle_dir)
    assert bundled.is_complete(b.root)
    stamp = {p: p.stat().st_mtime_ns for p in b.root.iterdir()}
    b2 = bundled.ensure(bundle_dir)  # second use: nothing rewritten
    assert b2 == b and {p: p.stat().st_mtime_ns for p in b.root.iterdir()} == stamp
    assert not [p for p in b.root.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind


def test_bundled_sizes_are_consistent(pipe):
    # the tiny text encoder's hidden size must be the tiny DiT's text_dim
    assert pipe.text_encoder.model.config.hidden_size == pipe.dit.config.text_dim
    assert pipe.video_vae.cfg.embed_dim == pipe.dit.config.latents_dim
    assert pipe.audio_vae.cfg.vae_latent_channels == pipe.dit.config.audio_latents_dim


@pytest.mark.shared
@pytest.mark.parametrize("name,oracle", [("dit", "h3_tiny_bf16.safetensors"),
                                         ("video_vae", "vae_video_tiny.safetensors")])
def test_bundled_models_are_the_oracle_files(bundle_dir, name, oracle):
    """Seed 0 of the recipes reproduces the checkpoints ComfyUI was traced with (so parity traces apply)."""
    ref = SHARED_ORACLE / oracle
    got, want = load_file(str(bundle_dir / bundled.FILES[name])), load_file(str(ref))
    assert set(got) == set(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"{len(bad)} tensors differ, first {bad[:3]}"


# ---- wiring --------------------------------------------------------------------------------------

def _ref_sigmas(steps, shift=12.0):
    ts = [(1000 - int(k * 1000 / steps)) / 1000 for k in range(steps)]
    return [shift * t / (1 + (shift - 1) * t) for t in ts] + [0.0]


def _reference_loop(pipe, text, cond_refs, seed, steps, video_shape, audio_shape):
    from h3direct.dit.denoiser import Denoiser
    from h3direct.dit.model import Conditioning

    model = pipe.dit
    ctx = model.preprocess_text(text.states)
    den = Denoiser(model, ctx, Conditioning(text_token_tags=text.tags, refs=cond_refs, seed=seed), 12.0 / 3.0)
    g = torch.Generator("cpu").manual_seed(seed)
    xv = torch.randn(video_shape, generator=g)
    xa = torch.randn(audio_shape, generator=g)  # noise is not carried; the zero latent adds nothing
    sig = _ref_sigmas(steps)
    xv, xa = sig[0] * xv, sig[0] * xa
    for s, s_next in zip(sig[:-1], sig[1:], strict=True):
        st = torch.tensor([s], dtype=torch.float32)
        x0v, x0a = den(xv, xa, st)
        xv = xv + (xv - x0v) / st * (s_next - s)
        xa = xa + (xa - x0a) / st * (s_next - s)
    return xv, xa / 4.0


@pytest.mark.parametrize("task", ["t2va", "ref2va"])
def test_two_step_latents_match_hand_composed_loop(pipe, task):
    refs = [torch.rand(1, 80, 112, 3, generator=torch.Generator().manual_seed(5))] if task == "ref2va" else []
    seed = 7
    with torch.inference_mode():
        res = _gen(pipe, seed=seed, ref_images=refs)
        assert res.task == task
        cond = pipe.build_conditioning(W, H, FRAMES, ref_images=refs)
        text = pipe.text_states("a red ball", cond.presentation)
        want_v, want_a = _reference_loop(pipe, text, cond.comfy_fields().get("minimax_refs", []), seed, 2,
                                         cond.video_shape, cond.audio_shape)
    assert res.video_latent.shape == (1, 24, 2, H // 16, W // 16) and res.audio_latent.shape == (1, 32, 2, 8)
    assert _rel(res.video_latent, want_v) < WIRING_RTOL and _rel(res.audio_latent, want_a) < WIRING_RTOL
    # the check can fail: a different payload seed (visual cond augmentation) or no ref is visible
    if task == "ref2va":
        with torch.inference_mode():
            other_v, _ = _reference_loop(pipe, text, cond.comfy_fields()["minimax_refs"], seed + 1, 2,
                                         cond.video_shape, cond.audio_shape)
        assert _rel(res.video_latent, other_v) > 100 * WIRING_RTOL


def test_initial_noise_is_comfy_seeded_draw(pipe):
    seen = []
    _gen(pipe, seed=123, steps=1, callback=seen.append)
    g = torch.Generator("cpu").manual_seed(123)
    nv, na = torch.randn(1, 24, 2, 4, 6, generator=g), torch.randn(1, 32, 2, 8, generator=g)
    ev = seen[0]
    assert ev.index == 0 and ev.total == 1 and ev.sigma == 1.0 and ev.seconds >= 0
    assert torch.equal(ev.info.x_video, nv) and torch.equal(ev.info.x_audio, na)  # σ0 = 1: x_T is the noise


def test_same_seed_same_latents_other_seed_differs(pipe):
    a, b, c = _gen(pipe, seed=1), _gen(pipe, seed=1), _gen(pipe, seed=2)
    assert torch.equal(a.video_latent, b.video_latent) and torch.equal(a.audio_latent, b.audio_latent)
    assert not torch.equal(a.video_latent, c.video_latent) and not torch.equal(a.audio_latent, c.audio_latent)


def test_text_embeds_equal_encoding_the_prompt(pipe):
    from h3direct.text.presentation import TextConditioning

    text = pipe.text_states("a red ball")
    a = _gen(pipe, text_embeds=TextConditioning(text.states.clone(), text.tags.clone()))
    b = _gen(pipe)
    assert torch.equal(a.video_latent, b.video_latent)
    c = _gen(pipe, prompt="a blue cube")
    assert not torch.equal(c.video_latent, b.video_latent)


def test_tasks_chosen_by_references(pipe):
    img = torch.rand(1, 64, 96, 3, generator=torch.Generator().manual_seed(1))
    t2va = _gen(pipe, steps=1)
    fl2va = _gen(pipe, steps=1, first_frame=img)
    ref2va = _gen(pipe, steps=1, ref_images=[img])
    assert (t2va.task, fl2va.task, ref2va.task) == ("t2va", "fl2va", "ref2va")
    assert not torch.equal(t2va.video_latent, fl2va.video_latent)
    assert not torch.equal(t2va.video_latent, ref2va.video_latent)
    with pytest.raises(H3Error, match="separate tasks"):
        _gen(pipe, first_frame=img, ref_images=[img])


def test_cache_off_is_bitwise_no_cache_and_easycache_reuses(pipe):
    plain = _gen(pipe, steps=6)
    off = _gen(pipe, steps=6, cache=CacheSettings("off"))
    assert torch.equal(plain.video_latent, off.video_latent) and torch.equal(plain.audio_latent, off.audio_latent)
    assert off.reused_steps == []
    # a huge threshold reuses every step the cache may skip (k needs two evaluations first)
    loose = _gen(pipe, steps=6, cache=CacheSettings("easycache", threshold=1e9))
    assert loose.reused_steps and min(loose.reused_steps) >= 2
    assert not torch.equal(loose.video_latent, plain.video_latent)


def test_decoded_outputs(pipe):
    res = _gen(pipe, steps=1, frames=22, decode=True)
    assert res.frames.dtype == np.uint8 and res.frames.shape == (22, H, W, 3)
    assert res.audio.dtype == np.float32 and res.audio.shape == (37 * 800, 2)  # round(22/24·40) latent frames
    assert res.sample_rate == 32000 and res.fps == 24 and res.frame_count == 22
    assert {"conditioning", "text_encode", "sample", "decode_video", "decode_audio"} <= set(res.timings)


def test_request_errors(pipe):
    for kw, msg in ((dict(width=100), "multiple of 32"), (dict(frames=4), "at least 5"),
                    (dict(steps=0), "at least 1"), (dict(sampler="ddim"), "not supported"),
                    (dict(scheduler="karras"), "not supported")):
        with pytest.raises(H3Error, match=msg):
            _gen(pipe, **kw)
    from h3direct.text.presentation import TextConditioning

    with pytest.raises(H3Error, match="text_dim"):
        _gen(pipe, text_embeds=TextConditioning(torch.zeros(1, 4, 50), torch.ones(4, dtype=torch.long)))
