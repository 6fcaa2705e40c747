"""`h3direct inspect`: config vs ComfyUI's recorded detection, layouts, anomalies, header-only reads."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import malformed
import pytest
from malformed import TINY, TINY_CURVE, T, h3_tensors, nvfp4_tensors, write

from h3direct.app.cli import main
from h3direct.checkpoint.safetensors_header import read_header, validate
from h3direct.errors import H3Error
from parity_tests.discovery import FIXTURES
from parity_tests.discovery import SHARED_ORACLE as SHARED

# ComfyUI's checkpoints in ../shared/oracle, and the committed ones ComfyUI recorded the fixture traces with
SHARED_CHECKPOINTS = ["h3_tiny_bf16", "h3_tiny_nvfp4", "h3_tiny_curve_bf16", "h3_tiny_curve_nvfp4"]
FIXTURE_CHECKPOINTS = ["h3_fx_bf16", "h3_fx_curve_bf16", "h3_fx_curve_nvfp4"]
CHECKPOINTS = [pytest.param(SHARED / f"{n}.safetensors", id=n, marks=pytest.mark.shared) for n in SHARED_CHECKPOINTS]
CHECKPOINTS += [pytest.param(FIXTURES / f"{n}.safetensors", id=n) for n in FIXTURE_CHECKPOINTS]
# keys of ComfyUI's unet_config_detected that are not derived from tensor shapes
IGNORED_MANIFEST_KEYS = {"image_model", "dtype"}


def inspect(path, out: Path, capsys) -> tuple[dict, dict]:
    rc = main(["inspect", str(path), "--out", str(out)])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert cap.err == ""
    summary = json.loads(cap.out)
    report = json.loads(Path(summary["report"]).read_text())
    assert Path(summary["report"]) == out / f"{Path(path).stem}.json"
    return summary, report


def kinds(report) -> set[str]:
    return {a["kind"] for a in report["anomalies"]}


def manifests_for(ckpt: Path) -> list[dict]:
    """The DiT trace manifests beside `ckpt` that ComfyUI recorded with it."""
    found = []
    for p in sorted(ckpt.parent.glob("trace_*.json")):
        m = json.loads(p.read_text())
        if m.get("checkpoint") == ckpt.name and "unet_config_detected" in m:
            found.append(m)
    return found


# ------------------------------------------------------------------ oracle checkpoints ----
@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_config_equals_comfy_unet_config_detected(ckpt, tmp_path, capsys):
    manifests = manifests_for(ckpt)
    assert manifests, f"no trace manifest records {ckpt.name}"
    summary, report = inspect(ckpt, tmp_path, capsys)
    for m in manifests:
        detected = m["unet_config_detected"]
        assert IGNORED_MANIFEST_KEYS <= set(detected)  # the ignored keys really are there
        want = {k: v for k, v in detected.items() if k not in IGNORED_MANIFEST_KEYS}
        assert summary["config"] == want
        assert report["config"] == want
        assert report["comfy_detected"] == want
    assert report["anomalies"] == []
    assert report["pdd_heads"]["count"] == 0 and "no PDD head bank" in report["pdd_heads"]["note"]


@pytest.mark.parametrize("path", CHECKPOINTS)
def test_header_matches_safetensors_library(path):
    """Names, dtypes, shapes and absolute offsets agree with the reference safetensors reader."""
    import torch
    from safetensors import safe_open

    header = read_header(path)
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(header.tensors)
        assert f.metadata() == header.metadata
        for name in f.keys():
            sl = f.get_slice(name)
            t = header.tensors[name]
            assert (sl.get_dtype(), list(sl.get_shape())) == (t.dtype, list(t.shape)), name
        with open(path, "rb") as raw:
            for name in ("rope.inv_freq", "blocks.1.mlp.fc2.weight", "final_layer.audio_out.bias"):
                t = header.tensors[name]
                raw.seek(t.offset)
                ref = f.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()
                assert raw.read(t.nbytes) == ref, name


@pytest.mark.shared
@pytest.mark.parametrize("ckpt", SHARED_CHECKPOINTS)
def test_quantized_layers_and_islands_match_checkpoint_info(ckpt, tmp_path, capsys):
    info_name = "checkpoint_info_curve.json" if "curve" in ckpt else "checkpoint_info.json"
    info = json.loads((SHARED / info_name).read_text())
    nvfp4 = "nvfp4" in ckpt
    keys = info["nvfp4_keys" if nvfp4 else "bf16_keys"]
    _, report = inspect(SHARED / f"{ckpt}.safetensors", tmp_path, capsys)
    if nvfp4:
        q = report["quantized"]["nvfp4"]
        assert sorted(e["layer"] for e in q["layers"]) == sorted(info["nvfp4_quantized_layers"])
        for e in q["layers"]:
            assert e["scales_checked_finite"]
            assert e["logical_shape"] == info["bf16_keys"][e["layer"] + ".weight"][1]
            for suffix, c in e["companions"].items():
                assert c["shape"] == keys[f"{e['layer']}.{suffix}"][1]
    else:
        assert report["quantized"] == {}
    # the fp32 island: every float32 tensor that is not an NVFP4 companion (README: patch projections,
    # time embedder or curve table + adaLN linears, output heads, rope.inv_freq)
    want = sorted(k for k, (dt, _) in keys.items() if dt == "float32" and not k.endswith(".weight_scale_2"))
    assert report["islands"]["bulk_dtype"] == "bfloat16"
    assert [t["name"] for t in report["islands"]["tensors"]] == want
    assert sum(report["bytes_by_format"].values()) == report["file_size"] - 8 - report["header_len"]


# ------------------------------------------------------------------ synthetic headers ----
SYNTH = dict(hidden_size=96, num_layers=3, token_refiner_num_layers=2, num_attention_heads=6, attention_head_dim=16,
             ffn_hidden_size=160, latents_dim=8, audio_latents_dim=12, text_dim=40, timestep_input_dim=32,
             time_embed_hidden_size=80, time_embed_dim=48, rope_inv_freq_len=2)
SYNTH_CURVE = {**{k: v for k, v in SYNTH.items() if k not in ("timestep_input_dim", "time_embed_hidden_size")},
               "time_embed_dim": 4, "adaln_curve_grid": 17}
COMFY_ORDER = ["num_layers", "token_refiner_num_layers", "hidden_size", "latents_dim", "audio_latents_dim",
               "attention_head_dim", "num_attention_heads", "ffn_hidden_size", "text_dim", "adaln_curve_grid",
               "timestep_input_dim", "time_embed_hidden_size", "time_embed_dim", "rope_inv_freq_len"]

SYNTH_CASES = {
    "3blocks_6heads": (SYNTH, ()),
    "curve_grid17": (SYNTH_CURVE, ()),
    # ComfyUI's own defaults have heads x head_dim (7168) != hidden (5376): inner width is free
    "inner_ne_hidden": ({**SYNTH, "num_attention_heads": 8}, ()),
    # padded NVFP4: qkv N=288 -> 384 scale rows, fc2 K=160 -> 10 blocks -> 12 scale columns
    "nvfp4_padded": (SYNTH, malformed.quant_layer_names(SYNTH)),
}


@pytest.mark.parametrize("name", list(SYNTH_CASES))
def test_synthetic_config_generalises(name, tmp_path, capsys):
    cfg, quant = SYNTH_CASES[name]
    path = write(tmp_path / f"{name}.safetensors", h3_tensors(cfg, nvfp4=quant))
    summary, report = inspect(path, tmp_path / "out", capsys)
    assert summary["config"] == {k: cfg[k] for k in COMFY_ORDER if k in cfg}
    assert list(summary["config"]) == [k for k in COMFY_ORDER if k in cfg]  # ComfyUI's field order
    assert report["anomalies"] == []
    assert summary["quantized"] == ({"nvfp4": len(quant)} if quant else {})


@pytest.mark.shared
def test_builder_matches_oracle_key_table():
    """The synthetic H3 builder reproduces the oracle's own key / dtype / shape tables."""
    dt = {"BF16": "bfloat16", "F32": "float32", "U8": "uint8", "F8_E4M3": "float8_e4m3fn"}
    for cfg, info_name in ((TINY, "checkpoint_info.json"), (TINY_CURVE, "checkpoint_info_curve.json")):
        info = json.loads((SHARED / info_name).read_text())
        for table, quant in (("bf16_keys", ()), ("nvfp4_keys", tuple(info["nvfp4_quantized_layers"]))):
            ours = {t.name: [dt[t.dtype], list(t.shape)] for t in h3_tensors(cfg, nvfp4=quant)}
            assert ours == info[table], (info_name, table)


