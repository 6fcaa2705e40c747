"""Test helper: write synthetic safetensors files (valid H3 DiTs and a corpus of malformed ones).

Independent of `h3direct`: the safetensors writer is written here from the format description, the H3 key
table from ComfyUI's `MiniMaxH3Model` constructor (checked against the oracle's own tiny files in
`test_inspect.py`), and NVFP4 layers are quantized by comfy-kitchen itself (`TensorCoreNVFP4Layout`).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I16": 16, "F16": 16,
        "BF16": 16, "I32": 32, "F32": 32, "I64": 64, "F64": 64}

# (hidden, layers, refiner, heads, head_dim, ffn, latents, audio, text, tin, teh, tdim, rope, curve grid)
TINY = dict(hidden_size=128, num_layers=2, token_refiner_num_layers=1, num_attention_heads=4,
            attention_head_dim=32, ffn_hidden_size=256, latents_dim=24, audio_latents_dim=32, text_dim=96,
            timestep_input_dim=64, time_embed_hidden_size=128, time_embed_dim=64, rope_inv_freq_len=4)
TINY_CURVE = {**{k: v for k, v in TINY.items() if k not in ("timestep_input_dim", "time_embed_hidden_size")},
              "time_embed_dim": 8, "adaln_curve_grid": 33}
QUANT_LINEARS = ("attn.qkv_proj", "attn.out_proj", "mlp.fc1", "mlp.fc2")


@dataclass
class T:
    """One tensor to write: raw bytes, or None for zeros (sparse when the writer is asked to)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * BITS[self.dtype] // 8


@dataclass
class Layout:
    tensors: list[T]
    metadata: dict | None = None
    extra: dict = field(default_factory=dict)


def header_dict(tensors: list[T], metadata=None) -> dict:
    h, off = {}, 0
    if metadata is not None:
        h["__metadata__"] = metadata
    for t in tensors:
        h[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
        off += t.nbytes
    return h


def write(path: Path, tensors: list[T], metadata=None, *, header: dict | None = None, header_bytes: bytes | None = None,
          sparse: bool = False, cut: int = 0, extra: bytes = b"") -> Path:
    """Write a safetensors file. `header`/`header_bytes` override the computed header (to corrupt it),
    `sparse` leaves zero payload as holes (f.truncate), `cut` drops trailing bytes, `extra` appends bytes."""
    if header_bytes is None:
        header_bytes = json.dumps(header if header is not None else header_dict(tensors, metadata)).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)) + header_bytes)
        start, off = f.tell(), 0
        for t in tensors:
            if t.data is not None:
                assert len(t.data) == t.nbytes, (t.name, len(t.data), t.nbytes)
                f.seek(start + off)
                f.write(t.data)
            elif not sparse:
                f.seek(start + off)
                f.write(bytes(t.nbytes))
            off += t.nbytes
        f.truncate(start + off - cut)
        if extra:
            f.seek(0, 2)
            f.write(extra)
    return path


