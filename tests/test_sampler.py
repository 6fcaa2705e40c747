import math

import pytest
import torch

from h3direct.errors import H3Error
from h3direct.sampling import noise as hnoise
from h3direct.sampling import sampler as hs
from h3direct.sampling import schedules

try:
    import comfy_goldens as goldens
    from comfy_defs import load
except ImportError:  # rootdir-relative import
    from tests import comfy_goldens as goldens
    from tests.comfy_defs import load

SCHEDULES = [(sch, steps) for steps in (1, 4, 9) for sch in ("simple", "normal", "sgm_uniform")]
SAMPLER_RUNS = [(name, masked, cfg) for cfg in (1.0, 3.5) for masked in (False, True)
                for name in ("euler", "heun", "dpmpp_2m")]

VS, AS = (1, 24, 3, 4, 6), (1, 32, 2, 10)


def _fake_denoise(scale_v=0.7, scale_a=-0.4):
    """A fixed nonlinear "model" in sampler space, made only of exactly rounded operations (+, -, *, /, abs), so its
    bits are the same on every CPU: the committed ComfyUI goldens hold wherever CI runs. (torch's tanh, sin, exp go
    through vectorized math libraries whose last bit depends on the CPU.)"""
    def f(xv, xa, sigma):
        s = sigma.reshape(-1, *([1] * (xv.ndim - 1)))
        sa = sigma.reshape(-1, *([1] * (xa.ndim - 1)))
        return xv / (1 + xv.abs()) * scale_v * (1 - s), xa / (1 + xa * xa) * scale_a + 0.1 * sa
    return f


def test_simple_schedule_matches_flow_formula():
    # independent float64 math: sigma_k = s t / (1 + (s-1) t), t = (1000 - floor(k*1000/steps)) / 1000
    for steps in (1, 4, 7, 30):
        got = schedules.sigmas_for(steps, "simple")
        s = 12.0
        want = [s * t / (1 + (s - 1) * t) for t in ((1000 - int(k * 1000 / steps)) / 1000 for k in range(steps))] + [0.0]
        assert got.dtype == torch.float32 and len(got) == steps + 1
        assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-7)


def test_audio_scale_and_derived_audio_sigma():
    assert schedules.audio_scale(12.0, 3.0) == 4.0
    # the audio sigma re-applies the audio shift to the video sigma's unshifted time
    for t in (0.1, 0.5, 0.9):
        sv = 12 * t / (1 + 11 * t)
        assert math.isclose(schedules.audio_sigma(sv), 3 * t / (1 + 2 * t), rel_tol=1e-12)


def test_constant_target_flow_is_exact_and_uncarried():
    # x0 == c for every step: Euler on the flow path lands exactly on c; audio is handed back /4
    cv, ca = torch.randn(VS), torch.randn(AS)
    nz = hnoise.initial_noise(3, VS, AS)
    out = hs.sample(lambda xv, xa, s: (cv, ca * 4.0), nz.video, nz.audio, schedules.sigmas_for(5))
    assert torch.allclose(out.video, cv, atol=1e-5) and torch.allclose(out.audio, ca, atol=1e-5)


def test_mask_keeps_latent_exactly():
    lv, la = torch.randn(VS), torch.randn(AS)
    mv = torch.ones(1, 1, *VS[2:]); mv[:, :, 0] = 0
    ma = torch.ones(1, 1, *AS[2:]); ma[..., :3] = 0
    nz = hnoise.initial_noise(1, VS, AS)
    out = hs.sample(_fake_denoise(), nz.video, nz.audio, schedules.sigmas_for(3), latent_video=lv, latent_audio=la,
                    mask_video=mv, mask_audio=ma)
    # the last Euler step to sigma 0 lands on the model's x0, which the mask pins to the latent
    assert torch.allclose(out.video[:, :, 0], lv[:, :, 0], rtol=0, atol=1e-5)
    assert torch.allclose(out.audio[..., :3], la[..., :3], rtol=0, atol=1e-5)
    assert not torch.allclose(out.video[:, :, 1], lv[:, :, 1], atol=1e-2)