# ------------------------------------------------------------------ anomalies ----
def _with(cfg=SYNTH, quant=(), edit=None):
    ts = h3_tensors(cfg, nvfp4=quant)
    return edit(ts) if edit else ts


def _rename_block(ts, old, new):
    return [T(t.name.replace(f"blocks.{old}.", f"blocks.{new}.", 1) if t.name.startswith(f"blocks.{old}.") else t.name,
              t.dtype, t.shape, t.data) for t in ts]


def _unmarked_quant(ts):
    ts = [t for t in ts if t.name != "blocks.0.mlp.fc2.weight"]
    return ts + [t for t in nvfp4_tensors("blocks.0.mlp.fc2", 96, 160) if not t.name.endswith("comfy_quant")]


ANOMALY_CASES = {
    "text_dim_equals_hidden": lambda: _with({**SYNTH, "text_dim": 96}),
    "rope_wider_than_head": lambda: _with({**SYNTH, "rope_inv_freq_len": 3}),  # 18 > 16
    "qkv_not_thirds": lambda: _with(edit=lambda ts: malformed.replace(ts, "blocks.1.attn.qkv_proj.weight",
                                                                      shape=(3 * 96 + 2, 96))),
    "quantized_condition_proj": lambda: _with(quant=("condition_proj",)),
    "missing_companion": lambda: _with(edit=_unmarked_quant),
    "block_index_gap": lambda: _with(edit=lambda ts: _rename_block(ts, 2, 3)),
    "unexpected_keys": lambda: _with(edit=lambda ts: ts + [T("pdd_heads.0.proj.weight", "BF16", (4, 96))]),
    "shape_mismatch": lambda: _with(edit=lambda ts: malformed.replace(ts, "blocks.1.norm2.weight", shape=(97,))),
    "missing_keys": lambda: _with(edit=lambda ts: malformed.drop(ts, "blocks.1.attn.k_norm.weight")),
}


