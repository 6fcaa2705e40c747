"""Qwen3-VL vision path of the text encoder: unit facts, and parity with ComfyUI's own MiniMax H3 encoder.

The `comfy` tests run ComfyUI's `MiniMaxH3TEModel` + `MiniMaxH3Tokenizer` (imported from the run's ComfyUI checkout in
a child process, CPU, fp32) with a tiny config and the same random weights as ours, and compare the last
layer's states and token tags for a text-only prompt, a Ref2VA presentation with one image, and one with a
3-frame reference video (two 2-frame blocks, the second padded by repetition), and an NVFP4 + AWQ
(`pre_quant_scale`) file loaded through ComfyUI's mixed-precision ops.
"""

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from h3direct.sampling.conditioning import PresentationItem
from h3direct.text import load as hl
from h3direct.text import presentation as hp
from h3direct.text import qwen as hq
from h3direct.text import vision as qv

try:
    import comfy_goldens as goldens
except ImportError:
    from tests import comfy_goldens as goldens

# rel-L2 bounds of this file, with where they come from
TOLERANCES = {
    # ours vs ComfyUI, both fp32 on the CPU with identical weights: only summation order / fused-op
    # rounding differs (measured ≤ 3e-7 over the three cases); the brief's gate is 1e-5
    ("comfy_parity", "fp32"): 1e-5,
}


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def char_tok(s: str) -> list:
    return [ord(c) for c in s]


# ---- preprocessing and positions (independent re-derivations) ---------------------------------