def test_bad_requests_are_one_line_errors():
    """cfg > 1 needs a negative; sampler and scheduler names are checked where a request names them (the one
    place: `app/request.py`), as choices (HTTP 422)."""
    from h3direct.app.request import GenerateRequest
    from h3direct.errors import RequestError

    nz = hnoise.initial_noise(0, VS, AS)
    with pytest.raises(H3Error):
        hs.sample(_fake_denoise(), nz.video, nz.audio, schedules.sigmas_for(2), cfg=3.0)
    for field, name in (("sampler", "nope"), ("scheduler", "karras_typo")):
        with pytest.raises(RequestError, match=f"{field} '{name}' is not supported") as e:
            GenerateRequest(**{field: name})
        assert e.value.kind == "choice"


def test_noise_is_the_seeded_generators_draws_in_stream_order():
    # ComfyUI prepare_noise: one generator seeded with the seed, video drawn first, then audio
    torch_state = torch.get_rng_state()
    g = torch.Generator().manual_seed(1234)
    v, a = torch.randn(VS, generator=g), torch.randn(AS, generator=g)
    nz = hnoise.initial_noise(1234, VS, AS)
    assert torch.equal(nz.video, v) and torch.equal(nz.audio, a)
    assert torch.equal(torch.get_rng_state(), torch_state)


# ---- against ComfyUI's own functions --------------------------------------------------------

def _comfy(root):
    ms = load(root, "comfy/model_sampling.py", ["reshape_sigma", "time_snr_shift", "CONST", "ModelSamplingDiscreteFlow", "ModelSamplingAV"])
    kutils = load(root, "comfy/k_diffusion/utils.py", ["append_dims"])
    ks = load(root, "comfy/k_diffusion/sampling.py", ["to_d", "sample_euler", "sample_heun", "sample_dpmpp_2m"],
              utils=kutils, trange=lambda n, disable=None: range(n))
    sm = load(root, "comfy/samplers.py", ["simple_scheduler", "normal_scheduler", "KSamplerX0Inpaint", "cfg_function"])
    ut = load(root, "comfy/utils.py", ["pack_latents", "unpack_latents"])
    return ms, ks, sm, ut


def _comfy_model_sampling(ms):
    class Cfg:
        sampling_settings = {"shift": 12.0, "audio_shift": 3.0}

    class MS(ms.ModelSamplingAV, ms.CONST):
        pass
    return MS(Cfg())


@pytest.mark.comfy
@pytest.mark.parametrize("scheduler", ["simple", "normal", "sgm_uniform"])
@pytest.mark.parametrize("steps", [1, 4, 9])
def test_schedule_bitwise_vs_comfy(scheduler, steps, ndarrays_regression, comfy_root):
    ms, _, sm, _ = _comfy(comfy_root)
    m = _comfy_model_sampling(ms)
    ref = {"simple": lambda: sm.simple_scheduler(m, steps), "normal": lambda: sm.normal_scheduler(m, steps),
           "sgm_uniform": lambda: sm.normal_scheduler(m, steps, sgm=True)}[scheduler]()
    goldens.record(ndarrays_regression, f"schedule_{scheduler}_{steps}", {"sigmas": ref})
    assert torch.equal(schedules.sigmas_for(steps, scheduler), ref)


@pytest.mark.parametrize("scheduler,steps", SCHEDULES)
def test_schedule_bitwise_vs_comfy_golden(scheduler, steps):
    ref = goldens.load(f"schedule_{scheduler}_{steps}")["sigmas"]
    assert torch.equal(schedules.sigmas_for(steps, scheduler), ref)


@pytest.mark.comfy
def test_denoise_fraction_vs_comfy(ndarrays_regression, comfy_root):
    ms, _, sm, _ = _comfy(comfy_root)
    m = _comfy_model_sampling(ms)
    full = sm.simple_scheduler(m, int(4 / 0.6))
    goldens.record(ndarrays_regression, "schedule_simple_4_denoise0.6", {"sigmas": full[-5:]})
    assert torch.equal(schedules.sigmas_for(4, "simple", denoise=0.6), full[-5:])


def test_denoise_fraction_vs_comfy_golden():
    ref = goldens.load("schedule_simple_4_denoise0.6")["sigmas"]
    assert torch.equal(schedules.sigmas_for(4, "simple", denoise=0.6), ref)