def h3_tensors(c: dict, *, dtype: str = "BF16", nvfp4: tuple[str, ...] = (), real_nvfp4: bool = True) -> list[T]:
    """The tensors of a ComfyUI MiniMaxH3Model with config `c` (ComfyUI key names, its fp32 island).

    `nvfp4`: layer names stored as ComfyUI mixed-precision NVFP4; their bytes come from comfy-kitchen's own
    quantizer when `real_nvfp4` (small configs), else only the tiny companions get real bytes.
    """
    h, hd, heads, ffn = c["hidden_size"], c["attention_head_dim"], c["num_attention_heads"], c["ffn_hidden_size"]
    inner, tdim, vdim, adim = heads * hd, c["time_embed_dim"], c["latents_dim"] * 4, c["audio_latents_dim"]
    curve = "adaln_curve_grid" in c
    adaln_dt = "F32" if curve else dtype
    out: list[T] = []

    def lin(name, n, k, dt, bias=False):
        if name in nvfp4:
            out.extend(nvfp4_tensors(name, n, k, real=real_nvfp4))
        else:
            out.append(T(f"{name}.weight", dt, (n, k)))
        if bias:
            out.append(T(f"{name}.bias", dt, (n,)))

    lin("video_patch_proj", h, vdim, "F32", bias=True)
    lin("audio_patch_proj", h, adim, "F32", bias=True)
    lin("condition_proj", h, c["text_dim"], dtype, bias=True)
    if curve:
        out.append(T("adaln_t_table", "F32", (c["adaln_curve_grid"], tdim)))
    else:
        lin("time_embedder.proj_in", c["time_embed_hidden_size"], c["timestep_input_dim"], "F32", bias=True)
        lin("time_embedder.proj_out", tdim, c["time_embed_hidden_size"], "F32", bias=True)
    out.append(T("rope.inv_freq", "F32", (c["rope_inv_freq_len"],)))

    def block(p):
        out.extend([T(f"{p}.norm1.weight", dtype, (h,)), T(f"{p}.norm2.weight", dtype, (h,)),
                    T(f"{p}.attn.q_norm.weight", dtype, (hd,)), T(f"{p}.attn.k_norm.weight", dtype, (hd,))])
        lin(f"{p}.attn.qkv_proj", 3 * inner, h, dtype)
        lin(f"{p}.attn.out_proj", h, inner, dtype)
        lin(f"{p}.mlp.fc1", 2 * ffn, h, dtype)
        lin(f"{p}.mlp.fc2", h, ffn, dtype)

    for i in range(c["token_refiner_num_layers"]):
        block(f"token_refiner.blocks.{i}")
    out.append(T("token_refiner.final_norm.weight", dtype, (h,)))
    for i in range(c["num_layers"]):
        block(f"blocks.{i}")
        lin(f"blocks.{i}.adaln_proj.linear", 6 * 3 * h, tdim, adaln_dt, bias=True)
    out.append(T("final_layer.norm.weight", dtype, (h,)))
    lin("final_layer.adaln_proj.linear", 2 * h, tdim, adaln_dt, bias=True)
    lin("final_layer.video_out", vdim, h, "F32", bias=True)
    lin("final_layer.audio_out", adim, h, "F32", bias=True)
    return out


def marker(name: str, conf: dict) -> T:
    raw = json.dumps(conf).encode()
    return T(f"{name}.comfy_quant", "U8", (len(raw),), raw)