@pytest.mark.parametrize("hw", [(64, 96), (70, 100), (20, 20), (544, 960)], ids=str)
def test_patchify_grid_and_token_count(hw):
    h, w = hw
    frames = torch.rand(1, h, w, 3)
    patches, grid = qv.patchify(frames)
    hh, ww = qv.qwen_resize(h, w)
    assert hh % 32 == 0 and ww % 32 == 0 and hh * ww >= qv.MIN_PIXELS
    if hh * ww > qv.MIN_PIXELS and (h * w) >= qv.MIN_PIXELS:
        assert (hh, ww) == (round(h / 32) * 32, round(w / 32) * 32)
    assert grid == (1, hh // 16, ww // 16)
    assert patches.shape == (grid[1] * grid[2], 3 * 2 * 16 * 16)
    assert hp.vision_pad_count(h, w) == (hh // 32) * (ww // 32) == patches.shape[0] // 4


def test_patch_layout_matches_direct_indexing():
    # row r of the patches = merge block (bh, bw), cell (mh, mw); columns = (channel, frame, py, px)
    frames = torch.rand(2, 64, 96, 3)
    patches, (_, gh, gw) = qv.patchify(frames)
    img = (frames.permute(0, 3, 1, 2) - 0.5) / 0.5  # already a multiple of 32: no resize
    for r in (0, 5, 17, patches.shape[0] - 1):
        bidx, cell = divmod(r, 4)
        bh, bw = divmod(bidx, gw // 2)
        mh, mw = divmod(cell, 2)
        py, px = (2 * bh + mh) * 16, (2 * bw + mw) * 16
        want = img[:, :, py : py + 16, px : px + 16].permute(1, 0, 2, 3).reshape(-1)  # (c, t, y, x)
        assert torch.allclose(patches[r], want, atol=1e-6)


def test_image_repeats_its_frame_in_the_temporal_patch():
    img = torch.rand(1, 64, 64, 3)
    p1, _ = qv.patchify(img)
    p2, _ = qv.patchify(img.expand(2, -1, -1, -1))
    assert torch.equal(p1, p2)


def test_mrope_positions_by_hand():
    # 2 text, a 2x3 block, 1 text, a 1x2 block, 2 text
    pos = hq.mrope_positions(2 + 6 + 1 + 2 + 2, [(2, 2, 3), (9, 1, 2)])
    t, h, w = pos.tolist()
    assert t == [0, 1, 2, 2, 2, 2, 2, 2, 5, 6, 6, 8, 9]
    assert h == [0, 1, 2, 2, 2, 3, 3, 3, 5, 6, 6, 8, 9]
    assert w == [0, 1, 2, 3, 4, 2, 3, 4, 5, 6, 7, 8, 9]


def test_rope_interleaves_h_and_w_frequencies():
    cfg = hq.PRESETS["qwen3vl_32b"]
    pos = torch.tensor([[3.0], [5.0], [7.0]])
    cos, _ = hq.rope_cos_sin(cfg, pos)
    inv = 1.0 / (5000000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    axis = [1 if (j % 3 == 1 and j < 60) else 2 if (j % 3 == 2 and j < 60) else 0 for j in range(64)]
    want = torch.tensor([math.cos(pos[a, 0].item() * inv[j].item()) for j, a in enumerate(axis)])
    assert torch.allclose(cos[0, :64].double(), want.double(), atol=1e-5)
    assert torch.equal(cos[0, :64], cos[0, 64:])


def test_vision_tower_shapes_and_deepstack():
    enc = hq.make_tiny_text_encoder(1, vision=True)
    out = enc.visual.encode_frames(torch.rand(1, 70, 100, 3))
    n = hp.vision_pad_count(70, 100)
    assert out.merged.shape == (n, 96) and len(out.deepstack) == 2
    assert all(d.shape == (n, 96) for d in out.deepstack)


def test_vision_changes_only_positions_at_and_after_the_image():
    enc = hq.make_tiny_text_encoder(2, vision=True)
    a = hp.build_presentation("after", [PresentationItem("image", torch.rand(1, 64, 64, 3))], char_tok)
    b = hp.build_presentation("after", [PresentationItem("image", torch.rand(1, 64, 64, 3))], char_tok)
    sa, sb = enc.encode(a).states, enc.encode(b).states
    first = a.vision[0].start
    assert torch.equal(sa[:, :first], sb[:, :first])  # causal: the label before the image is untouched
    assert not torch.allclose(sa[:, first:], sb[:, first:])


# ---- ComfyUI parity ----------------------------------------------------------------------------

COMFY_CHILD = textwrap.dedent('''
    import sys, torch
    root, work = sys.argv[1], sys.argv[2]
    sys.path.insert(0, root)
    import comfy.cli_args
    comfy.cli_args.args.cpu = True
    import comfy.text_encoders.qwen3vl as q3
    import comfy.text_encoders.minimax as mm
    from safetensors.torch import load_file, save_file
    q3.QWEN3VL_VISION["qwen3vl_32b"] = dict(hidden_size=32, intermediate_size=64, depth=3, deepstack_visual_indexes=[0, 2])
    q3.QWEN3VL_VISION_COMMON["num_heads"] = 2
    opts = {"qwen3vl_32b_model_config": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                             num_attention_heads=2, num_key_value_heads=1)}
    tok = mm.MiniMaxH3Tokenizer()
    inp = load_file(work + "/inputs.safetensors")
    out = {}
    # the NVFP4 + AWQ file, built the way comfy.sd does for a quantized text encoder
    import comfy.utils
    sdq = load_file(work + "/te_awq.safetensors")
    teq = mm.te(dtype_llama=torch.float32, llama_quantization_metadata=comfy.utils.detect_layer_quantization(sdq, ""))(
        device="cpu", dtype=torch.float32, model_options=opts)
    missing, unexpected = teq.load_sd(sdq)
    assert not missing and not unexpected, (missing[:4], unexpected[:4])
    with torch.no_grad():
        items = [{"type": "image", "data": inp["image"]}]
        z, _, _ = teq.encode_token_weights(tok.tokenize_with_weights("quantized", minimax_ref_items=items))
        out["awq.states"] = z.float().contiguous()
    te = mm.MiniMaxH3TEModel(device="cpu", dtype=torch.float32, model_options=opts)
    missing, unexpected = te.load_sd(load_file(work + "/te.safetensors"))
    assert not missing and not unexpected, (missing[:4], unexpected[:4])
    cases = {
        "text": ("a red fox jumps over the lazy dog", None),
        "image": ("the fox from picture one runs", [{"type": "image", "data": inp["image"]}, {"type": "audio"}]),
        "video": ("the clip continues", [{"type": "video", "data": inp["video"], "timestamps": [0.0, 0.5, 1.0]}]),
    }
    with torch.no_grad():
        for name, (prompt, items) in cases.items():
            z, _, extra = te.encode_token_weights(tok.tokenize_with_weights(prompt, minimax_ref_items=items))
            out[name + ".states"] = z.float().contiguous()
            out[name + ".tags"] = extra["minimax_token_tags"].contiguous()
    save_file(out, work + "/comfy_out.safetensors")
''')

COMFY_TEST_CONFIG = hq.TextEncoderConfig(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    head_dim=128, vision=qv.VisionConfig(hidden_size=32, intermediate_size=64, depth=3, num_heads=2,
                                        deepstack_visual_indexes=(0, 2), out_hidden_size=64))


AWQ_LAYERS = [f"model.layers.{i}.{m}" for i in (0, 3) for m in ("self_attn.q_proj", "mlp.gate_proj", "mlp.down_proj")]


def _awq_state_dict(enc) -> dict:
    """Our weights with AWQ_LAYERS as ComfyUI NVFP4 layers (comfy_quant marker, AWQ pre_quant_scale)."""
    from h3direct.checkpoint.quant import NVFP4_MARKER
    from h3direct.checkpoint.quant.nvfp4 import quantize_nvfp4

    g = torch.Generator().manual_seed(9)
    sd = hq.comfy_state_dict(enc)
    for layer in AWQ_LAYERS:
        w = sd.pop(f"{layer}.weight")
        s = 0.5 + torch.rand(w.shape[1], generator=g)
        q = quantize_nvfp4(w / s)
        sd.update({f"{layer}.weight": q.packed, f"{layer}.weight_scale": q.block_scale,
                   f"{layer}.weight_scale_2": q.global_scale, f"{layer}.pre_quant_scale": s,
                   f"{layer}.input_scale": torch.tensor(0.01),
                   f"{layer}.comfy_quant": torch.tensor(list(NVFP4_MARKER), dtype=torch.uint8)})
    return sd


@pytest.fixture(scope="module")
def comfy_run(tmp_path_factory, comfy_root):
    work = tmp_path_factory.mktemp("comfy_te")
    enc = hq.make_tiny_text_encoder(3, config=COMFY_TEST_CONFIG)
    save_file(hq.comfy_state_dict(enc), work / "te.safetensors")
    g = torch.Generator().manual_seed(4)
    inputs = {"image": torch.rand(1, 70, 100, 3, generator=g), "video": torch.rand(3, 64, 80, 3, generator=g)}
    save_file(inputs, work / "inputs.safetensors")
    save_file(_awq_state_dict(enc), work / "te_awq.safetensors")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-c", COMFY_CHILD, comfy_root, str(work)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return enc, inputs, load_file(str(work / "comfy_out.safetensors")), work


def _qwen_tokenize(comfy_root):
    from transformers import Qwen2Tokenizer

    qt = Qwen2Tokenizer.from_pretrained(str(Path(comfy_root) / "comfy/text_encoders/qwen25_tokenizer"))
    return lambda s: qt(s, add_special_tokens=False)["input_ids"]


@pytest.mark.comfy
@pytest.mark.parametrize("case", ["text", "image", "video"])
def test_last_layer_matches_comfy(comfy_run, case, comfy_root):
    enc, inputs, want, work = comfy_run
    # through the file loader, as the pipeline does
    enc = hl.load_text_encoder(work / "te.safetensors", config=COMFY_TEST_CONFIG)
    prompt, items = {
        "text": ("a red fox jumps over the lazy dog", []),
        "image": ("the fox from picture one runs", [PresentationItem("image", inputs["image"]), PresentationItem("audio")]),
        "video": ("the clip continues", [PresentationItem("video", inputs["video"], [0.0, 0.5, 1.0])]),
    }[case]
    got = enc.encode(hp.build_presentation(prompt, items, _qwen_tokenize(comfy_root)))
    assert torch.equal(got.tags, want[f"{case}.tags"].long())
    ref = want[f"{case}.states"]
    assert got.states.shape == ref.shape
    err = rel_l2(got.states, ref)
    print(f"{case}: rel-L2 {err:.3e} over {tuple(ref.shape)}")
    assert err <= TOLERANCES[("comfy_parity", "fp32")], f"{case}: rel-L2 {err:.3e}"
    if case != "text":  # the vision path is exercised: pads alone would give other states
        no_vision = hq.QwenTextEncoder(enc.net)
        no_vision.visual = None
        pads = no_vision.encode(hp.build_presentation(prompt, items, _qwen_tokenize(comfy_root)))
        assert rel_l2(pads.states, ref) > 100 * TOLERANCES[("comfy_parity", "fp32")]


@pytest.mark.comfy
def test_nvfp4_awq_file_matches_comfy(comfy_run, comfy_root):
    _, inputs, want, work = comfy_run
    enc = hl.load_text_encoder(work / "te_awq.safetensors", config=COMFY_TEST_CONFIG)
    assert enc.model.layers[3].mlp.down_proj.quant_format == "nvfp4"
    got = enc.encode(hp.build_presentation("quantized", [PresentationItem("image", inputs["image"])],
                                           _qwen_tokenize(comfy_root)))
    err = rel_l2(got.states, want["awq.states"])
    print(f"awq: rel-L2 {err:.3e}")
    assert err <= TOLERANCES[("comfy_parity", "fp32")], f"awq: rel-L2 {err:.3e}"


# ---------------------------------------------------------------- ComfyUI's answers, committed (CI, no ComfyUI)

CASES = {
    "text": ("a red fox jumps over the lazy dog", lambda inp: []),
    "image": ("the fox from picture one runs",
              lambda inp: [PresentationItem("image", inp["image"]), PresentationItem("audio")]),
    "video": ("the clip continues", lambda inp: [PresentationItem("video", inp["video"], [0.0, 0.5, 1.0])]),
    "awq": ("quantized", lambda inp: [PresentationItem("image", inp["image"])]),
}
TOKENS = goldens.GOLDENS / "text_encoder_tokens.yml"


@pytest.mark.comfy
def test_record_text_encoder_goldens(comfy_run, ndarrays_regression, data_regression, comfy_root):
    """ComfyUI's encoder outputs (states, tags) and its tokenizer's ids for every string the presentations ask
    for, as committed goldens (checked bit for bit; rewritten from ComfyUI with --force-regen)."""
    _, inputs, want, _ = comfy_run
    tokenize, seen = _qwen_tokenize(comfy_root), {}

    def recording(text):
        seen[text] = tokenize(text)
        return seen[text]

    for prompt, items in CASES.values():
        hp.build_presentation(prompt, items(inputs), recording)
    from parity_tests.budgets import load_budgets

    rel = load_budgets().rules["fp32_limit"]  # the fp32 rule
    goldens.record(ndarrays_regression, "text_encoder", {**want, **{f"input.{k}": v for k, v in inputs.items()}},
                   rounding={k: rel for k in want if k.endswith(".states")})
    data_regression.check({"tokens": [{"text": t, "ids": ids} for t, ids in sorted(seen.items())]}, fullpath=TOKENS)


@pytest.fixture(scope="module")
def comfy_golden(tmp_path_factory):
    import yaml

    g = goldens.load("text_encoder")
    tokens = {e["text"]: e["ids"] for e in yaml.safe_load(TOKENS.read_text())["tokens"]}
    work = tmp_path_factory.mktemp("te_golden")
    enc = hq.make_tiny_text_encoder(3, config=COMFY_TEST_CONFIG)
    save_file(hq.comfy_state_dict(enc), work / "te.safetensors")
    save_file(_awq_state_dict(enc), work / "te_awq.safetensors")
    inputs = {k.removeprefix("input."): v for k, v in g.items() if k.startswith("input.")}

    def tokenize(text):
        assert text in tokens, f"{text!r} was not tokenized by ComfyUI when the goldens were recorded"
        return list(tokens[text])

    return inputs, g, work, tokenize


@pytest.mark.parametrize("case", ["text", "image", "video", "awq"])
def test_encoder_matches_comfy_golden(comfy_golden, case):
    """Our Qwen3-VL encoder (text only, image, video, NVFP4-AWQ file) against ComfyUI's recorded states and tags."""
    inputs, want, work, tokenize = comfy_golden
    enc = hl.load_text_encoder(work / ("te_awq.safetensors" if case == "awq" else "te.safetensors"),
                                config=COMFY_TEST_CONFIG)
    prompt, items = CASES[case]
    got = enc.encode(hp.build_presentation(prompt, items(inputs), tokenize))
    if f"{case}.tags" in want:
        assert torch.equal(got.tags, want[f"{case}.tags"].long())
    ref = want[f"{case}.states"]
    assert got.states.shape == ref.shape
    err = rel_l2(got.states, ref)
    assert err <= TOLERANCES[("comfy_parity", "fp32")], f"{case}: rel-L2 {err:.3e}"
