"""End-to-end parity (issue 7): h3direct's sampler + denoiser over a short generation against ComfyUI's, step by step.

A generation trace is what `python -m oracle record-generate` writes (manifest `kind: generate`); its checkpoint and
inputs file lie beside it. h3direct runs `h3direct.sampling.sampler.sample` with `h3direct.dit.denoiser.Denoiser`
on the same
inputs (noise, latents, conditioning, mask), the same sampler / scheduler / shift / steps, and every recorded tensor
(`sampler.sigmas`, `sampler.step{i}.x.*`, `sampler.step{i}.denoised.*`, `sample_out.*`) is compared under the budget
of mode "e2e" in budgets.toml.
"""

from __future__ import annotations

import math

import pytest
import torch

from h3direct.traces import metrics
from h3direct.traces.budgets import verdict
from h3direct.traces.discovery import GenerateCase, find_generate_cases  # noqa: F401 (re-exported)
from parity_tests.gate import CaseResult, LayerResult

pytestmark = pytest.mark.parity


def E2EResult(case: GenerateCase, attention: str) -> CaseResult:  # noqa: N802 (a CaseResult for a generation)
    return CaseResult(case, "e2e", attention, title=f"{case.id} [e2e, {case.compute}, {case.weights}, {attention}]",
                      unit="tensor", action="reproduce")


def run_e2e_case(case: GenerateCase, *, attention: str, budgets, device: str = "cpu", trace=None) -> CaseResult:
    """`trace`: an in-memory ComfyUI trace to compare with instead of the file (sensitivity tests)."""
    from h3direct.dit.denoiser import Denoiser, audio_scale_of
    from h3direct.sampling.sampler import sample
    from h3direct.sampling.schedules import sigmas_for
    from h3direct.traces.evaluate import conditioning_of, expand_mask
    from h3direct.traces.format import load_trace
    from h3direct.traces.inputs import load_inputs
    from parity_tests.gate import _model

    m = case.manifest
    trace = trace or load_trace(case.trace)
    model = _model(str(case.checkpoint), case.compute, case.weights.split("_")[-1] if "nvfp4" in case.weights
                   else "w4a16", device)
    inputs = load_inputs(case.inputs)
    scale = audio_scale_of(model)
    shift = float(m.get("sampling", {}).get("shift", 12.0))
    sigmas = sigmas_for(int(m["steps"]), str(m.get("scheduler", "simple")), shift=shift).to(device)
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
        context = model.preprocess_text(inputs["text_states"].to(device), backend=attention)
        denoiser = Denoiser(model, context, conditioning_of(inputs), scale, backend=attention)
        step_cache = None
        if m.get("cache"):  # ComfyUI ran with its EasyCache node: run h3direct's cache with the same settings
            from h3direct.sampling.caches import CacheSettings, with_cache

            c = m["cache"]
            settings = CacheSettings(mode=c["mode"], threshold=float(c["threshold"]),
                                     start_percent=float(c["start_percent"]), end_percent=float(c["end_percent"]),
                                     subsample_factor=int(c.get("subsample_factor", 8)))
            denoiser, _, step_cache = with_cache(denoiser, settings, shift)
        noise_v, noise_a = inputs["video_noise"].float().to(device), inputs["audio_noise"].float().to(device)
        out = sample(denoiser, noise_v, noise_a, sigmas,
                     latent_video=lat_v, latent_audio=lat_a, sampler=str(m.get("sampler", "euler")),
                     audio_scale=scale, callback=on_step, **masks)
    ours["sample_out.video"], ours["sample_out.audio"] = out.video, out.audio
    if step_cache is not None:
        reused = set(step_cache.reused_steps(sigmas.cpu()))
        ours["cache.evaluated"] = torch.tensor([int(i not in reused) for i in range(len(sigmas) - 1)])

    result = E2EResult(case, attention)
    b = budgets.lookup(mode="e2e", kind="*", compute=case.compute, weights=case.weights, attention=attention)
    redo = (f"python -m oracle record-generate --checkpoint {case.checkpoint} --inputs {case.inputs} "
            f"--steps {m['steps']} --out /tmp/gen.safetensors  # then compare with {case.trace}")
    for name in trace.names_in_order():
        ref = trace.get(name)
        mine = ours.get(name)
        if mine is None or tuple(mine.shape) != tuple(ref.shape):
            nan = metrics.MaxAbs(math.inf, (), math.nan, math.nan)
            why = "not produced by h3direct" if mine is None else f"shape {tuple(mine.shape)} != {tuple(ref.shape)}"
            result.layers.append(LayerResult(name, "step", "e2e", math.inf, -math.inf, nan, False, why, "", redo))
            continue
        mine = mine.detach().float().cpu()
        rel, sq = metrics.rel_l2(mine, ref), metrics.sqnr_db(mine, ref)
        ok, rule = verdict(b, rel=rel, sqnr=sq, identical=torch.equal(mine, ref.float()))
        result.layers.append(LayerResult(name, "step", "e2e", rel, sq, metrics.max_abs(mine, ref), ok, rule,
                                         b.provenance, redo))
    return result


