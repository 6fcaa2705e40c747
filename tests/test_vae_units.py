"""VAE plumbing: configs, strict loading, synthetic weights, tile/chunk geometry, fp16 overflow detection, mp4 output.

Expected values come from ComfyUI's recorded data (checkpoint buffers, trace manifests), from ComfyUI's documented
frame formulas (17k+5 frames <-> 5k+2 latent frames, `comfy.sd.VAE`), or from PyAV reading our file back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3direct.app.cli import main as cli_main
from h3direct.errors import H3Error
from h3direct.vae import (
    AUDIO_PRESETS,
    VIDEO_PRESETS,
    AudioVAEConfig,
    VideoVAEConfig,
    decode_audio,
    decode_video,
    load_audio_vae,
    load_video_vae,
)
from h3direct.vae.synthetic import make_state_dict
from h3direct.vae.video_tiling import plan_decode, split_tiles
from parity_tests.discovery import FIXTURES, SHARED_ORACLE

# the video decode trace ComfyUI recorded with the shared tiny VAE, and with the committed fixture VAE (32-px tiles)
DECODE_MANIFESTS = [
    pytest.param(SHARED_ORACLE / "trace_vae_video_decode_fp32.json", id="shared", marks=pytest.mark.shared),
    pytest.param(FIXTURES / "trace_vae_video_decode_fp32.json", id="fixtures"),
]


@pytest.fixture(scope="module")
def synthetic_files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vae_syn")
    paths = {}
    for comp in ("video_vae", "audio_vae"):
        paths[comp] = tmp / f"{comp}.safetensors"
        save_file(make_state_dict(comp, "tiny", seed=0), str(paths[comp]))
    return paths


@pytest.mark.shared
def test_config_from_constructor_args_is_the_tiny_preset():
    d = json.loads((SHARED_ORACLE / "vae_config_public.json").read_text())
    assert VideoVAEConfig.from_constructor_args(d) == VIDEO_PRESETS["tiny"]
    assert AudioVAEConfig.from_constructor_args(d) == AUDIO_PRESETS["tiny"]
    with pytest.raises(H3Error, match="unknown constructor argument 'chh'"):
        VideoVAEConfig.from_constructor_args({"MiniMaxH3VideoVAE": {"chh": 3}})


def test_real_size_derived_geometry():
    cfg = VideoVAEConfig()
    assert (cfg.vae_ratio, cfg.vae_ratio_t, cfg.tokens_chunk_size, cfg.token_overlap) == (16, 4, 5, 2)
    assert (cfg.frame_pre_padding, cfg.frame_overlap, cfg.dim, cfg.rope_pairs_per_axis) == (3, 5, 2048, 8)
    assert AudioVAEConfig().hop_length == 800 and AudioVAEConfig().latents_per_second == 40


@pytest.mark.parametrize("k", [0, 1, 2, 3, 6])
def test_frame_count_formula(k):
    """comfy.sd.VAE: latents 5k+2 <-> frames 17k+5; one latent frame is one image."""
    assert plan_decode(5 * k + 2, VideoVAEConfig()).frames == 17 * k + 5
    assert plan_decode(1, VideoVAEConfig()).frames == 1


@pytest.mark.parametrize("manifest", DECODE_MANIFESTS)
def test_split_tiles_matches_comfyui_manifest(manifest):
    m = json.loads(manifest.read_text())
    for case, info in m["cases"].items():
        h, w = info["output"][2:4]
        for side, n in (("split_tiles_h", h), ("split_tiles_w", w)):
            starts, sizes, overlaps = info[side]
            got = split_tiles(n, info["tile_size"], info["tile_overlap_min"], 16)
            assert list(got.starts) == starts and [got.size] * len(starts) == sizes
            assert list(got.overlaps) == overlaps, (case, side)


@pytest.mark.shared
def test_kaiser_filters_equal_comfyui_buffers():
    ref = load_file(str(SHARED_ORACLE / "vae_audio_tiny.safetensors"))
    ours = make_state_dict("audio_vae", "tiny", seed=0)
    keys = [k for k in ref if k.endswith(".filter")]
    assert keys and all(torch.equal(ours[k], ref[k]) for k in keys)


@pytest.mark.shared
@pytest.mark.parametrize("comp,name", [("video_vae", "vae_video_tiny"), ("audio_vae", "vae_audio_tiny")])
def test_synthetic_layout_matches_comfyui_file(comp, name):
    ref = load_file(str(SHARED_ORACLE / f"{name}.safetensors"))
    ours = make_state_dict(comp, "tiny", seed=0)
    assert sorted(ours) == sorted(ref)
    assert all(ours[k].shape == ref[k].shape for k in ref)


def test_synthetic_is_deterministic_and_seeded():
    a, b, c = (make_state_dict("video_vae", "tiny", seed=s) for s in (0, 0, 1))
    k = "decoder.transformer_blocks.0.attn.to_qkv.weight"
    assert torch.equal(a[k], b[k]) and not torch.equal(a[k], c[k])


def test_synthetic_decodes_finite(synthetic_files):
    vae = load_video_vae(synthetic_files["video_vae"], VIDEO_PRESETS["tiny"])
    px = decode_video(vae, torch.randn(1, 24, 2, 3, 4, generator=torch.Generator().manual_seed(0)))
    assert px.shape == (1, 5, 48, 64, 3) and torch.isfinite(px).all() and 0.01 < float(px.std()) < 0.5
    avae = load_audio_vae(synthetic_files["audio_vae"], AUDIO_PRESETS["tiny"])
    wav = decode_audio(avae, torch.randn(1, 32, 2, 3, generator=torch.Generator().manual_seed(0)))
    assert wav.shape == (1, 2400, 2) and torch.isfinite(wav).all() and float(wav.std()) > 1e-3


def test_video_decode_is_a_function_of_the_latent(synthetic_files):
    """The same latent decodes to the same pixels, bit for bit, again after another latent (other shape, other
    values) went through the same VAE: spatial tiles, temporal chunks and their blends read nothing left behind."""
    vae = load_video_vae(synthetic_files["video_vae"], VIDEO_PRESETS["tiny"])
    g = torch.Generator().manual_seed(0)
    latent, other = torch.randn(1, 24, 7, 3, 4, generator=g), 4.0 * torch.randn(1, 24, 12, 4, 3, generator=g)
    first = decode_video(vae, latent, tile_size=32, tile_overlap=16)
    decode_video(vae, other, tile_size=32, tile_overlap=16)
    assert torch.equal(decode_video(vae, latent, tile_size=32, tile_overlap=16), first)


@pytest.mark.parametrize("edit,match", [
    (lambda sd: sd.pop("decoder.norm_out.weight"), "missing key decoder.norm_out.weight"),
    (lambda sd: sd.__setitem__("decoder.extra.weight", torch.zeros(2)), "unexpected key decoder.extra.weight"),
    (lambda sd: sd.__setitem__("post_quant_conv.bias", torch.zeros(7)), "key post_quant_conv.bias has shape"),
])
def test_strict_loading_names_the_key(tmp_path, edit, match):
    sd = make_state_dict("video_vae", "tiny", seed=0)
    edit(sd)
    path = tmp_path / "bad.safetensors"
    save_file(sd, str(path))
    with pytest.raises(H3Error, match=match) as err:
        load_video_vae(path, VIDEO_PRESETS["tiny"])
    assert "\n" not in str(err.value)


def test_wrong_config_is_a_one_line_error(synthetic_files):
    with pytest.raises(H3Error, match="shape"):
        load_audio_vae(synthetic_files["audio_vae"], AudioVAEConfig())


def test_fp16_overflow_is_detected(tmp_path):
    sd = make_state_dict("video_vae", "tiny", seed=0)
    # a layer scale near the fp16 maximum: the residual stream overflows in fp16 but not in fp32
    sd["decoder.transformer_blocks.0.scale2"] = torch.full_like(sd["decoder.transformer_blocks.0.scale2"], 6e4)
    path = tmp_path / "hot.safetensors"
    save_file(sd, str(path))
    vae = load_video_vae(path, VIDEO_PRESETS["tiny"], dtype=torch.float16)
    with pytest.raises(H3Error, match="non-finite.*fp32"):
        decode_video(vae, torch.randn(1, 24, 1, 2, 2))
    assert torch.isfinite(decode_video(vae, torch.randn(1, 24, 1, 2, 2), dtype="fp32")).all()


def test_bad_tile_geometry_is_rejected(synthetic_files):
    vae = load_video_vae(synthetic_files["video_vae"], VIDEO_PRESETS["tiny"])
    with pytest.raises(H3Error, match="multiple of 16"):
        decode_video(vae, torch.randn(1, 24, 1, 2, 2), tile_size=40)


def test_decode_latent_writes_playable_mp4(tmp_path, synthetic_files, capsys):
    import av  # the media extra: PyAV writes and reads the mp4
    lat = tmp_path / "lat.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file({"video_latent": torch.randn(1, 24, 7, 2, 3, generator=g),
               "audio_latent": torch.randn(1, 32, 2, 37, generator=g)}, str(lat))
    out = tmp_path / "clip.mp4"
    rc = cli_main(["decode-latent", str(lat), "--out", str(out), "--vae", str(synthetic_files["video_vae"]),
                   "--audio-vae", str(synthetic_files["audio_vae"]), "--vae-config",
                   str(_tiny_config(tmp_path)), "--vae-dtype", "fp32", "--device", "cpu"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["frames"] == 22
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".clip")) == []  # no temp file left
    with av.open(str(out)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        assert (v.codec_context.name, v.width, v.height, int(v.average_rate)) == ("h264", 48, 32, 24)
        assert (a.codec_context.name, a.channels, a.rate) == ("aac", 2, 32000)
        assert sum(1 for _ in c.decode(video=0)) == 22  # 7 latent frames = 17·1 + 5


def test_decode_latent_requires_audio_vae(tmp_path, synthetic_files):
    lat = tmp_path / "lat.safetensors"
    save_file({"video_latent": torch.zeros(1, 24, 1, 1, 1), "audio_latent": torch.zeros(1, 32, 2, 2)}, str(lat))
    rc = cli_main(["decode-latent", str(lat), "--out", str(tmp_path / "x.mp4"),
                   "--vae", str(synthetic_files["video_vae"]), "--vae-config", str(_tiny_config(tmp_path))])
    assert rc == 2 and not (tmp_path / "x.mp4").exists()


def _tiny_config(tmp: Path) -> Path:
    p = tmp / "tiny_vae.json"
    p.write_text(json.dumps({"constructor_args": {
        "MiniMaxH3VideoVAE": {"ch": 32, "ch_mult": [1, 1, 1, 1, 1, 2], "num_res_blocks": 1, "tile_size": 64,
                              "tile_overlap_min": 16},
        "ViT3DDecoder": {"num_layers": 2, "heads": 2, "dim_head": 32},
        "MiniMaxH3AudioVAE": {"encoder_dim": 4, "latent_dim": 64, "decoder_dim": 128}}}))
    return p


def _scribble_heap(byte: int) -> None:
    """Allocate and free buffers filled with `byte`, so the memory handed out next holds other bytes than before."""
    buffers = [bytearray([byte]) * (n + 97 * byte) for n in (512, 4096, 20_000, 60_000, 120_000)]
    del buffers


def test_the_same_frames_encode_to_the_same_mp4(tmp_path):
    """An mp4 is a function of its frames: the same frames written again in one process, whatever the heap holds,
    give the same bytes. Frames: blocky noise that changes every frame (what the bundled random models make), the
    input on which x264's macroblock-tree rate control read memory it had not written (on CPUs with AVX-512)."""
    import numpy as np

    from h3direct.vae.mp4 import write_mp4

    blocks = np.random.default_rng(0).normal(size=(22, 8, 12, 3))
    frames = np.clip(128 + 60 * blocks.repeat(8, axis=1).repeat(8, axis=2), 0, 255).astype(np.uint8)
    first = write_mp4(tmp_path / "first.mp4", frames, 24).read_bytes()
    for k in range(1, 33):
        _scribble_heap(k)
        again = write_mp4(tmp_path / "again.mp4", frames, 24).read_bytes()
        assert again == first, f"write {k + 1} of the same frames gave other bytes"