def test_clean_synthetic_has_none_of_the_anomalies(tmp_path, capsys):
    _, report = inspect(write(tmp_path / "clean.safetensors", _with()), tmp_path, capsys)
    assert not kinds(report) & set(ANOMALY_CASES)


@pytest.mark.parametrize("kind", list(ANOMALY_CASES))
def test_anomaly_is_reported_not_an_error(kind, tmp_path, capsys):
    path = write(tmp_path / f"{kind}.safetensors", ANOMALY_CASES[kind]())
    summary, report = inspect(path, tmp_path, capsys)
    assert kind in kinds(report), report["anomalies"]
    assert any(a.startswith(f"{kind}:") for a in summary["anomalies"])
    if kind == "quantized_condition_proj":
        # what ComfyUI derives from the packed [96, 48/2] storage (K=40 padded to 48, two codes per byte)
        assert summary["config"]["text_dim"] == 24
    if kind == "block_index_gap":  # ComfyUI stops counting at the first missing index
        assert summary["config"]["num_layers"] == report["comfy_detected"]["num_layers"] == 2
    if kind == "rope_wider_than_head":  # H3Config refuses it: reported, the key check skipped, not an error
        assert "config_rejected" in kinds(report)
    if kind == "unexpected_keys":
        assert report["pdd_heads"] == {**report["pdd_heads"], "count": 0, "pdd_keys": ["pdd_heads.0.proj.weight"]}