def _comfy_run(root, name, denoise_pos, denoise_neg, cfg, noise_v, noise_a, lat_v, lat_a, mask_v, mask_a, sigmas):
    """ComfyUI's sampling path (CFGGuider.inner_sample → KSAMPLER.sample) from its own functions."""
    ms, ks, sm, ut = _comfy(root)
    m = _comfy_model_sampling(ms)
    latent, shapes = ut.pack_latents([lat_v, lat_a])
    noise, _ = ut.pack_latents([noise_v, noise_a])
    n = math.prod(shapes[0][1:])
    if torch.count_nonzero(latent) > 0:  # process_latent_in (latent_format scale 1.0) + audio carry
        latent = latent.clone()
        latent[..., n:] *= m.audio_scale
    mask = None
    if mask_v is not None:
        mask, _ = ut.pack_latents([mask_v.expand(shapes[0]), mask_a.expand(shapes[1])])
        mask = mask.float()

    def predict(x, sigma, **kw):
        xv, xa = ut.unpack_latents(x, shapes)
        pos, _ = ut.pack_latents(list(denoise_pos(xv, xa, sigma)))
        if math.isclose(cfg, 1.0):
            neg = torch.zeros_like(x)
        else:
            neg, _ = ut.pack_latents(list(denoise_neg(xv, xa, sigma)))
        return sm.cfg_function(None, pos, neg, cfg, x, sigma)

    class Inner:  # what KSamplerX0Inpaint calls: model_wrap(x, sigma) and .inner_model.scale_latent_inpaint
        class inner_model:
            @staticmethod
            def scale_latent_inpaint(x, sigma, noise, latent_image):
                return m.noise_scaling(sigma.reshape([sigma.shape[0]] + [1] * (len(noise.shape) - 1)), noise, latent_image)

        def __call__(self, x, sigma, model_options=None, seed=None):
            return predict(x, sigma)

    mk = sm.KSamplerX0Inpaint(Inner(), sigmas)
    mk.latent_image, mk.noise = latent, noise
    x = m.noise_scaling(sigmas[0], noise, latent)
    fn = getattr(ks, "sample_" + name)
    x = fn(mk, x, sigmas, extra_args={"denoise_mask": mask}, callback=None, disable=True)
    x = m.inverse_noise_scaling(sigmas[-1], x).to(torch.float32)
    x = x.clone()
    x[..., n:] *= 1.0 / m.audio_scale
    return ut.unpack_latents(x, shapes)


def _run_inputs(masked):
    g = torch.Generator().manual_seed(11)
    nz = hnoise.initial_noise(7, VS, AS)
    lv, la = (torch.randn(VS, generator=g), torch.randn(AS, generator=g)) if masked else (torch.zeros(VS), torch.zeros(AS))
    mv = ma = None
    if masked:
        mv = torch.ones(1, 1, *VS[2:]); mv[:, :, 0] = 0
        ma = torch.ones(1, 1, *AS[2:]); ma[..., :4] = 0
    return nz.video, nz.audio, lv, la, mv, ma, schedules.sigmas_for(4)


def _h3_run(name, masked, cfg, nv, na, lv, la, mv, ma, sig):
    seen = []
    out = hs.sample(_fake_denoise(), nv, na, sig, latent_video=lv if masked else None,
                    latent_audio=la if masked else None, sampler=name, cfg=cfg,
                    denoise_negative=_fake_denoise(0.3, 0.2), mask_video=mv, mask_audio=ma, callback=seen.append)
    assert [s.index for s in seen] == [0, 1, 2, 3] and seen[0].sigma == float(sig[0])
    return out


