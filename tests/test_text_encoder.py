import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from h3direct.errors import H3Error
from h3direct.sampling.conditioning import PresentationItem
from h3direct.text import load as hl
from h3direct.text import presentation as hp
from h3direct.text import qwen as hq
from parity_tests.discovery import SHARED_ORACLE

try:
    import comfy_goldens as goldens
except ImportError:
    from tests import comfy_goldens as goldens


def test_vision_pad_count_qwen_grid():
    # merged tokens = (H'/32)·(W'/32), H', W' rounded to 32; min 3136 px enforced by upscaling
    assert hp.vision_pad_count(64, 96) == 6
    assert hp.vision_pad_count(544, 960) == 17 * 30
    assert hp.vision_pad_count(20, 20) == 4  # 20x20 < 3136 px → ceil to 64x64


def test_presentation_structure_with_char_tokenizer():
    tok = lambda s: [ord(c) for c in s]  # noqa: E731
    items = [PresentationItem("image", torch.zeros(1, 64, 96, 3)), PresentationItem("audio"),
             PresentationItem("video", torch.zeros(3, 64, 64, 3), [0.0, 0.5, 1.0])]
    p = hp.build_presentation("hi", items, tok)
    text = "".join(chr(t) if t > 0 and t < 1000 else "|" for t in p.token_ids)
    assert text.startswith("<Picture 1>: ||||||||<Audio 1>: <Video 1>: <0.2 seconds>||||||<1.0 seconds>||||||hi")
    assert p.tags.tolist().count(0) == (6 + 2) + 2 * (4 + 2)
    assert hp.build_presentation("", [], tok).token_ids == [hp.PAD_ID]


def test_tiny_encoder_and_comfy_key_roundtrip(tmp_path):
    enc = hq.make_tiny_text_encoder(0)
    pres = hp.Presentation([10, 20, hp.VISION_START, hp.VISION_PAD, hp.VISION_END, 30], torch.tensor([1, 1, 0, 0, 0, 1]))
    out = enc.encode(pres)
    assert out.states.shape == (1, 6, 96) and out.tags.tolist() == [1, 1, 0, 0, 0, 1]
    sd = {"text_encoders.qwen3vl_32b.transformer." + k: v for k, v in hq.comfy_state_dict(enc).items()}
    sd["text_encoders.qwen3vl_32b.transformer.model.norm.weight"] = torch.ones(96)  # ComfyUI ignores it too
    save_file(sd, tmp_path / "te.safetensors")
    enc2 = hl.load_text_encoder(tmp_path / "te.safetensors")
    assert enc2.config == hq.tiny_config() and enc2.visual is None
    assert torch.equal(enc2.encode(pres).states, out.states)
    del sd["text_encoders.qwen3vl_32b.transformer.model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "bad.safetensors")
    with pytest.raises(H3Error, match="missing.*layers.1.mlp.up_proj"):
        hl.load_text_encoder(tmp_path / "bad.safetensors")


def test_bf16_file_stays_bf16_and_computes_in_fp32(tmp_path):
    enc = hq.make_tiny_text_encoder(5)
    save_file({k: v.to(torch.bfloat16) for k, v in hq.comfy_state_dict(enc).items()}, tmp_path / "te.safetensors")
    enc16 = hl.load_text_encoder(tmp_path / "te.safetensors")
    assert {p.dtype for p in enc16.net.parameters()} == {torch.bfloat16}
    pres = hp.build_presentation("bf16 weights", [], lambda s: [ord(c) for c in s])
    got = enc16.encode(pres).states
    # reference: the same bf16-rounded weights held in fp32
    ref32 = hq.make_tiny_text_encoder(5)
    ref32.net.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ref32.net.state_dict().items()})
    want = ref32.encode(pres).states
    assert torch.allclose(got, want, rtol=0, atol=1e-6)