# ------------------------------------------------------------------ header-only reads ----
FULL_CURVE = dict(hidden_size=5376, num_layers=50, token_refiner_num_layers=2, num_attention_heads=56,
                  attention_head_dim=128, ffn_hidden_size=14336, latents_dim=24, audio_latents_dim=32, text_dim=5120,
                  time_embed_dim=8, adaln_curve_grid=1025, rope_inv_freq_len=16)


class _CountingFile:
    def __init__(self, f, log):
        self._f, self._log = f, log

    def read(self, n=-1):
        pos = self._f.tell()
        data = self._f.read(n)
        self._log.append((pos, len(data)))
        return data

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


@pytest.mark.parametrize("quant", [True, False], ids=["nvfp4", "bf16"])
def test_huge_sparse_checkpoint_reads_only_the_header(quant, tmp_path, capsys, monkeypatch):
    names = malformed.quant_layer_names(FULL_CURVE) if quant else ()
    ts = h3_tensors(FULL_CURVE, nvfp4=names, real_nvfp4=False)
    path = write(tmp_path / "huge.safetensors", ts, sparse=True)
    header = read_header(path)
    assert header.file_size > 11e9 and header.tensors["blocks.49.mlp.fc1.weight"].nbytes > 70e6

    log: list[tuple[int, int]] = []
    real_open = builtins.open

    def counting_open(file, mode="r", *a, **kw):
        f = real_open(file, mode, *a, **kw)
        if Path(file) == path and "r" in mode:
            return _CountingFile(f, log)
        return f

    monkeypatch.setattr(builtins, "open", counting_open)
    summary, report = inspect(path, tmp_path / "out", capsys)
    monkeypatch.undo()
    assert summary["config"]["num_layers"] == 50 and summary["config"]["hidden_size"] == 5376

    head = 8 + header.header_len
    small = [(t.offset, t.offset + t.nbytes) for t in header.tensors.values() if t.nbytes <= 64 * 1024]
    for pos, n in log:
        inside_header = pos + n <= head
        inside_small = any(a <= pos and pos + n <= b for a, b in small)
        assert inside_header or inside_small, f"read of {n} bytes at {pos} touches a payload"
    total = sum(n for _, n in log)
    if quant:
        assert summary["quantized"] == {"nvfp4": len(names)}
        assert head < total < head + 1024 * 1024
    else:
        assert total == head  # exactly the length prefix and the JSON header


def test_validate_is_reusable_on_a_parsed_header(tmp_path):
    """read_header(check=False) + validate() is the loader's two-step path."""
    ts = h3_tensors(SYNTH)
    h = malformed.header_dict(ts)
    h["rope.inv_freq"]["dtype"] = "F64"  # 2 x 8 bytes claimed over an 8-byte span
    path = write(tmp_path / "bad.safetensors", ts, header=h)
    header = read_header(path, check=False)
    assert header.tensors["rope.inv_freq"].expected_nbytes == 16
    with pytest.raises(H3Error, match=r"rope.inv_freq.*F64.*= 16 bytes.*span 8"):
        validate(header)


