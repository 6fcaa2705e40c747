"""One denoiser evaluation from an inputs file, as the oracle traces record it.

ComfyUI path reproduced (see ../shared/oracle/README.md "What one trace is"): packed sampler latent with
the audio carried ×audio_scale (`process_latent_in`), x = σ·noise + (1 − σ)·latent_image, an optional
denoise mask (KSamplerX0Inpaint: x·m + noise_scaling(σ, noise, latent)·(1 − m) in, out·m + latent·(1 − m)
out), one model call, x0 = x − out·σ, and `sample_out` = x0 with the audio un-carried.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from h3direct.dit.denoiser import Denoiser, audio_scale_of
from h3direct.dit.model import Conditioning, H3DiT
from h3direct.dit.options import DEFAULT_BACKEND, Options, options_of
from h3direct.traces.inputs import H3Inputs


def conditioning_of(inputs: H3Inputs) -> Conditioning:
    tags = inputs.tensors.get(inputs.meta.get("token_tags", "token_tags"))
    return Conditioning(text_token_tags=tags, keyframes=inputs.keyframes, refs=inputs.refs, seed=inputs.seed)


def expand_mask(mask: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A [1, 1, …] mask resized to a latent's spatial size and repeated over channels (ComfyUI reshape_mask)."""
    dims = len(shape) - 2
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[dims]
    if dims == 2:
        mask = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1])
    elif dims == 3 and mask.ndim < 5:
        mask = mask.reshape(1, 1, -1, mask.shape[-2], mask.shape[-1])
    mask = F.interpolate(mask.float(), size=tuple(shape[2:]), mode=mode)
    if mask.shape[1] < shape[1]:
        mask = mask.repeat((1, shape[1]) + (1,) * dims)[:, : shape[1]]
    return mask


def one_step(model: H3DiT, inputs: H3Inputs, *, backend: str | Options = DEFAULT_BACKEND,
             device="cpu") -> dict[str, torch.Tensor]:
    """Returns {name: tensor} for the sampler-level records; the model's tracer (if any) gets the rest.
    `backend`: an attention backend's name (every option at its default) or the run's `Options`."""
    record = model._record
    scale = audio_scale_of(model)
    options = options_of(backend)
    text = inputs["text_states"].to(device)
    context = model.preprocess_text(text, options=options)
    cond = conditioning_of(inputs)
    denoiser = Denoiser(model, context, cond, scale, options=options)

    sigma = torch.tensor([inputs.sigma], dtype=torch.float32)
    if "sigma" in inputs.tensors:
        sigma = inputs["sigma"].reshape(-1)[:1].float()
    sigma = sigma.to(device)
    lat_v = inputs["video_latent"].float().to(device)
    lat_a = inputs["audio_latent"].float().to(device) * scale  # process_latent_in carries the audio
    noise_v, noise_a = inputs["video_noise"].float().to(device), inputs["audio_noise"].float().to(device)
    x_v = sigma * noise_v + (1.0 - sigma) * lat_v
    x_a = sigma * noise_a + (1.0 - sigma) * lat_a
    record("sampler.x_in.video", x_v)
    record("sampler.x_in.audio", x_a)

    masks = None
    if inputs.denoise_mask:
        masks = (expand_mask(inputs.denoise_mask["video"].to(device), lat_v.shape),
                 expand_mask(inputs.denoise_mask["audio"].to(device), lat_a.shape))
        x_v = x_v * masks[0] + (sigma * noise_v + (1.0 - sigma) * lat_v) * (1.0 - masks[0])
        x_a = x_a * masks[1] + (sigma * noise_a + (1.0 - sigma) * lat_a) * (1.0 - masks[1])
    x0_v, x0_a = denoiser(x_v, x_a, sigma)
    if masks is not None:
        x0_v = x0_v * masks[0] + lat_v * (1.0 - masks[0])
        x0_a = x0_a * masks[1] + lat_a * (1.0 - masks[1])
    record("sampler.denoised.video", x0_v)
    record("sampler.denoised.audio", x0_a)
    out = {"sampler.denoised.video": x0_v, "sampler.denoised.audio": x0_a,
           "sample_out.video": x0_v, "sample_out.audio": x0_a / scale}
    record("sample_out.video", out["sample_out.video"])
    record("sample_out.audio", out["sample_out.audio"])
    return out


