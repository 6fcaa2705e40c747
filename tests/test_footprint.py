"""The hot runtime's footprint (`app/footprint.py`, `h3direct footprint`) against two independent counts:

- tiny files written in ComfyUI's format (the DiT by `make-checkpoint`'s writer, the text encoder from its module's
  weights, NVFP4 layers quantized here, the VAEs by their synthetic writer), loaded for real: the bytes the loaded
  models hold, counted here, and the files' tensor bytes where the loader keeps them as stored;
- full size: the bytes of the DiT and of the text encoder from their configs' shapes, by formulas written here.
"""

import json

import pytest
import torch
from safetensors.torch import save_file

from h3direct.app import cli, footprint
from h3direct.config import PRESETS
from h3direct.text import qwen
from h3direct.text.vision import VISION_PRESETS

DECODER_LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
NVFP4_SIDE = 4 + 19  # a layer's fp32 global scale and its 19-byte {"format": "nvfp4"} marker (the DiT keeps both)


def _loaded_bytes(module) -> int:
    module = getattr(module, "net", module)
    seen = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(t.numel() * t.element_size() for t in seen.values())


def _file_bytes(path) -> int:
    from h3direct.checkpoint.safetensors_header import read_header

    return sum(t.nbytes for t in read_header(path).tensors.values())


def _tiny_files(tmp_path, weights: str) -> dict:
    from h3direct.checkpoint.quant import NVFP4_MARKER
    from h3direct.checkpoint.quant.nvfp4 import quantize_nvfp4
    from h3direct.checkpoint.synthetic import write_dit_checkpoint, write_state_dict
    from h3direct.vae.synthetic import make_state_dict

    files = {c: tmp_path / f"{c}.safetensors" for c in footprint.COMPONENTS}
    write_dit_checkpoint(files["dit"], PRESETS["tiny"], quant="nvfp4" if weights == "nvfp4" else "none")
    sd = {k: v.to(torch.bfloat16) for k, v in qwen.comfy_state_dict(qwen.make_tiny_text_encoder(3)).items()}
    if weights == "nvfp4":
        for i in range(qwen.PRESETS["tiny"].num_hidden_layers):
            for name in DECODER_LINEARS:
                layer = f"model.layers.{i}.{name}"
                q = quantize_nvfp4(sd.pop(f"{layer}.weight").float())
                sd.update({f"{layer}.weight": q.packed, f"{layer}.weight_scale": q.block_scale,
                           f"{layer}.weight_scale_2": q.global_scale,
                           f"{layer}.comfy_quant": torch.tensor(list(NVFP4_MARKER), dtype=torch.uint8)})
    save_file({k: v.contiguous() for k, v in sd.items()}, str(files["text_encoder"]))
    for c in ("video_vae", "audio_vae"):
        write_state_dict(files[c], make_state_dict(c, "tiny"))
    return files


@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_loaded_tiny_models_hold_what_the_footprint_says(tmp_path, weights):
    from h3direct.app.pipeline import H3Pipeline

    files = _tiny_files(tmp_path, weights)
    pipe = H3Pipeline.from_files(files["dit"], files["video_vae"], files["audio_vae"], files["text_encoder"],
                                 tokenizer="bytes", video_vae_config="tiny", audio_vae_config="tiny",
                                 compute_dtype="bf16", vae_dtype="fp16", device="cpu")
    loaded = {"dit": pipe.dit, "video_vae": pipe.video_vae, "audio_vae": pipe.audio_vae,
              "text_encoder": pipe.text_encoder}
    held = {c: _loaded_bytes(m) for c, m in loaded.items()}
    assert footprint.of_preset("tiny", weights) == held  # the preset's shapes
    assert pipe.footprint() == held  # the files' headers
    assert pipe.text_encoder.net.model.layers[0].mlp.up_proj.weight.dtype == (
        torch.uint8 if weights == "nvfp4" else torch.bfloat16)
    assert _file_bytes(files["text_encoder"]) - held["text_encoder"] == (
        0 if weights == "bf16" else 19 * 7 * qwen.PRESETS["tiny"].num_hidden_layers)  # markers are not held
    if weights == "bf16":  # compute bf16, no quantized layer: the fp32 islands stay fp32, as stored
        assert _file_bytes(files["dit"]) == held["dit"]