def _awq_file(tmp_path, enc, layers):
    """A ComfyUI mixed-precision file: `layers` NVFP4 with an AWQ pre_quant_scale; returns (path, dense fp32 sd
    whose quantized weights are the NVFP4 decodes divided back by nothing: the dense reference)."""
    from h3direct.checkpoint.quant import NVFP4_MARKER
    from h3direct.checkpoint.quant.nvfp4 import quantize_nvfp4

    g = torch.Generator().manual_seed(7)
    sd = hq.comfy_state_dict(enc)
    for layer in layers:
        w = sd.pop(f"{layer}.weight")
        s = 0.5 + torch.rand(w.shape[1], generator=g)  # AWQ smoothing: x·s, W/s
        q = quantize_nvfp4(w / s)
        sd.update({f"{layer}.weight": q.packed, f"{layer}.weight_scale": q.block_scale,
                   f"{layer}.weight_scale_2": q.global_scale, f"{layer}.pre_quant_scale": s,
                   f"{layer}.input_scale": torch.tensor(1.0),
                   f"{layer}.comfy_quant": torch.tensor(list(NVFP4_MARKER), dtype=torch.uint8)})
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "awq.safetensors")
    return tmp_path / "awq.safetensors", sd


def test_nvfp4_awq_linear_is_exact_decode_of_the_file(tmp_path):
    from h3direct.checkpoint.quant.nvfp4 import e2m1_table, unpack_codes, unswizzle_block_scales

    enc = hq.make_tiny_text_encoder(1)
    layer = "model.layers.0.mlp.gate_proj"
    path, sd = _awq_file(tmp_path, enc, [layer])
    q = hl.load_text_encoder(path)
    lin = q.model.layers[0].mlp.gate_proj
    assert lin.quant_format == "nvfp4" and lin.weight.dtype == torch.uint8
    # independent decode: code value x block scale x global scale (fp32), then y = (x*s) W^T
    packed, n, k = sd[f"{layer}.weight"], lin.out_features, lin.in_features
    vals = e2m1_table(torch.float32)[unpack_codes(packed).long()]
    blocks = unswizzle_block_scales(sd[f"{layer}.weight_scale"], n, k // 16).float()
    w = (vals.reshape(n, k // 16, 16) * blocks[..., None] * sd[f"{layer}.weight_scale_2"]).reshape(n, k)
    x = torch.randn(3, k)
    want = (x.double() * sd[f"{layer}.pre_quant_scale"].double()) @ w.double().T
    assert torch.allclose(lin(x).double(), want, rtol=1e-5, atol=1e-5)


def _with_weights(seed: int, weights: dict) -> hq.QwenTextEncoder:
    enc = hq.make_tiny_text_encoder(seed)
    sd = enc.net.state_dict()
    sd.update(weights)
    enc.net.load_state_dict(sd)
    return enc


def test_nvfp4_awq_encoder_vs_dense(tmp_path):
    from h3direct.checkpoint.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4

    enc = hq.make_tiny_text_encoder(2)
    layers = [f"model.layers.{i}.{m}" for i in range(2) for m in
              ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    path, sd = _awq_file(tmp_path, enc, layers)
    q = hl.load_text_encoder(path)
    pres = hp.build_presentation("quantized weights, same model", [], lambda s: [ord(c) for c in s])
    got, dense = q.encode(pres).states, enc.encode(pres).states

    def decoded(layer):
        return dequantize_nvfp4(sd[f"{layer}.weight"], sd[f"{layer}.weight_scale"].view(torch.float8_e4m3fn),
                                sd[f"{layer}.weight_scale_2"], torch.float32)

    # 1. exact semantics: (x*s) W_q^T == x (W_q * s)^T -- a dense fp32 model holding the decoded weights
    exact = _with_weights(2, {f"{k}.weight": decoded(k) * sd[f"{k}.pre_quant_scale"][None] for k in layers})
    assert rel(got, exact.encode(pres).states) < 1e-5
    # 2. within NVFP4 error: no worse than 2x plain NVFP4 (no smoothing) of the same weights vs dense
    plain = {}
    for k in layers:
        t = quantize_nvfp4(enc.net.state_dict()[f"{k}.weight"])
        plain[f"{k}.weight"] = dequantize_nvfp4(t.packed, t.block_scale, t.global_scale, torch.float32)
    baseline = rel(_with_weights(2, plain).encode(pres).states, dense)
    assert rel(got, dense) <= 2 * baseline, (rel(got, dense), baseline)
    # 3. the gate can fail: a loader that ignored pre_quant_scale
    for mod in q.net.modules():
        if getattr(mod, "pre_quant_scale", None) is not None:
            mod.pre_quant_scale = None
    assert rel(q.encode(pres).states, exact.encode(pres).states) > 1e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("breakage, message", [
    ("drop_scale2", "lacks weight_scale_2"),
    ("bad_format", "format 'int4_magic' is not supported"),
    ("bad_shape", "weight_scale: shape"),
    ("not_json", "unreadable comfy_quant"),
], ids=lambda v: v if " " not in v else "")
def test_malformed_quantized_file_one_line_error(tmp_path, breakage, message):
    enc = hq.make_tiny_text_encoder(3)
    layer = "model.layers.1.self_attn.o_proj"
    path, sd = _awq_file(tmp_path, enc, [layer])
    if breakage == "drop_scale2":
        del sd[f"{layer}.weight_scale_2"]
    elif breakage == "bad_format":
        sd[f"{layer}.comfy_quant"] = torch.tensor(list(b'{"format": "int4_magic"}'), dtype=torch.uint8)
    elif breakage == "bad_shape":
        sd[f"{layer}.weight_scale"] = sd[f"{layer}.weight_scale"][:64]
    else:
        sd[f"{layer}.comfy_quant"] = torch.tensor(list(b"nvfp4"), dtype=torch.uint8)
    save_file({k: v.contiguous() for k, v in sd.items()}, path)
    with pytest.raises(H3Error, match=message) as info:
        hl.load_text_encoder(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)


def test_not_a_text_encoder_file(tmp_path):
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(H3Error, match="safetensors"):
        hl.load_text_encoder(tmp_path / "junk.safetensors")
    save_file({"foo.weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(H3Error, match="not a Qwen3-VL text encoder"):
        hl.load_text_encoder(tmp_path / "other.safetensors")


# ---- reference-audio resampling (media.resample = torchaudio.functional.resample defaults) -------

def _direct_resample_f64(x: np.ndarray, orig: int, new: int, lpw: int = 6, rolloff: float = 0.99) -> np.ndarray:
    """Band-limited interpolation summed directly in float64: y[m] = sum_n x[n] h(n/orig - m/new),
    h = (base/orig) sinc(pi u) cos^2(pi u / 2 lpw), u = base (n/orig - m/new), |u| < lpw, zero outside [0, L)."""
    g = math.gcd(orig, new)
    orig, new = orig // g, new // g
    base = min(orig, new) * rolloff
    length = x.shape[-1]
    m = np.arange(math.ceil(new * length / orig))[:, None]
    n = np.arange(length)[None, :]
    u = base * (n / orig - m / new)
    h = np.where(np.abs(u) < lpw, (base / orig) * np.sinc(u) * np.cos(np.pi * u / (2 * lpw)) ** 2, 0.0)
    return x @ h.T


@pytest.mark.parametrize("rates", [(44100, 32000), (48000, 32000), (16000, 32000), (22050, 32000)], ids=str)
def test_resample_matches_direct_windowed_sinc(rates):
    from h3direct.sampling.media import resample

    orig, new = rates
    g = torch.Generator().manual_seed(orig)
    x = torch.randn(2, 1500, generator=g, dtype=torch.float64)
    want = _direct_resample_f64(x.numpy(), orig, new)
    # float64 waveform -> float64 kernel (torchaudio evaluates the kernel in the waveform's dtype): the
    # polyphase convolution must equal the direct sum to float64 rounding
    got64 = resample(x[None], orig, new)[0]
    assert got64.shape == want.shape == (2, math.ceil(1500 * new / orig))
    assert np.abs(got64.numpy() - want).max() / np.abs(want).max() < 1e-12
    # float32 (what load_audio feeds): the fp32 kernel arguments (up to ~20 rad) carry ~1e-5 relative error
    got32 = resample(x.float()[None], orig, new)[0]
    assert np.abs(got32.double().numpy() - want).max() / np.abs(want).max() < 1e-4


def test_resample_keeps_a_band_limited_tone():
    from h3direct.sampling.media import resample

    t = torch.arange(4410, dtype=torch.float64) / 44100
    y = resample(torch.sin(2 * math.pi * 1000 * t).float(), 44100, 32000)
    t2 = torch.arange(y.shape[-1], dtype=torch.float64) / 32000
    mid = slice(200, -200)  # away from the zero-padded edges
    assert torch.allclose(y[mid].double(), torch.sin(2 * math.pi * 1000 * t2)[mid], atol=2e-3)


def test_load_audio_resamples_like_resample(tmp_path):
    import av  # the media extra

    from h3direct.sampling.media import load_audio, resample

    sr, n = 44100, 4410
    tone = (0.3 * np.sin(2 * np.pi * 440 * np.arange(n) / sr)).astype(np.float32)
    with av.open(str(tmp_path / "a.wav"), "w") as box:
        st = box.add_stream("pcm_f32le", rate=sr, layout="mono")
        fr = av.AudioFrame.from_ndarray(tone[None], format="flt", layout="mono")
        fr.sample_rate = sr
        for pkt in st.encode(fr):
            box.mux(pkt)
        for pkt in st.encode(None):
            box.mux(pkt)
    a = load_audio(tmp_path / "a.wav")
    assert a["sample_rate"] == 32000 and a["waveform"].shape == (1, 1, math.ceil(n * 320 / 441))
    assert torch.allclose(a["waveform"], resample(torch.from_numpy(tone)[None, None], sr, 32000), atol=1e-7)


def test_text_embeds_file(tmp_path):
    save_file({"text_states": torch.randn(1, 5, 8), "token_tags": torch.ones(5, dtype=torch.long)}, tmp_path / "e.safetensors")
    e = hl.load_text_embeds(tmp_path / "e.safetensors")
    assert e.states.shape == (1, 5, 8) and e.tags.dtype == torch.long
    save_file({"text_states": torch.randn(1, 5, 8)}, tmp_path / "b.safetensors")
    with pytest.raises(H3Error, match="token_tags"):
        hl.load_text_embeds(tmp_path / "b.safetensors")


@pytest.mark.comfy
@pytest.mark.shared
@pytest.mark.parametrize("task", ["ref2va_av", "fl2va"])
def test_presentation_matches_oracle_token_ids(task, ndarrays_regression, data_regression, comfy_root):
    inp = SHARED_ORACLE / f"inputs_public_curve_{task}.safetensors"
    man = SHARED_ORACLE / f"trace_curve_bf16_{task}_fp32.json"
    from transformers import Qwen2Tokenizer

    tdir = Path(comfy_root) / "comfy/text_encoders/qwen25_tokenizer"
    qt = Qwen2Tokenizer.from_pretrained(str(tdir))
    seen = {}

    def tok(s):
        seen[s] = qt(s, add_special_tokens=False)["input_ids"]
        return seen[s]

    nc = json.loads(man.read_text())["node_conditioning"]
    want = load_file(str(inp))
    spec = nc["geometry"]["task_spec"]
    p = hp.build_presentation(spec["prompt"], _presentation_items(task), tok)
    # ComfyUI's presentation (recorded by ComfyUI's MiniMaxH3Tokenizer into the shared inputs) and its tokenizer's ids
    goldens.record(ndarrays_regression, f"presentation_{task}", {"token_ids": want["token_ids"],
                                                                  "token_tags": want["token_tags"]})
    data_regression.check({"prompt": spec["prompt"], "tokens": [{"text": t, "ids": i} for t, i in sorted(seen.items())]},
                          fullpath=goldens.GOLDENS / f"presentation_{task}_tokens.yml")
    assert p.token_ids == want["token_ids"].tolist()
    assert torch.equal(p.tags, want["token_tags"].long())


def _presentation_items(task):
    if task == "ref2va_av":
        return [PresentationItem("image", torch.zeros(1, 64, 96, 3)), PresentationItem("audio"),
                PresentationItem("video", torch.zeros(1, 64, 64, 3), [0.0]), PresentationItem("audio")]
    return [PresentationItem("image", torch.zeros(1, 64, 96, 3))] * 2


@pytest.mark.parametrize("task", ["ref2va_av", "fl2va"])
def test_presentation_matches_comfy_golden(task):
    """The prompt presentation (vision pads, audio blocks, tags) against ComfyUI's recorded token ids and tags."""
    import yaml

    want = goldens.load(f"presentation_{task}")
    spec = yaml.safe_load((goldens.GOLDENS / f"presentation_{task}_tokens.yml").read_text())
    tokens = {e["text"]: e["ids"] for e in spec["tokens"]}
    p = hp.build_presentation(spec["prompt"], _presentation_items(task), lambda s: list(tokens[s]))
    assert p.token_ids == want["token_ids"].tolist()
    assert torch.equal(p.tags, want["token_tags"].long())