def traced_step(model: H3DiT, inputs: H3Inputs, *, backend: str | Options = DEFAULT_BACKEND,
                device="cpu") -> dict[str, torch.Tensor]:
    """One denoiser evaluation (`one_step`) traced: {recorded name: tensor} of every tensor the model's tracer
    records (on the CPU) and the sampler-level ones. What a free-running row of the gate compares, and what `oracle
    replay --mode free` re-runs for it."""
    from h3direct.dit.tracing import Tracer

    with torch.no_grad(), Tracer(model) as tracer:
        out = one_step(model, inputs, backend=backend, device=device)
    return {**tracer.tensors, **out}


def _manifest_sampling(m: dict):
    """(sampler, scheduler, steps, shift, cache settings or None) of a generation trace's manifest, each checked by
    the rules a request's fields follow; a missing or malformed field is a one-line H3Error."""
    from h3direct.errors import H3Error
    from h3direct.sampling.rules import CacheSettings, check_sampling

    try:
        sampler, scheduler, steps = str(m.get("sampler", "euler")), str(m.get("scheduler", "simple")), int(m["steps"])
        shift = float(m.get("sampling", {}).get("shift", 12.0))
        c = m.get("cache")
        cache = CacheSettings(mode=c["mode"], threshold=float(c["threshold"]), start_percent=float(c["start_percent"]),
                              end_percent=float(c["end_percent"]),
                              subsample_factor=int(c.get("subsample_factor", 8))) if c else None
    except KeyError as exc:
        raise H3Error(f"trace manifest: {exc} is missing") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise H3Error(f"trace manifest: {exc}") from None
    check_sampling(sampler, scheduler, steps)
    return sampler, scheduler, steps, shift, cache


def short_generation(model: H3DiT, inputs: H3Inputs, manifest: dict, *, backend: str | Options = DEFAULT_BACKEND,
                     device="cpu") -> dict[str, torch.Tensor]:
    """The generation a `kind: generate` trace records (`python -m oracle record-generate`), run by h3direct's
    sampler and denoiser on the same inputs, sampler, scheduler, shift, steps and step cache: {name: tensor} under
    the trace's names (`sampler.sigmas`, `sampler.step{i}.x.*`, `sampler.step{i}.denoised.*`, `sample_out.*`,
    `cache.evaluated`)."""
    from h3direct.sampling.sampler import sample
    from h3direct.sampling.schedules import sigmas_for

    sampler, scheduler, steps, shift, cache = _manifest_sampling(manifest)  # a bad manifest is one line, first
    scale = audio_scale_of(model)
    sigmas = sigmas_for(steps, scheduler, shift=shift).to(device)
    ours: dict[str, torch.Tensor] = {"sampler.sigmas": sigmas}

    def on_step(s) -> None:
        ours.update({f"sampler.step{s.index}.x.video": s.x_video, f"sampler.step{s.index}.x.audio": s.x_audio,
                     f"sampler.step{s.index}.denoised.video": s.x0_video,
                     f"sampler.step{s.index}.denoised.audio": s.x0_audio})

    lat_v, lat_a = inputs["video_latent"].float().to(device), inputs["audio_latent"].float().to(device)
    masks = {}
    if inputs.denoise_mask:
        masks = {"mask_video": expand_mask(inputs.denoise_mask["video"].to(device), tuple(lat_v.shape)),
                 "mask_audio": expand_mask(inputs.denoise_mask["audio"].to(device), tuple(lat_a.shape))}
    with torch.no_grad():
        options = options_of(backend)
        context = model.preprocess_text(inputs["text_states"].to(device), options=options)
        denoiser = Denoiser(model, context, conditioning_of(inputs), scale, options=options)
        step_cache = None
        if cache is not None:  # ComfyUI ran with its EasyCache node: h3direct's cache with the same settings
            from h3direct.sampling.caches import with_cache

            denoiser, _, step_cache = with_cache(denoiser, cache, shift)
        noise_v, noise_a = inputs["video_noise"].float().to(device), inputs["audio_noise"].float().to(device)
        out = sample(denoiser, noise_v, noise_a, sigmas, latent_video=lat_v, latent_audio=lat_a,
                     sampler=sampler, audio_scale=scale, callback=on_step, **masks)
    ours["sample_out.video"], ours["sample_out.audio"] = out.video, out.audio
    if step_cache is not None:
        reused = set(step_cache.reused_steps(sigmas.cpu()))
        ours["cache.evaluated"] = torch.tensor([int(i not in reused) for i in range(len(sigmas) - 1)])
    return ours