# ------------------------------------------------------------------ other layouts ----
def test_the_report_file_is_written_only_with_out(tmp_path, capsys, monkeypatch):
    """Without --out, inspect writes nothing (the summary says `report: null`); with it, DIR/<stem>.json."""
    path = write(tmp_path / "plain.safetensors", h3_tensors(SYNTH))
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["report"] is None and summary["tensors"] > 0
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["plain.safetensors"]
    assert main(["inspect", str(path), "--out", "reports"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert Path(summary["report"]) == Path("reports/plain.json")
    assert json.loads((tmp_path / "reports" / "plain.json").read_text())["file"] == str(path.resolve())
    assert main(["inspect", "--help"]) == 0
    assert "only with --out" in " ".join(capsys.readouterr().out.split())


def test_prefix_and_quantization_metadata(tmp_path, capsys):
    """ComfyUI strips `model.diffusion_model.` and accepts the layer table in `_quantization_metadata`."""
    quant = malformed.quant_layer_names(SYNTH)[:4]
    ts = [T("model.diffusion_model." + t.name, t.dtype, t.shape, t.data)
          for t in h3_tensors(SYNTH, nvfp4=quant) if not t.name.endswith(".comfy_quant")]
    meta = {"_quantization_metadata": json.dumps({"layers": {q: {"format": "nvfp4"} for q in quant}})}
    summary, report = inspect(write(tmp_path / "prefixed.safetensors", ts, meta), tmp_path, capsys)
    assert report["key_prefix"] == "model.diffusion_model."
    assert summary["config"] == {k: SYNTH[k] for k in COMFY_ORDER if k in SYNTH}
    assert summary["quantized"] == {"nvfp4": 4}
    assert report["anomalies"] == []


def test_int8_fp8_mxfp8_layers(tmp_path, capsys):
    """int8 tensorwise (+ConvRot), float8 scaled and MXFP8 (bytes from comfy-kitchen) with their companions."""
    import struct

    import torch
    from comfy_kitchen.tensor import TensorCoreMXFP8Layout

    q, p = TensorCoreMXFP8Layout.quantize(torch.randn(320, 96).to(torch.bfloat16))
    raw = lambda x: x.contiguous().view(torch.uint8).numpy().tobytes()  # noqa: E731
    swap = {
        "blocks.0.attn.qkv_proj": [T("blocks.0.attn.qkv_proj.weight", "I8", (288, 96)),
                                   T("blocks.0.attn.qkv_proj.weight_scale", "F32", (), struct.pack("<f", 0.01)),
                                   malformed.marker("blocks.0.attn.qkv_proj", {"format": "int8_tensorwise"})],
        "blocks.0.mlp.fc2": [T("blocks.0.mlp.fc2.weight", "I8", (96, 160)),
                             T("blocks.0.mlp.fc2.weight_scale", "F32", (96, 1), struct.pack("<f", 0.01) * 96),
                             malformed.marker("blocks.0.mlp.fc2", {"format": "int8_tensorwise", "convrot": True,
                                                                   "convrot_groupsize": 16})],
        "blocks.0.attn.out_proj": [T("blocks.0.attn.out_proj.weight", "F8_E4M3", (96, 96)),
                                   T("blocks.0.attn.out_proj.weight_scale", "F32", (), struct.pack("<f", 0.02)),
                                   malformed.marker("blocks.0.attn.out_proj", {"format": "float8_e4m3fn"})],
        "blocks.0.mlp.fc1": [T("blocks.0.mlp.fc1.weight", "F8_E4M3", tuple(q.shape), raw(q)),
                             T("blocks.0.mlp.fc1.weight_scale", "F8_E8M0", tuple(p.scale.shape), raw(p.scale)),
                             malformed.marker("blocks.0.mlp.fc1", {"format": "mxfp8"})],
    }
    ts = [t for t in h3_tensors(SYNTH) if t.name.removesuffix(".weight") not in swap]
    ts += [t for layer in swap.values() for t in layer]
    summary, report = inspect(write(tmp_path / "mixed.safetensors", ts), tmp_path, capsys)
    assert summary["quantized"] == {"float8_e4m3fn": 1, "int8_tensorwise": 2, "mxfp8": 1}
    assert report["anomalies"] == []
    fc2 = next(e for e in report["quantized"]["int8_tensorwise"]["layers"] if e["layer"] == "blocks.0.mlp.fc2")
    assert fc2["options"]["convrot"] is True and fc2["options"]["convrot_groupsize"] == 16
    # a wrong MXFP8 scale shape (un-tiled [320, 3]) is an error
    bad = malformed.replace(ts, "blocks.0.mlp.fc1.weight_scale", shape=(320, 3), data=bytes(960))
    assert main(["inspect", str(write(tmp_path / "bad_mx.safetensors", bad)), "--out", str(tmp_path)]) == 2
    assert "block-scale shape" in capsys.readouterr().err