def _nvfp4_bytes(n: int, k: int) -> int:
    """An NVFP4 [n, k] weight at full size (no padding: asserted), with its e4m3 block scales."""
    assert n % 128 == 0 and (k // 16) % 4 == 0 and k % 16 == 0, (n, k)
    return n * k // 2 + n * k // 16


def _dit_by_hand(c, nvfp4: bool) -> int:
    h, inner, f, hd, ted = (c.hidden_size, c.num_attention_heads * c.attention_head_dim, c.ffn_hidden_size,
                            c.attention_head_dim, c.time_embed_dim)
    patch, audio = c.latents_dim * 4, c.audio_latents_dim  # patch 1x2x2
    blocks = c.num_layers + c.token_refiner_num_layers
    block_linears = [(3 * inner, h), (h, inner), (2 * f, h), (h, f)]  # [out, in], no bias
    heads = (patch * h + h) + (audio * h + h) + (h * patch + patch) + (h * audio + audio)  # projections in and out
    adaln = c.num_layers * (ted * 18 * h + 18 * h) + (ted * 2 * h + 2 * h)  # 6 chunks x 3 rows; final: 2 chunks
    time = c.adaln_curve_grid * ted if c.is_curve else (c.timestep_input_dim * c.time_embed_hidden_size
                                                        + c.time_embed_hidden_size + c.time_embed_hidden_size * ted + ted)
    rest = blocks * (2 * h + 2 * hd) + 2 * h + (c.text_dim * h + h)  # norms, condition_proj
    rope = c.rope_inv_freq_len
    if nvfp4:  # islands held at the compute dtype; buffers (rope, curve table) fp32
        table = c.adaln_curve_grid * ted if c.is_curve else 0
        dense = heads + adaln + rest + (time - table)
        quant = blocks * sum(_nvfp4_bytes(n, k) + NVFP4_SIDE for n, k in block_linears)
        return 2 * dense + quant + 4 * (table + rope)
    linears = blocks * sum(n * k for n, k in block_linears)
    fp32 = heads + time + rope + (adaln if c.is_curve else 0)
    return 2 * (linears + rest + (0 if c.is_curve else adaln)) + 4 * fp32


def _text_encoder_by_hand(c, nvfp4: bool) -> int:
    h, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    linears = [(q, h), (kv, h), (kv, h), (h, q), (inter, h), (inter, h), (h, inter)]  # [out, in]
    per_layer = sum(n * k for n, k in linears) + 2 * hd + 2 * h  # + q/k norms, the two RMSNorms
    v = c.vision
    hv, iv, m = v.hidden_size, v.intermediate_size, 4 * v.hidden_size  # 2x2 merge
    block = 2 * 2 * hv + (hv * 3 * hv + 3 * hv) + (hv * hv + hv) + (hv * iv + iv) + (iv * hv + hv)
    merger = lambda norm: 2 * norm + (m * m + m) + (m * v.out_hidden_size + v.out_hidden_size)  # noqa: E731
    vision = ((3 * 2 * 16 * 16 * hv + hv) + v.num_position_embeddings * hv + v.depth * block + merger(hv)
              + len(v.deepstack_visual_indexes) * merger(m))
    dense = 2 * (c.vocab_size * h + c.num_hidden_layers * per_layer + vision)
    if not nvfp4:
        return dense
    per_layer_quant = sum(_nvfp4_bytes(n, k) + 4 - 2 * n * k for n, k in linears)  # the marker is not held
    return dense + c.num_hidden_layers * per_layer_quant


def _command(capsys, *flags) -> dict:
    assert cli.main(["footprint", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_full_size_weights_by_hand(capsys):
    text = qwen.PRESETS["qwen3vl_32b"]
    assert text.vision == VISION_PRESETS["qwen3vl_32b"]
    got = _command(capsys)  # the released pruned DiT (curve adaLN), both formats
    assert got["preset"] == "full-curve" and set(got["bytes"]) == {"bf16", "nvfp4"}
    full = _command(capsys, "--preset", "full", "--weights", "nvfp4")["bytes"]  # the full adaLN form
    assert set(full) == {"nvfp4"}
    for weights, table in {**got["bytes"], "full nvfp4": full["nvfp4"]}.items():
        nvfp4 = weights.endswith("nvfp4")
        config = PRESETS["full" if weights.startswith("full") else "full-curve"]
        assert table["dit"] == _dit_by_hand(config, nvfp4), weights
        assert table["text_encoder"] == _text_encoder_by_hand(text, nvfp4), weights
        assert table["total"] == sum(table[c] for c in footprint.COMPONENTS)
    assert footprint.of_preset("full", "bf16")["dit"] == _dit_by_hand(PRESETS["full"], False)


def test_the_table_and_its_one_line_errors(capsys):
    assert cli.main(["footprint", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1] == "| component | bf16 | nvfp4 |" and [r.split(" | ")[0] for r in out[3:]] == [
        f"| {c}" for c in (*footprint.COMPONENTS, "total")]
    for flags in (["--weights", "fp8"], ["--preset", "huge"], ["--bogus"]):
        assert cli.main(["footprint", *flags]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_resident_8bit_linears_are_counted_by_layer_and_format():
    """A resident 8-bit DiT holds one byte per weight of each 8-bit linear instead of NVFP4's half byte plus its
    scales: the DiT's count grows with each layer set, by the linears' weight count, and int8 holds as much as e4m3."""
    from dataclasses import replace

    from h3direct.config import H3Config

    config = H3Config.from_name("tiny")
    base = footprint.Held(compute_dtype=torch.bfloat16)
    dit = {}
    for key, fp8, layers, fmt in (("off", None, None, "e4m3"), ("fc1", "resident", "fc1", "e4m3"),
                                  ("all", "resident", None, "e4m3"), ("all int8", "resident", None, "int8")):
        held = replace(base, fp8_linear=fp8, fp8_linear_layers=layers, fp8_linear_format=fmt)
        dit[key] = footprint.of_preset("tiny", "nvfp4", held)["dit"]
    h, f = config.hidden_size, config.ffn_hidden_size
    assert dit["off"] < dit["fc1"] < dit["all"] == dit["all int8"], dit
    # fc1 (2F x H per block): 1 byte a weight and a 4-byte scale a row, instead of 0.5 byte and block scales
    assert dit["fc1"] - dit["off"] > config.num_layers * 2 * f * h * 0.4, dit