def nvfp4_tensors(name: str, n: int, k: int, *, real: bool = True, seed: int = 0) -> list[T]:
    """One NVFP4 linear as ComfyUI stores it, quantized by comfy-kitchen (`real`), else shapes from it."""
    import torch
    from comfy_kitchen.tensor import TensorCoreNVFP4Layout

    if real:
        g = torch.Generator().manual_seed(seed + n * 7 + k)
        w = torch.randn(n, k, generator=g).to(torch.bfloat16)
        q, p = TensorCoreNVFP4Layout.quantize(w)
        qb = q.contiguous().view(torch.uint8).numpy().tobytes()
        sb = p.block_scale.contiguous().view(torch.uint8).numpy().tobytes()
        gb = p.scale.reshape(()).to(torch.float32).numpy().tobytes()
        return [T(f"{name}.weight", "U8", tuple(q.shape), qb),
                T(f"{name}.weight_scale", "F8_E4M3", tuple(p.block_scale.shape), sb),
                T(f"{name}.weight_scale_2", "F32", (), gb), marker(name, {"format": "nvfp4"})]
    # big (sparse) layers: the storage shape formula of comfy-kitchen, checked by the real path above
    rup = lambda x, m: -(-x // m) * m  # noqa: E731
    n16, k16 = rup(n, 16), rup(k, 16)
    return [T(f"{name}.weight", "U8", (n16, k16 // 2)),
            T(f"{name}.weight_scale", "F8_E4M3", (rup(n16, 128), rup(k16 // 16, 4))),
            T(f"{name}.weight_scale_2", "F32", (), struct.pack("<f", 0.01)), marker(name, {"format": "nvfp4"})]


def quant_layer_names(c: dict) -> tuple[str, ...]:
    blocks = [f"blocks.{i}" for i in range(c["num_layers"])]
    blocks += [f"token_refiner.blocks.{i}" for i in range(c["token_refiner_num_layers"])]
    return tuple(f"{b}.{lin}" for b in blocks for lin in QUANT_LINEARS)


def replace(tensors: list[T], name: str, **kw) -> list[T]:
    out = []
    for t in tensors:
        if t.name == name:
            t = T(kw.get("name", t.name), kw.get("dtype", t.dtype), tuple(kw.get("shape", t.shape)),
                  kw.get("data", t.data))
        out.append(t)
    return out


def drop(tensors: list[T], *names: str) -> list[T]:
    return [t for t in tensors if t.name not in names]


# ------------------------------------------------------------------ the malformed corpus ----
@dataclass(frozen=True)
class Case:
    """One malformed file: `write(path)` creates it; `fragment` must appear in the error line.

    `safetensors_level` marks files broken at the safetensors level (the `safetensors` library itself must
    refuse them too); the others are valid safetensors files whose H3 / quantization content is broken.
    """

    name: str
    fragment: str
    safetensors_level: bool
    write: callable


def corpus() -> list[Case]:
    """The malformed corpus (nothing is written until a case's `write` is called)."""
    small = dict(TINY, hidden_size=96, num_attention_heads=6, attention_head_dim=16, ffn_hidden_size=96,
                 text_dim=48, num_layers=1, token_refiner_num_layers=1, time_embed_hidden_size=96,
                 time_embed_dim=32, timestep_input_dim=32, rope_inv_freq_len=2)
    base = h3_tensors(small)
    q = h3_tensors(small, nvfp4=("blocks.0.attn.out_proj",))
    hb = json.dumps(header_dict(base)).encode()
    cases: list[Case] = []

    def case(name, frag, st_level):
        def deco(fn):
            cases.append(Case(name, frag, st_level, fn))
            return fn
        return deco

    @case("empty.safetensors", "too short", True)
    def _(p):
        p.write_bytes(b"")

    @case("short_length.safetensors", "too short", True)
    def _(p):
        p.write_bytes(b"\x10\x00\x00")

    @case("truncated_payload.safetensors", "truncated payload", True)
    def _(p):
        write(p, base, cut=100)

    @case("header_len_past_eof.safetensors", "past the end of the file", True)
    def _(p):
        p.write_bytes(struct.pack("<Q", 10_000) + hb[:200])

    @case("header_len_huge.safetensors", "exceeds the safetensors limit", True)
    def _(p):
        p.write_bytes(struct.pack("<Q", 2**62) + hb)

    @case("invalid_utf8.safetensors", "not valid UTF-8", True)
    def _(p):
        write(p, base, header_bytes=hb[:20] + b"\xff\xfe" + hb[22:])

    @case("invalid_json.safetensors", "not valid JSON", True)
    def _(p):
        write(p, base, header_bytes=hb[:-1] + b",")

    @case("json_not_object.safetensors", "expected an object", True)
    def _(p):
        write(p, [], header_bytes=b"[1, 2, 3]")

    @case("negative_offset.safetensors", "negative data_offsets", True)
    def _(p):
        h = header_dict(base)
        h["rope.inv_freq"]["data_offsets"][0] = -8
        write(p, base, header=h)

    @case("negative_dim.safetensors", "negative dimension", True)
    def _(p):
        h = header_dict(base)
        h["rope.inv_freq"]["shape"] = [-2]
        write(p, base, header=h)

    @case("offsets_out_of_order.safetensors", "out of order", True)
    def _(p):
        h = header_dict(base)
        b, e = h["condition_proj.bias"]["data_offsets"]
        h["condition_proj.bias"]["data_offsets"] = [e, b]
        write(p, base, header=h)

    @case("overlap.safetensors", "overlap", True)
    def _(p):
        h = header_dict(base)
        b, e = h["condition_proj.bias"]["data_offsets"]  # shift one tensor back into its neighbour
        h["condition_proj.bias"]["data_offsets"] = [b - 4, e - 4]
        write(p, base, header=h)

    @case("gap.safetensors", "gap of", True)
    def _(p):
        h = header_dict(base)
        for v in h.values():  # every tensor after condition_proj.bias moves 8 bytes further
            if v["data_offsets"][0] >= h["condition_proj.bias"]["data_offsets"][1]:
                v["data_offsets"] = [v["data_offsets"][0] + 8, v["data_offsets"][1] + 8]
        write(p, base, header=h, extra=bytes(8))

    @case("dtype_size_mismatch.safetensors", "span", True)
    def _(p):
        h = header_dict(base)
        h["condition_proj.bias"]["dtype"] = "F32"  # 96 x 4 bytes claimed over a 96 x 2 byte span
        write(p, base, header=h)

    @case("unknown_dtype.safetensors", "unknown dtype", True)
    def _(p):
        h = header_dict(base)
        h["condition_proj.bias"]["dtype"] = "BF17"
        write(p, base, header=h)

    @case("metadata_not_str.safetensors", "__metadata__", True)
    def _(p):
        write(p, base, metadata={"config": {"nested": 1}})

    @case("trailing_bytes.safetensors", "trailing bytes", True)
    def _(p):
        write(p, base, extra=b"\0" * 16)

    @case("missing_field.safetensors", "lacks data_offsets", True)
    def _(p):
        h = header_dict(base)
        del h["rope.inv_freq"]["data_offsets"]
        write(p, base, header=h)

    @case("duplicate_key.safetensors", "duplicate key", False)
    def _(p):
        text = json.dumps(header_dict(base))
        dup = '"rope.inv_freq": ' + json.dumps(header_dict(base)["rope.inv_freq"])
        write(p, base, header_bytes=(text[:-1] + ", " + dup + "}").encode())

    @case("not_h3.safetensors", "not an H3 DiT", False)
    def _(p):
        write(p, [T("model.layers.0.weight", "F32", (4, 4)), T("model.layers.0.bias", "F32", (4,))])

    @case("h3_missing_rope.safetensors", "missing rope.inv_freq", False)
    def _(p):
        write(p, drop(base, "rope.inv_freq"))

    @case("nvfp4_missing_scale.safetensors", "missing its weight_scale", False)
    def _(p):
        write(p, drop(q, "blocks.0.attn.out_proj.weight_scale"))

    @case("nvfp4_missing_scale_2.safetensors", "missing its weight_scale_2", False)
    def _(p):
        write(p, drop(q, "blocks.0.attn.out_proj.weight_scale_2"))

    @case("nvfp4_wrong_scale_shape.safetensors", "block-scale shape", False)
    def _(p):  # un-tiled [N, K/16] = [96, 6] instead of the padded [128, 8]
        write(p, replace(q, "blocks.0.attn.out_proj.weight_scale", shape=(96, 6), data=bytes(96 * 6)))

    @case("nvfp4_nan_block_scale.safetensors", "NaN/Inf", False)
    def _(p):
        s = next(t for t in q if t.name == "blocks.0.attn.out_proj.weight_scale")
        write(p, replace(q, s.name, data=b"\x7f" + s.data[1:]))

    @case("nvfp4_nan_global_scale.safetensors", "NaN/Inf", False)
    def _(p):
        write(p, replace(q, "blocks.0.attn.out_proj.weight_scale_2", data=struct.pack("<f", float("nan"))))

    @case("nvfp4_bf16_weight.safetensors", "weight must be 2-D U8", False)
    def _(p):
        w = next(t for t in q if t.name == "blocks.0.attn.out_proj.weight")
        write(p, replace(q, w.name, dtype="BF16", shape=(96, 48), data=None))

    @case("unknown_quant_format.safetensors", "unknown quantization format", False)
    def _(p):
        write(p, [marker("blocks.0.attn.out_proj", {"format": "nvfp3"}) if t.name.endswith("comfy_quant") else t
                  for t in q])

    @case("comfy_quant_not_json.safetensors", "not UTF-8 JSON", False)
    def _(p):
        write(p, [T(t.name, "U8", (5,), b"nvfp4") if t.name.endswith("comfy_quant") else t for t in q])

    @case("int8_convrot_bad_group.safetensors", "ConvRot group size", False)
    def _(p):  # out_proj K = 96 is not a multiple of the default 256 group
        ts = [t for t in base if t.name != "blocks.0.attn.out_proj.weight"]
        ts += [T("blocks.0.attn.out_proj.weight", "I8", (96, 96)),
               T("blocks.0.attn.out_proj.weight_scale", "F32", (96, 1), struct.pack("<f", 0.1) * 96),
               marker("blocks.0.attn.out_proj", {"format": "int8_tensorwise", "convrot": True})]
        write(p, ts)

    return cases


def build_corpus(d: Path) -> list[tuple[Path, Case]]:
    """Write every malformed file into `d`."""
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for c in corpus():
        c.write(d / c.name)
        out.append((d / c.name, c))
    return out