def test_e2e_per_step_latents(gen_case, gate_options, report):
    result = run_e2e_case(gen_case, attention=gate_options["attention"], budgets=gate_options["budgets"],
                          device=gate_options["device"])
    report.add_case(result)
    steps = int(gen_case.manifest["steps"])
    assert sum(r.name.startswith("sampler.step") for r in result.layers) == 4 * steps, "per-step latents missing"
    assert result.passed, result.report()


def test_e2e_gate_catches_a_perturbed_step(gen_case, gate_options):
    """A 1e-3 relative error in one recorded mid-run step makes the e2e gate fail there."""
    from h3direct.traces.format import Trace, load_trace

    name = f"sampler.step{int(gen_case.manifest['steps']) // 2}.denoised.video"
    trace = load_trace(gen_case.trace)
    tensors = dict(trace.tensors)
    tensors[name] = tensors[name] * 1.001
    result = run_e2e_case(gen_case, attention=gate_options["attention"], budgets=gate_options["budgets"],
                          device=gate_options["device"], trace=Trace(trace.path, tensors, trace.manifest, trace.stored))
    assert result.first_failure is not None and result.first_failure.name == name, result.report()


def test_easycache_runs_reproduce_comfyui_decisions(gate_options):
    """ComfyUI's EasyCache node (fixtures/trace_gen_*_easycache*): h3direct's `easycache` reuses exactly the steps
    ComfyUI reused and reproduces every step; a flipped decision in the record is caught at `cache.evaluated`."""
    from h3direct.traces.discovery import FIXTURES
    from h3direct.traces.format import Trace, load_trace

    cases = [c for c in find_generate_cases([FIXTURES])[0] if c.manifest.get("cache")]
    assert len(cases) >= 2, "the EasyCache fixture traces are missing"
    for case in cases:
        trace = load_trace(case.trace)
        evaluated = trace.get("cache.evaluated")
        assert 0 < int(evaluated.sum()) < len(evaluated), f"{case.id}: ComfyUI reused no step (or every step)"
        result = run_e2e_case(case, attention="sdpa", budgets=gate_options["budgets"])
        assert result.passed, result.report()
        assert any(r.name == "cache.evaluated" and r.passed for r in result.layers)
        flipped = evaluated.clone()
        i = int((evaluated == 0).nonzero()[0])
        flipped[i] = 1
        tensors = dict(trace.tensors)
        tensors["cache.evaluated"] = flipped
        bad = run_e2e_case(case, attention="sdpa", budgets=gate_options["budgets"],
                           trace=Trace(trace.path, tensors, trace.manifest, trace.stored))
        assert any(r.name == "cache.evaluated" and not r.passed for r in bad.layers), bad.report()
