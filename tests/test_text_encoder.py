import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3direct import text_encoder as hte
from h3direct.conditioning import PresentationItem
from h3direct.errors import H3Error

try:
    from comfy_defs import needs_comfy
except ImportError:
    from tests.comfy_defs import needs_comfy

ORACLE = Path(os.environ.get("H3_ORACLE_DIR", "/work/shared/oracle"))


def test_vision_pad_count_qwen_grid():
    # merged tokens = (H'/32)·(W'/32), H', W' rounded to 32; min 3136 px enforced by upscaling
    assert hte.vision_pad_count(64, 96) == 6
    assert hte.vision_pad_count(544, 960) == 17 * 30
    assert hte.vision_pad_count(20, 20) == 4  # 20x20 < 3136 px → ceil to 64x64


def test_presentation_structure_with_char_tokenizer():
    tok = lambda s: [ord(c) for c in s]  # noqa: E731
    items = [PresentationItem("image", torch.zeros(1, 64, 96, 3)), PresentationItem("audio"),
             PresentationItem("video", torch.zeros(3, 64, 64, 3), [0.0, 0.5, 1.0])]
    p = hte.build_presentation("hi", items, tok)
    text = "".join(chr(t) if t > 0 and t < 1000 else "|" for t in p.token_ids)
    assert text.startswith("<Picture 1>: ||||||||<Audio 1>: <Video 1>: <0.2 seconds>||||||<1.0 seconds>||||||hi")
    assert p.tags.tolist().count(0) == (6 + 2) + 2 * (4 + 2)
    assert hte.build_presentation("", [], tok).token_ids == [hte.PAD_ID]


def test_tiny_encoder_and_comfy_key_roundtrip(tmp_path):
    enc = hte.make_tiny_text_encoder(0)
    pres = hte.Presentation([10, 20, hte.VISION_START, hte.VISION_PAD, hte.VISION_END, 30], torch.tensor([1, 1, 0, 0, 0, 1]))
    out = enc.encode(pres)
    assert out.states.shape == (1, 6, 96) and out.tags.tolist() == [1, 1, 0, 0, 0, 1]
    # last layer output is un-normalized: it differs from the model's final-norm output
    ids = torch.tensor([[10, 20, hte.VISION_START, hte.PAD_ID, hte.VISION_END, 30]])
    normed = enc.model(input_ids=ids).last_hidden_state
    assert not torch.allclose(normed, out.states)
    sd = {"text_encoders.qwen3vl_32b.transformer.model." + k: v for k, v in enc.model.state_dict().items()}
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "te.safetensors")
    enc2 = hte.load_text_encoder(tmp_path / "te.safetensors", config=hte.tiny_config())
    assert torch.equal(enc2.encode(pres).states, out.states)
    del sd["text_encoders.qwen3vl_32b.transformer.model.norm.weight"]
    save_file({k: v.contiguous() for k, v in sd.items()}, tmp_path / "bad.safetensors")
    with pytest.raises(H3Error, match="missing"):
        hte.load_text_encoder(tmp_path / "bad.safetensors", config=hte.tiny_config())


def test_text_embeds_file(tmp_path):
    save_file({"text_states": torch.randn(1, 5, 8), "token_tags": torch.ones(5, dtype=torch.long)}, tmp_path / "e.safetensors")
    e = hte.load_text_embeds(tmp_path / "e.safetensors")
    assert e.states.shape == (1, 5, 8) and e.tags.dtype == torch.long
    save_file({"text_states": torch.randn(1, 5, 8)}, tmp_path / "b.safetensors")
    with pytest.raises(H3Error, match="token_tags"):
        hte.load_text_embeds(tmp_path / "b.safetensors")


@needs_comfy
@pytest.mark.comfy
@pytest.mark.parametrize("task", ["ref2va_av", "fl2va"])
def test_presentation_matches_oracle_token_ids(task):
    inp, man = ORACLE / f"inputs_public_curve_{task}.safetensors", ORACLE / f"trace_curve_bf16_{task}_fp32.json"
    if not inp.exists():
        pytest.skip(f"{inp} missing")
    from transformers import Qwen2Tokenizer

    tdir = Path(os.environ["H3_COMFY_ROOT"]) / "comfy/text_encoders/qwen25_tokenizer"
    qt = Qwen2Tokenizer.from_pretrained(str(tdir))
    tok = lambda s: qt(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    nc = json.loads(man.read_text())["node_conditioning"]
    want = load_file(str(inp))
    spec = nc["geometry"]["task_spec"]
    if task == "ref2va_av":
        items = [PresentationItem("image", torch.zeros(1, 64, 96, 3)), PresentationItem("audio"),
                 PresentationItem("video", torch.zeros(1, 64, 64, 3), [0.0]), PresentationItem("audio")]
    else:
        items = [PresentationItem("image", torch.zeros(1, 64, 96, 3))] * 2
    p = hte.build_presentation(spec["prompt"], items, tok)
    assert p.token_ids == want["token_ids"].tolist()
    assert torch.equal(p.tags, want["token_tags"].long())
