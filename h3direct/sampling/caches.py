"""Opt-in approximate step caches around the denoiser: `easycache` and `h3_cache`.

`easycache` reproduces ComfyUI's EasyCache node (comfy_extras/nodes_easycache.py) on H3, decision for decision
(checked against ComfyUI's own node: fixtures/trace_gen_fx_*_easycache_*, parity_tests/test_e2e_parity.py). What it
does, in the network's own variables (ComfyUI caches around the inner forward: the video stream as the sampler
sees it, the audio stream un-carried, x_a' = x_a·σ_a/σ):
- outside (σ > start) nothing is tracked; at or below end nothing is cached at all;
- the first call inside the window only starts tracking: it keeps, on the video stream subsampled ::f in H and W,
  the input, the output and mean|v| (v = model output, (x − x0)/σ for the video); each later evaluation keeps
  k = mean|Δout_sub| / mean|Δin_sub| against the previous evaluation;
- with k known, a step adds k·mean|Δin_sub| / mean|v_prev| to a running sum; below the threshold the step is
  reused, else the sum restarts at 0 and the model runs;
- a reused step returns, per stream, the current input plus the last (output − input) the network produced: for the
  video v ≈ x + (v_prev − x_prev); for the audio in the network's variables, mapped back to the sampler's velocity
  by the inverse of the carry (v_a = (1 − s)·x_a' + (1 + (s − 1)·σ_a)·out_a', s = audio scale). ComfyUI adds the
  video difference into the model input in place, so its x0 of a reused step is (x + d)·(1 − σ), not x − σ·v:
  reproduced.
`h3_cache` uses the same quantities but compares each step's predicted change alone (no running sum).
With mode "off" `with_cache` returns the denoiser itself, so no cache code runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from h3direct.sampling import host_sigma
from h3direct.sampling.rules import CACHE_MODES, CacheSettings  # noqa: F401  (re-exported)
from h3direct.sampling.schedules import SHIFT_AUDIO, SHIFT_VIDEO, FlowSigmas, audio_scale, audio_sigma


@dataclass
class _State:
    k: torch.Tensor | None = None  # relative transformation rate Δout/Δin
    cumulative: torch.Tensor | float = 0.0
    tracking: bool = False  # set by the first call inside the window (ComfyUI picks its reference cond there)
    x_prev: torch.Tensor | None = None
    out_prev: torch.Tensor | None = None
    out_prev_norm: torch.Tensor | None = None
    skip_now: bool = False
    diffs: dict = field(default_factory=dict)  # role -> (video v − x, audio out' − x') in the network's variables


class StepCache:
    """Shared decision state; `wrap` the positive denoiser first, then (cfg > 1) the negative one."""

    def __init__(self, settings: CacheSettings, shift: float = SHIFT_VIDEO, shift_audio: float = SHIFT_AUDIO):
        self.settings = settings
        fs = FlowSigmas(shift)
        self.shift, self.shift_audio = float(shift), float(shift_audio)
        self.scale = audio_scale(self.shift, self.shift_audio)
        self.start_sigma = float(fs.percent_to_sigma(settings.start_percent))
        self.end_sigma = float(fs.percent_to_sigma(settings.end_percent))
        self.state = _State()
        self.reused_sigmas: list = []
        self.evaluated_sigmas: list = []

    def reused_steps(self, sigmas: torch.Tensor) -> list:
        """Step indices (into `sigmas`) whose model evaluation was reused."""
        table = [float(s) for s in sigmas[:-1]]
        return [table.index(s) for s in self.reused_sigmas if s in table]

    def _sub(self, x: torch.Tensor) -> torch.Tensor:
        f = self.settings.subsample_factor
        return x[..., ::f, ::f] if f > 1 else x

    def _audio_terms(self, sigma: torch.Tensor):
        """(carry σ_a/σ, σ_a) of the audio stream at the sampler's σ (float32, like the network computes them)."""
        sv = sigma.reshape(-1)[0].float().clamp(min=1e-6)
        sa = audio_sigma(sv, self.shift, self.shift_audio)
        return sa / sv, sa

    def wrap(self, denoise, role: str = "positive"):
        leader = role == "positive"
        st = self.state
        scale = self.scale

        def cached(xv: torch.Tensor, xa: torch.Tensor, sigma: torch.Tensor):
            s = host_sigma.read(sigma)  # the sampler's tag: no read-back
            sig_v = sigma.reshape((-1,) + (1,) * (xv.ndim - 1))
            sig_a = sigma.reshape((-1,) + (1,) * (xa.ndim - 1))
            if not s > self.end_sigma:
                return denoise(xv, xa, sigma)
            carry, sa = self._audio_terms(sigma)
            xa_net = xa * carry.to(xa.dtype)

            def reuse():
                dv, da = st.diffs[role]
                if leader:
                    self.reused_sigmas.append(s)
                vv = xv + dv
                va = (1.0 - scale) * xa_net + (1.0 + (scale - 1.0) * sa).to(xa.dtype) * (xa_net + da)
                # ComfyUI adds the cached difference into the model's video input in place, and the x0 it then
                # computes from that input reads the modified tensor: x0_v = (x + d) − σ·(x + d). Reproduced as is.
                return vv - vv * sig_v, xa - va * sig_a

            d_in = None
            if s <= self.start_sigma:
                if leader:
                    st.skip_now = False
                    st.tracking = True
                elif st.skip_now and role in st.diffs:
                    return reuse()
                if leader and st.x_prev is not None:
                    d_in = (self._sub(xv) - st.x_prev).flatten().abs().mean()
                if leader and st.out_prev_norm is not None and st.k is not None:
                    rate = st.k * d_in / st.out_prev_norm
                    if self.settings.mode == "easycache":
                        st.cumulative = st.cumulative + rate
                        score = st.cumulative
                    else:
                        score = rate
                    if bool(score < self.settings.threshold) and role in st.diffs:
                        st.skip_now = True
                        return reuse()
                    st.cumulative = 0.0
            x0v, x0a = denoise(xv, xa, sigma)
            vv, va = (xv - x0v) / sig_v, (xa - x0a) / sig_a
            out_net = (va - (1.0 - scale) * xa_net) / (1.0 + (scale - 1.0) * sa).to(xa.dtype)
            st.diffs[role] = (vv - xv, out_net - xa_net)
            if leader:
                self.evaluated_sigmas.append(s)
            if leader and st.tracking:
                if st.out_prev_norm is not None and d_in is not None:
                    st.k = (self._sub(vv) - st.out_prev).flatten().abs().mean() / d_in
                st.x_prev = self._sub(xv).clone()
                st.out_prev = self._sub(vv).clone()
                st.out_prev_norm = vv.flatten().abs().mean()
            return x0v, x0a

        return cached


def with_cache(denoise, settings: CacheSettings | None, shift: float = SHIFT_VIDEO, negative=None):
    """(denoise', negative', cache or None). Off / None → the callables themselves, untouched."""
    if settings is None or settings.mode == "off":
        return denoise, negative, None
    cache = StepCache(settings, shift)
    neg = cache.wrap(negative, role="negative") if negative is not None else None
    return cache.wrap(denoise), neg, cache
