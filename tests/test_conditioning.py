import json

import pytest
import torch

from h3direct.errors import H3Error
from h3direct.sampling import conditioning as hc
from parity_tests.discovery import SHARED_ORACLE

try:
    import comfy_goldens as goldens
    from comfy_defs import load
except ImportError:
    from tests import comfy_goldens as goldens
    from tests.comfy_defs import load


def _enc_video(px):  # shape of ComfyUI's VAE.encode: [1,24,T,H/16,W/16]
    t = 1 if px.shape[0] == 1 else hc.video_latent_frames(px.shape[0])  # one image → one latent frame
    return torch.zeros(1, 24, t, px.shape[1] // 16, px.shape[2] // 16)


def _enc_audio(wave):  # [1, L, C] → [1,32,2,L//800] (hop 800, crop to whole hops)
    return torch.zeros(1, 32, 2, wave.shape[1] // 800)


def test_temporal_shapes_known_values():
    # 124 frames = 5.1667 s → 37 video latent frames, round(206.67) = 207 audio frames
    assert hc.temporal_shape(124) == (124, 37, 207)
    assert hc.temporal_shape(5) == (5, 2, 8)
    assert hc.temporal_shape(6) == (22, 7, 37)
    assert hc.frames_of_latent(37) == 124 and hc.frames_of_latent(2) == 5


@pytest.mark.parametrize("w,h,n", [(100, 64, 5), (96, 65, 5), (96, 64, 3), (0, 64, 5)])
def test_bad_requests(w, h, n):
    with pytest.raises(H3Error):
        hc.latent_shapes(w, h, n)


def test_too_many_refs():
    """The caps are checked where a request names its references (`app/request.py`), before anything is encoded."""
    from h3direct.app.request import GenerateRequest

    img = torch.rand(1, 64, 64, 3)
    with pytest.raises(H3Error, match="at most 9"):
        GenerateRequest(ref_images=[img] * 10, width=64, height=64, frames=5)


@pytest.mark.shared
def test_ref2va_av_matches_oracle_node_conditioning():
    man = SHARED_ORACLE / "trace_curve_bf16_ref2va_av_fp32.json"
    nc = json.loads(man.read_text())["node_conditioning"]
    g = nc["geometry"]["task_spec"]
    cond = hc.ref2va(g["width"], g["height"], g["length"], _enc_video, _enc_audio,
                     images=[torch.rand(1, 80, 112, 3)], videos=[torch.rand(7, 64, 64, 3)],
                     video_audios=[{"waveform": torch.rand(1, 2, 6400), "sample_rate": 32000}],
                     audios=[{"waveform": torch.rand(1, 2, 4800), "sample_rate": 32000}])
    want = nc["conditioning_fields"]["minimax_refs"]
    got = cond.comfy_fields()["minimax_refs"]
    assert len(got) == len(want)
    for gb, wb in zip(got, want):
        for k, v in wb.items():
            if isinstance(v, dict):
                assert list(gb[k].shape) == v["tensor"], k
            else:
                assert gb[k] == v, k
    assert [it.kind for it in cond.presentation] == ["image", "audio", "video", "audio"]
    assert list(cond.video_shape) == nc["geometry"]["video_latent"] and list(cond.audio_shape) == nc["geometry"]["audio_latent"]


@pytest.mark.shared
def test_fl2va_and_guide_match_oracle():
    man = SHARED_ORACLE / "trace_curve_bf16_fl2va_fp32.json"
    nc = json.loads(man.read_text())["node_conditioning"]
    cond = hc.fl2va(96, 64, 5, _enc_video, torch.rand(1, 50, 70, 3), torch.rand(1, 70, 50, 3))
    hc.add_guide(cond, 2, image=torch.rand(1, 64, 96, 3), audio={"waveform": torch.rand(1, 2, 3200), "sample_rate": 32000},
                 encode_video=_enc_video, encode_audio=_enc_audio)
    want = nc["conditioning_fields"]["minimax_keyframes"]
    got = cond.comfy_fields()["minimax_keyframes"]
    assert [k["resolved_frame_index"] for k in got] == [k["resolved_frame_index"] for k in want]
    for gk, wk in zip(got, want):
        for name in ("latent", "audio_latent"):
            assert (name in gk) == (name in wk)
            if name in wk:
                assert list(gk[name].shape) == wk[name]["tensor"]


@pytest.mark.comfy
def test_geometry_vs_comfy_functions(ndarrays_regression, comfy_root):
    nodes = load(comfy_root, "comfy_extras/nodes_minimax_h3.py", ["CANVAS_MULTIPLE", "BASE_SHORT_EDGE", "MAX_PIXELS", "FPS",
                 "AUDIO_LATENT_FPS", "align_frame_count", "video_latent_t", "temporal_shape", "adapt_canvas"])
    frames = list(FRAME_COUNTS)
    temporal = [list(nodes.temporal_shape(n)) for n in frames]
    canvas = [list(nodes.adapt_canvas(w, h)) for w, h in CANVASES]
    goldens.record(ndarrays_regression, "geometry", {"frames": frames, "temporal_shape": temporal,
                                                     "canvas_in": CANVASES, "adapt_canvas": canvas})
    for n in frames:
        assert hc.temporal_shape(n) == nodes.temporal_shape(n)
    for w, h in CANVASES:
        assert hc.adapt_canvas(w, h) == nodes.adapt_canvas(w, h)


FRAME_COUNTS = range(1, 400, 3)
CANVASES = [(1920, 1080), (1080, 1920), (64, 64), (4000, 300), (300, 4000), (1344, 768), (777, 333)]


def test_geometry_vs_comfy_golden():
    g = goldens.load("geometry")
    for n, want in zip(g["frames"].tolist(), g["temporal_shape"].tolist(), strict=True):
        assert list(hc.temporal_shape(n)) == want, n
    for (w, h), want in zip(g["canvas_in"].tolist(), g["adapt_canvas"].tolist(), strict=True):
        assert list(hc.adapt_canvas(w, h)) == want, (w, h)


@pytest.mark.comfy
@pytest.mark.parametrize("crop", [False, True])
@pytest.mark.parametrize("src,dst", [((50, 70), (96, 64)), ((64, 96), (64, 96)), ((81, 33), (32, 64))])
def test_resize_bitwise_vs_comfy(crop, src, dst, ndarrays_regression, comfy_root):
    from PIL import Image
    ut = load(comfy_root, "comfy/utils.py", ["lanczos", "common_upscale"], Image=Image)
    img = torch.rand(2, src[0], src[1], 3, generator=torch.Generator().manual_seed(src[0] * 1000 + src[1]))
    ref = ut.common_upscale(img.movedim(-1, 1), dst[0], dst[1], "lanczos", "center" if crop else "disabled").movedim(1, -1)
    goldens.record(ndarrays_regression, _resize_name(crop, src, dst), {"frames": img, "resized": ref})
    assert torch.equal(hc.resize_frames(img, dst[0], dst[1], crop), ref)


def _resize_name(crop, src, dst):
    return f"resize_{src[0]}x{src[1]}_to_{dst[0]}x{dst[1]}_{'crop' if crop else 'stretch'}"


@pytest.mark.parametrize("crop", [False, True])
@pytest.mark.parametrize("src,dst", [((50, 70), (96, 64)), ((64, 96), (64, 96)), ((81, 33), (32, 64))])
def test_resize_bitwise_vs_comfy_golden(crop, src, dst):
    """ComfyUI's common_upscale (lanczos via PIL, center crop or stretch) on the recorded frames, to the bit."""
    g = goldens.load(_resize_name(crop, src, dst))
    assert torch.equal(hc.resize_frames(g["frames"], dst[0], dst[1], crop), g["resized"])