@pytest.mark.comfy
@pytest.mark.parametrize("name", ["euler", "heun", "dpmpp_2m"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
@pytest.mark.parametrize("cfg", [1.0, 3.5])
def test_sampling_bitwise_vs_comfy(name, masked, cfg, ndarrays_regression, comfy_root):
    nv, na, lv, la, mv, ma, sig = _run_inputs(masked)
    pos, neg = _fake_denoise(), _fake_denoise(0.3, 0.2)
    ref_v, ref_a = _comfy_run(comfy_root, name, pos, neg, cfg, nv, na, lv, la, mv, ma, sig)
    arrays = {"noise_video": nv, "noise_audio": na, "latent_video": lv, "latent_audio": la, "sigmas": sig,
              "out_video": ref_v, "out_audio": ref_a}
    if masked:
        arrays.update(mask_video=mv, mask_audio=ma)
    goldens.record(ndarrays_regression, f"sample_{name}_{'mask' if masked else 'nomask'}_cfg{cfg:g}", arrays)
    out = _h3_run(name, masked, cfg, nv, na, lv, la, mv, ma, sig)
    assert torch.equal(out.video, ref_v) and torch.equal(out.audio, ref_a)


@pytest.mark.parametrize("name,masked,cfg", SAMPLER_RUNS)
def test_sampling_bitwise_vs_comfy_golden(name, masked, cfg):
    """ComfyUI's KSAMPLER run (sampler, cfg with a negative, denoise mask) on the recorded inputs, reproduced to the bit."""
    g = goldens.load(f"sample_{name}_{'mask' if masked else 'nomask'}_cfg{cfg:g}")
    out = _h3_run(name, masked, cfg, g["noise_video"], g["noise_audio"], g["latent_video"], g["latent_audio"],
                  g.get("mask_video"), g.get("mask_audio"), g["sigmas"])
    assert torch.equal(out.video, g["out_video"]) and torch.equal(out.audio, g["out_audio"])


@pytest.mark.comfy
def test_noise_bitwise_vs_comfy_prepare_noise(ndarrays_regression, comfy_root):
    nt = load(comfy_root, "comfy/nested_tensor.py", ["NestedTensor"])
    sp = load(comfy_root, "comfy/sample.py", ["prepare_noise_inner", "prepare_noise"],
              comfy=type("C", (), {"nested_tensor": nt})())
    latent = nt.NestedTensor([torch.zeros(VS), torch.zeros(AS)])
    ref = sp.prepare_noise(latent, 42).unbind()
    goldens.record(ndarrays_regression, "prepare_noise_seed42", {"video": ref[0], "audio": ref[1]})
    got = hnoise.initial_noise(42, VS, AS)
    assert torch.equal(got.video, ref[0]) and torch.equal(got.audio, ref[1])


def test_noise_bitwise_vs_comfy_prepare_noise_golden():
    ref = goldens.load("prepare_noise_seed42")
    got = hnoise.initial_noise(42, VS, AS)
    assert torch.equal(got.video, ref["video"]) and torch.equal(got.audio, ref["audio"])


@pytest.mark.parametrize("manifest, words", [
    ({"steps": 2, "sampler": "ddim"}, "sampler 'ddim': not one of euler"),
    ({"steps": 2, "scheduler": "karras"}, "scheduler 'karras': not one of simple"),
    ({"steps": 0}, "steps 0: at least 1"),
    ({}, "trace manifest: 'steps' is missing"),
    ({"steps": "two"}, "trace manifest: invalid literal for int"),
    ({"steps": 2, "cache": {"mode": "easycache"}}, "trace manifest: 'threshold' is missing"),
    ({"steps": 2, "cache": {"mode": "fastcache", "threshold": 0.2, "start_percent": 0.1, "end_percent": 0.9}},
     "cache_mode 'fastcache': not one of"),
])
def test_a_trace_manifests_sampling_settings_are_checked_before_anything_runs(manifest, words):
    """A generation trace's manifest is a file: a name the sampler does not know, a missing or malformed field, is one
    line, not a KeyError or ValueError traceback."""
    from h3direct.errors import H3Error
    from h3direct.traces.evaluate import short_generation

    with pytest.raises(H3Error, match=words):
        short_generation(None, None, manifest)  # no model, no inputs: the check comes first


def test_cache_settings_refuse_an_unknown_mode():
    from h3direct.errors import RequestError
    from h3direct.sampling.rules import CacheSettings

    with pytest.raises(RequestError, match="cache_mode 'fastcache': not one of off, easycache, h3_cache"):
        CacheSettings(mode="fastcache")
