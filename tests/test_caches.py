import pytest
import torch

from h3direct.errors import H3Error
from h3direct.sampling import caches, schedules
from h3direct.sampling import noise as hnoise
from h3direct.sampling import sampler as hs

VS, AS = (1, 24, 3, 16, 16), (1, 32, 2, 10)


def _model(calls):
    def f(xv, xa, sigma):
        calls.append(float(sigma[0]))
        s = sigma.reshape(-1, 1, 1, 1, 1)
        return torch.tanh(xv) * (1 - s) * 0.5, torch.sin(xa) * 0.3
    return f


def _run(settings, steps=12):
    calls = []
    fn, _, cache = caches.with_cache(_model(calls), settings)
    nz = hnoise.initial_noise(5, VS, AS)
    sig = schedules.sigmas_for(steps)
    return hs.sample(fn, nz.video, nz.audio, sig), calls, cache, sig


def test_off_is_the_plain_denoiser_bitwise():
    plain, plain_calls, _, _ = _run(None)
    for s in (None, caches.CacheSettings(mode="off", threshold=9.0)):
        model = _model([])
        fn, neg, cache = caches.with_cache(model, s)
        assert fn is model and cache is None and neg is None
    off, calls, _, _ = _run(caches.CacheSettings(mode="off"))
    assert torch.equal(off.video, plain.video) and torch.equal(off.audio, plain.audio) and calls == plain_calls


@pytest.mark.parametrize("mode", ["easycache", "h3_cache"])
def test_reuse_only_inside_window_and_recorded(mode):
    st = caches.CacheSettings(mode=mode, threshold=10.0, start_percent=0.2, end_percent=0.8, subsample_factor=4)
    out, calls, cache, sig = _run(st)
    reused = cache.reused_steps(sig)
    fs = schedules.FlowSigmas(12.0)
    lo, hi = fs.percent_to_sigma(0.8), fs.percent_to_sigma(0.2)
    assert reused, "a huge threshold must reuse some steps"
    for i in reused:
        assert lo < float(sig[i]) <= hi
    assert len(calls) + len(reused) == len(sig) - 1
    assert sorted(set(range(len(sig) - 1)) - set(reused)) == [schedules.sigmas_for(12).tolist().index(c) for c in calls]
    # reused steps are approximations, but close for this smooth model
    plain, _, _, _ = _run(None)
    assert (out.video - plain.video).norm() / plain.video.norm() < 0.5


def test_zero_threshold_never_reuses_and_matches_plain():
    out, calls, cache, sig = _run(caches.CacheSettings(mode="easycache", threshold=0.0))
    plain, _, _, _ = _run(None)
    assert cache.reused_steps(sig) == [] and torch.equal(out.video, plain.video)


def test_easycache_accumulates_h3_cache_does_not():
    # a threshold between one step's predicted change and two steps' sum: h3_cache reuses more
    runs = {m: _run(caches.CacheSettings(mode=m, threshold=0.05, start_percent=0.0, end_percent=1.0, subsample_factor=1))
            for m in ("easycache", "h3_cache")}
    n_easy = len(runs["easycache"][2].reused_sigmas)
    n_h3 = len(runs["h3_cache"][2].reused_sigmas)
    assert n_easy > 0 and n_h3 > n_easy


def test_bad_settings():
    from h3direct.app.request import GenerateRequest

    with pytest.raises(H3Error, match="cache_mode 'teacache' is not supported"):  # the name: where a request gives it
        GenerateRequest(cache_mode="teacache")
    with pytest.raises(H3Error, match="need 0 ≤ start ≤ end ≤ 1"):
        caches.CacheSettings(mode="easycache", start_percent=0.9, end_percent=0.1)
