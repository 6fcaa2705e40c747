"""Opt-in approximate step caches around the denoiser: `easycache` and `h3_cache`.

Both follow ComfyUI's EasyCache (comfy_extras/nodes_easycache.py) at the model-output level:
the model output v = (x − x0)/σ; after each full evaluation the cache keeps v − x per stream
and, on the video stream subsampled ::f in H and W, the input, the output and mean|v|. Between
two full evaluations k = Δout / Δin. At a later step inside [start_percent, end_percent) the
predicted output change is k·Δin / mean|v_prev| with Δin = mean|x_sub − x_prev_sub|:
- easycache: reuse (v ≈ x + cached v − x) while the *cumulative* predicted change since the
  last full evaluation stays below the threshold; otherwise evaluate and reset the sum.
- h3_cache: reuse while the *current step's* predicted change is below the threshold.
With mode "off" `with_cache` returns the denoiser itself, so no cache code runs at all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from h3direct.errors import H3Error
from h3direct.sampling.schedules import SHIFT_VIDEO, FlowSigmas

CACHE_MODES = ("off", "easycache", "h3_cache")


@dataclass
class CacheSettings:
    mode: str = "off"
    threshold: float = 0.2
    start_percent: float = 0.15
    end_percent: float = 0.95
    subsample_factor: int = 8

    def __post_init__(self):
        if self.mode not in CACHE_MODES:
            raise H3Error(f"cache mode {self.mode!r}: use one of {', '.join(CACHE_MODES)}")
        if not 0.0 <= self.start_percent <= self.end_percent <= 1.0:
            raise H3Error(f"cache start_percent={self.start_percent}, end_percent={self.end_percent}: need 0 ≤ start ≤ end ≤ 1")
        if self.threshold < 0 or self.subsample_factor < 1:
            raise H3Error(f"cache threshold={self.threshold} must be ≥ 0 and subsample_factor={self.subsample_factor} ≥ 1")


@dataclass
class _State:
    k: torch.Tensor | None = None  # relative transformation rate Δout/Δin
    cumulative: float = 0.0
    x_prev: torch.Tensor | None = None
    out_prev: torch.Tensor | None = None
    out_prev_norm: torch.Tensor | None = None
    skip_now: bool = False
    diffs: dict = field(default_factory=dict)  # role -> (video v−x, audio v−x)


class StepCache:
    """Shared decision state; `wrap` the positive denoiser first, then (cfg > 1) the negative one."""

    def __init__(self, settings: CacheSettings, shift: float = SHIFT_VIDEO):
        self.settings = settings
        fs = FlowSigmas(shift)
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

    def wrap(self, denoise, role: str = "positive"):
        leader = role == "positive"
        st = self.state

        def cached(xv: torch.Tensor, xa: torch.Tensor, sigma: torch.Tensor):
            s = float(sigma.reshape(-1)[0])
            sig_v = sigma.reshape((-1,) + (1,) * (xv.ndim - 1))
            sig_a = sigma.reshape((-1,) + (1,) * (xa.ndim - 1))
            if not s > self.end_sigma:
                return denoise(xv, xa, sigma)

            def reuse():
                dv, da = st.diffs[role]
                if leader:
                    self.reused_sigmas.append(s)
                return xv - (xv + dv) * sig_v, xa - (xa + da) * sig_a

            d_in = None
            if s <= self.start_sigma:
                if leader:
                    st.skip_now = False
                elif st.skip_now and role in st.diffs:
                    return reuse()
                if leader and st.x_prev is not None:
                    d_in = (self._sub(xv) - st.x_prev).flatten().abs().mean()
                if leader and st.out_prev_norm is not None and st.k is not None:
                    rate = float(st.k * d_in / st.out_prev_norm)
                    if self.settings.mode == "easycache":
                        st.cumulative += rate
                        score = st.cumulative
                    else:
                        score = rate
                    if score < self.settings.threshold and role in st.diffs:
                        st.skip_now = True
                        return reuse()
                    st.cumulative = 0.0
            x0v, x0a = denoise(xv, xa, sigma)
            vv, va = (xv - x0v) / sig_v, (xa - x0a) / sig_a
            st.diffs[role] = (vv - xv, va - xa)
            if leader:
                self.evaluated_sigmas.append(s)
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
