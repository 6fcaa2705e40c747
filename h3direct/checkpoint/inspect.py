"""`h3direct inspect CHECKPOINT [--out DIR]`: validate a checkpoint header, report its H3 layout and config.

Reads the 8-byte length and the JSON header only (plus bounded reads of tiny companions: `.comfy_quant`
markers and small scale tensors checked for NaN/Inf), never a weight payload. Prints a compact JSON summary
on stdout; writes the full report to `DIR/<stem>.json` only when `--out DIR` is given (else nothing is written).

Errors (one stderr line, exit 2): a structurally broken safetensors file, a quantized layer ComfyUI cannot
load (unknown format, missing / misshapen / non-finite scale), or a file that is not an H3 DiT at all.
Everything else that looks wrong is listed under `anomalies`.

The config is `h3direct.config.shape_fields` (ComfyUI's detection; `H3Config` validates it), every key is checked
against `h3direct.checkpoint.keys.dit_keys`, every quantized layer against `h3direct.checkpoint.quant.FORMATS`.
Facts used here (read from ComfyUI 0f1fa67a and comfy-kitchen 0.2.31, not copied):
- detection (`comfy/model_detection.py`): `__metadata__["config"]["transformer"]` overrides the shape-derived
  fields; `model.diffusion_model.` style prefixes are stripped first (`comfy/sd.py`).
- quantized layers (`comfy/ops.py`, `comfy/quant_ops.py`): a `<layer>.comfy_quant` uint8 JSON marker
  (or `__metadata__["_quantization_metadata"]`, or the legacy `scaled_fp8` key) selects the format.
- storage layouts (comfy-kitchen `tensor/*.py`, `float_utils.to_blocked`): NVFP4 packs two E2M1 codes
  per byte (even element in the high nibble) into `[roundup(N,16), roundup(K,16)/2]`, block scales are
  E4M3, one per 16 values, in the cuBLAS 128x4 tiled layout `[roundup(N,128), roundup(K/16,4)]`, the
  global scale is one fp32; MXFP8 stores E4M3 `[roundup(N,32), roundup(K,32)]` with E8M0 block scales
  (one per 32) in the same tiled layout; INT8 tensorwise has one fp32 scale, or one per row when
  ConvRot (group-wise Hadamard, group a power of 4 dividing K) is on.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from collections import Counter
from pathlib import Path

from h3direct.checkpoint.quant import FORMATS, MARKER, parse_marker, quant_config
from h3direct.config import H3Config, shape_fields
from h3direct.errors import CheckpointError, ConfigError, H3Error

REPORT_SCHEMA = "h3direct-inspect/2"
MARKER_LIMIT = 4096           # bytes: a comfy_quant marker is a short JSON string
SCALE_CHECK_LIMIT = 64 * 1024  # bytes: scale tensors up to this size are read and checked for NaN/Inf
SCALE_CHECK_BUDGET = 16 * 1024 * 1024  # bytes: total read for scale checks in one inspect
LIST_CAP = 20                 # names listed per anomaly before "... and N more"

# ComfyUI's unet prefix candidates (comfy/model_detection.py unet_prefix_from_state_dict)
PREFIX_CANDIDATES = ("model.diffusion_model.", "model.model.", "net.")
PDD_NOTE = ("this ComfyUI snapshot (0f1fa67a) has no PDD head bank: neither comfy/ldm/minimax/model.py nor "
            "comfy/model_detection.py defines or reads one, so the count is 0 and any pdd* keys are unexpected")


def _roundup(x: int, m: int) -> int:
    return -(-x // m) * m


# every companion suffix a quantized layer can have (the marker included)
COMPANION_SUFFIXES = (MARKER, *dict.fromkeys(c for f in FORMATS.values() for c in f.required + f.optional))
QUANT_STORAGE_DTYPES = ("U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "F4")
FLOAT_DTYPES = {"F16": 16, "BF16": 16, "F32": 32, "F64": 64}


# ---------------------------------------------------------------- small helpers ----
def _fail(path, msg: str) -> CheckpointError:
    return CheckpointError(msg, path=path)


def _nonfinite(dtype: str, data: bytes) -> int:
    """Number of NaN/Inf values in raw little-endian bytes of a float dtype (0 for integer dtypes)."""
    if dtype == "F32":
        return sum(not math.isfinite(v) for (v,) in struct.iter_unpack("<f", data))
    if dtype == "F64":
        return sum(not math.isfinite(v) for (v,) in struct.iter_unpack("<d", data))
    if dtype == "BF16":
        return sum((b & 0x7F80) == 0x7F80 for (b,) in struct.iter_unpack("<H", data))
    if dtype == "F16":
        return sum((b & 0x7C00) == 0x7C00 for (b,) in struct.iter_unpack("<H", data))
    if dtype == "F8_E4M3":  # fn variant: no inf, NaN = S.1111.111
        return sum((b & 0x7F) == 0x7F for b in data)
    if dtype == "F8_E5M2":
        return sum((b & 0x7C) == 0x7C for b in data)
    if dtype == "F8_E8M0":
        return sum(b == 0xFF for b in data)
    return 0


class _Reader:
    """Bounded small reads with a total budget, so a report can never stream a payload."""

    def __init__(self, header):
        self.header = header
        self.spent = 0

    def small(self, name: str, limit: int) -> bytes | None:
        from h3direct.checkpoint.safetensors_header import read_tensor_bytes

        t = self.header.tensors[name]
        if t.nbytes > limit or self.spent + t.nbytes > SCALE_CHECK_BUDGET:
            return None
        self.spent += t.nbytes
        return read_tensor_bytes(self.header, name, limit=limit)


# ---------------------------------------------------------------- key prefix ----
def _strip_prefix(names) -> tuple[str, dict[str, str]]:
    """ComfyUI's prefix handling: returns (prefix, stripped name -> file name)."""
    counts = Counter()
    for n in names:
        for c in PREFIX_CANDIDATES:
            if n.startswith(c):
                counts[c] += 1
                break
    prefix = ""
    if counts and max(counts.values()) > 5:
        prefix = counts.most_common(1)[0][0]
    elif any(n.startswith("model.") for n in names):
        prefix = "model."
    if not prefix:
        return "", {n: n for n in names}
    return prefix, {n[len(prefix):]: n for n in names if n.startswith(prefix)}


# ---------------------------------------------------------------- quantized layers ----
def _layer_markers(path, header, names: dict[str, str], reader: _Reader) -> dict[str, dict]:
    """layer -> decoded quant config, from `.comfy_quant` tensors, `_quantization_metadata` or `scaled_fp8`."""
    markers: dict[str, dict] = {}
    for short, full in names.items():
        if not short.endswith(".comfy_quant"):
            continue
        t = header.tensors[full]
        if t.dtype not in ("U8", "I8") or len(t.shape) != 1:
            raise _fail(path, f"{full}: comfy_quant marker must be a 1-D uint8 JSON string, "
                              f"got {t.dtype} {list(t.shape)}")
        raw = reader.small(full, MARKER_LIMIT)
        if raw is None:
            raise _fail(path, f"{full}: comfy_quant marker is {t.nbytes} bytes, larger than {MARKER_LIMIT}")
        markers[short[: -len(".comfy_quant")]] = dict(conf=parse_marker(raw, full, path), source="comfy_quant")
    meta = header.metadata or {}
    if "_quantization_metadata" in meta:
        try:
            layers = json.loads(meta["_quantization_metadata"])["layers"]
            assert isinstance(layers, dict)
        except Exception:
            raise _fail(path, "__metadata__['_quantization_metadata'] is not JSON with a 'layers' object") from None
        for layer, conf in layers.items():
            if layer not in markers:
                markers[layer] = dict(conf=quant_config(conf, layer, path), source="_quantization_metadata")
    elif "scaled_fp8" in names:  # legacy: `.scale_weight` / `.scale_input` companions
        for short in names:
            if short.endswith(".scale_weight"):
                markers.setdefault(short[: -len(".scale_weight")],
                                   dict(conf={"format": "float8_e4m3fn"}, source="scaled_fp8", legacy=True))
    for layer, m in markers.items():
        if (fmt := m["conf"]["format"]) not in FORMATS:
            raise _fail(path, f"{layer}: unknown quantization format {fmt!r} (ComfyUI knows {', '.join(FORMATS)})")
    return markers


def _check_layer(path, header, names, layer: str, marker: dict, reader: _Reader) -> dict:
    """Check one quantized layer's weight and companions; returns its report entry."""
    conf = marker["conf"]
    fmt_name = conf["format"]
    fmt = FORMATS[fmt_name]
    legacy = marker.get("legacy", False)
    suffix_file = {"weight_scale": "scale_weight", "input_scale": "scale_input"} if legacy else {}

    def comp(suffix):
        return names.get(f"{layer}.{suffix_file.get(suffix, suffix)}")

    wname = names.get(f"{layer}.weight")
    if wname is None:
        raise _fail(path, f"{layer}: {fmt_name} marker but no {layer}.weight")
    w = header.tensors[wname]
    if w.dtype not in fmt.weight_dtypes or len(w.shape) != 2:
        raise _fail(path, f"{wname}: {fmt_name} weight must be 2-D {'/'.join(fmt.weight_dtypes)}, "
                          f"got {w.dtype} {list(w.shape)}")
    rows, cols = w.shape
    n, k = rows, cols * fmt.pack
    if fmt.pad > 1 and (n % fmt.pad or k % fmt.pad):
        raise _fail(path, f"{wname}: {fmt_name} storage {list(w.shape)} is not padded to multiples of {fmt.pad} "
                          f"(logical [{n}, {k}])")
    for req in fmt.required:
        if comp(req) is None:
            raise _fail(path, f"{layer}: {fmt_name} layer is missing its {req} "
                              f"(ComfyUI refuses to load it without one)")
    companions: dict[str, dict] = {}
    nonfinite_checked = True
    for suffix in fmt.required + fmt.optional:
        cname = comp(suffix)
        if cname is None:
            continue
        t = header.tensors[cname]
        companions[suffix] = dict(name=cname, dtype=t.dtype, shape=list(t.shape), bytes=t.nbytes)
        view = t.dtype
        if suffix == "weight_scale" and fmt.block is not None:
            want = (_roundup(n, 128), _roundup(k // fmt.block, 4))
            if t.dtype not in fmt.block_scale_dtypes:
                raise _fail(path, f"{cname}: {fmt_name} block scale must be {'/'.join(fmt.block_scale_dtypes)}, "
                                  f"got {t.dtype}")
            if t.shape != want:
                raise _fail(path, f"{cname}: wrong {fmt_name} block-scale shape {list(t.shape)}; weight "
                                  f"{list(w.shape)} (logical [{n}, {k}]) needs {list(want)} "
                                  f"(one per {fmt.block} values, 128x4 tiled)")
            view = fmt.block_scale_view
        elif suffix in ("weight_scale", "weight_scale_2", "input_scale"):
            per_row = fmt_name in ("int8_tensorwise", "convrot_w4a4") and t.shape in ((n,), (n, 1))
            if t.dtype not in FLOAT_DTYPES or (t.numel != 1 and not per_row):
                raise _fail(path, f"{cname}: {fmt_name} {suffix} must be one float (or one per row for int8), "
                                  f"got {t.dtype} {list(t.shape)}")
        elif suffix == "pre_quant_scale" and t.shape != (k,):
            raise _fail(path, f"{cname}: pre_quant_scale shape {list(t.shape)}, expected [{k}]")
        raw = reader.small(cname, SCALE_CHECK_LIMIT) if view in FLOAT_DTYPES or view.startswith("F8") else b""
        if raw is None:
            nonfinite_checked = False
        elif (bad := _nonfinite(view, raw)):
            raise _fail(path, f"{cname}: {bad} NaN/Inf value(s) in the {fmt_name} {suffix}")
    options = {k_: v for k_, v in conf.items() if k_ != "format"}
    if fmt_name == "int8_tensorwise":
        params = conf.get("params") if isinstance(conf.get("params"), dict) else {}
        convrot = bool(conf.get("convrot", params.get("convrot", False)))
        if convrot:
            group = int(conf.get("convrot_groupsize", params.get("convrot_groupsize", 256)))
            scale = header.tensors[comp("weight_scale")]
            if group < 4 or math.log(group, 4) % 1 or k % group:
                raise _fail(path, f"{layer}: int8 ConvRot group size {group} must be a power of 4 dividing K={k}")
            if scale.numel != n:
                raise _fail(path, f"{layer}: int8 ConvRot needs one scale per row ({n}), got {list(scale.shape)}")
            options.update(convrot=True, convrot_groupsize=group)
    total = w.nbytes + sum(c["bytes"] for c in companions.values())
    if (m := names.get(f"{layer}.comfy_quant")) is not None:
        total += header.tensors[m].nbytes
    return dict(layer=layer, format=fmt_name, source=marker["source"], options=options,
                weight=dict(dtype=w.dtype, shape=list(w.shape)), logical_shape=[n, k],
                companions=companions, scales_checked_finite=nonfinite_checked, bytes=total)


# ---------------------------------------------------------------- H3 structure ----
def _indices(shapes, prefix: str) -> list[int]:
    idx = set()
    for name in shapes:
        if name.startswith(prefix):
            head = name[len(prefix):].split(".", 1)[0]
            if head.isdigit():
                idx.add(int(head))
    return sorted(idx)


def expected_tensors(config) -> dict[str, tuple[int, ...]]:
    """Every tensor ComfyUI's MiniMaxH3Model holds for `config` (an `H3Config`), logical shapes."""
    from h3direct.checkpoint.keys import dit_keys

    return {name: spec.logical_shape for name, spec in dit_keys(config).items()}


def _listing(names) -> str:
    names = list(names)
    more = f" ... and {len(names) - LIST_CAP} more" if len(names) > LIST_CAP else ""
    return ", ".join(names[:LIST_CAP]) + more


# ---------------------------------------------------------------- the report ----
def inspect_checkpoint(path: str | Path) -> dict:
    """Validate `path` and build the full inspect report (a JSON-serialisable dict)."""
    from h3direct.checkpoint.safetensors_header import TORCH_DTYPE_NAMES, read_header

    path = Path(path)
    header = read_header(path)
    reader = _Reader(header)
    prefix, names = _strip_prefix(header.tensors)  # short name -> file name
    shapes = {s: header.tensors[f].shape for s, f in names.items()}
    anomalies: list[dict] = []

    def anomaly(kind: str, detail: str):
        anomalies.append(dict(kind=kind, detail=detail))

    # --- H3 detection first: a file that is not an H3 model is an error whatever else it holds
    try:
        c = shape_fields(shapes)  # ComfyUI's detection, in its field order
    except ConfigError as exc:
        raise _fail(path, str(exc)) from None
    meta = header.metadata or {}
    override = {}
    if "config" in meta:
        try:
            override = json.loads(meta["config"]).get("transformer", {})
        except (json.JSONDecodeError, AttributeError):
            raise _fail(path, "__metadata__['config'] is not a JSON object (ComfyUI's detection parses it)") from None
        if override:
            anomaly("metadata_config_override", f"ComfyUI applies __metadata__ config.transformer {override} on top "
                                                "of the shape-derived config")

    # --- quantized layers
    markers = _layer_markers(path, header, names, reader)
    layers = {layer: _check_layer(path, header, names, layer, m, reader) for layer, m in sorted(markers.items())}
    quant_members = set()
    for layer in layers:
        quant_members.add(f"{layer}.weight")
        quant_members.update(f"{layer}.{s}" for s in COMPANION_SUFFIXES)
        quant_members.update((f"{layer}.scale_weight", f"{layer}.scale_input"))
    quant_members.add("scaled_fp8")
    orphans: dict[str, list[str]] = {}
    for short in names:
        base, _, suffix = short.rpartition(".")
        if base in layers:
            continue
        if suffix in COMPANION_SUFFIXES:
            orphans.setdefault(base, []).append(suffix)
        elif suffix == "weight" and header.tensors[names[short]].dtype in QUANT_STORAGE_DTYPES:
            orphans.setdefault(base, []).append(f"weight stored as {header.tensors[names[short]].dtype}")
    for base, what in sorted(orphans.items()):
        anomaly("missing_companion", f"{base}: has {', '.join(what)} but no comfy_quant marker (ComfyUI would "
                                     "load the raw weight as a plain tensor and ignore the scales)")

    # --- the config the runtime would build (its key table needs one)
    try:
        config = H3Config(**c)
    except ConfigError as exc:
        config = None
        anomaly("config_rejected", f"H3Config cannot represent the shape-derived config, so its keys are not "
                                   f"checked: {exc}")

    # --- H3-specific anomalies
    if "condition_proj" in layers:
        anomaly("quantized_condition_proj", f"condition_proj is {layers['condition_proj']['format']}: ComfyUI reads "
                                            f"text_dim={c['text_dim']} from its stored shape")
    for p in ["blocks.", "token_refiner.blocks."]:
        idx = _indices(shapes, p)
        if idx and idx != list(range(len(idx))):
            counted = c["num_layers" if p == "blocks." else "token_refiner_num_layers"]
            anomaly("block_index_gap", f"{p}* indices {idx[:LIST_CAP]} are not 0..n-1; ComfyUI counts "
                                       f"{counted} and ignores the rest")
    for name in sorted(s for s in shapes if s.endswith("attn.qkv_proj.weight")):
        rows = shapes[name][0] if shapes[name] else 0
        if rows % 3 or (rows // 3) % c["attention_head_dim"]:
            anomaly("qkv_not_thirds", f"{name}: {rows} rows cannot be split into three equal q/k/v parts of whole "
                                      f"heads (head_dim {c['attention_head_dim']})")
    if c["text_dim"] == c["hidden_size"]:
        anomaly("text_dim_equals_hidden", f"text_dim == hidden_size == {c['hidden_size']}: ComfyUI's "
                                          "preprocess_text_embeds then skips condition_proj and the token refiner")
    if 6 * c["rope_inv_freq_len"] > c["attention_head_dim"]:
        anomaly("rope_wider_than_head", f"rope rotates 6 x {c['rope_inv_freq_len']} = {6 * c['rope_inv_freq_len']} "
                                        f"dims, wider than a head ({c['attention_head_dim']})")
    if shapes["final_layer.video_out.weight"][0] % 4:
        rows = shapes["final_layer.video_out.weight"][0]
        anomaly("video_out_not_patch_multiple", f"final_layer.video_out.weight has {rows} rows, not 4 x latents_dim")

    # --- every key against the model's own table
    expected = expected_tensors(config) if config is not None else {}
    missing = [k for k in expected if k not in shapes]
    unexpected = [k for k in shapes if k not in expected and k not in quant_members]
    mismatched = []
    for k, want in expected.items():
        if k not in shapes:
            continue
        got = shapes[k]
        layer = k[: -len(".weight")] if k.endswith(".weight") else None
        if layer in layers and len(want) == 2:
            fmt = FORMATS[layers[layer]["format"]]
            want = (_roundup(want[0], fmt.pad), _roundup(want[1], fmt.pad) // fmt.pack)
        if got != want:
            mismatched.append(f"{k} {list(got)} (expected {list(want)})")
    if missing:
        anomaly("missing_keys", f"{len(missing)} tensor(s) of the model absent: {_listing(missing)}")
    if unexpected:
        anomaly("unexpected_keys", f"{len(unexpected)} tensor(s) the model does not have: {_listing(unexpected)}")
    if mismatched:
        anomaly("shape_mismatch", f"{len(mismatched)} tensor(s) differ from the derived config: {_listing(mismatched)}")
    pdd_keys = [k for k in shapes if "pdd" in k.lower()]

    # --- islands and byte totals
    plain = {s: header.tensors[f] for s, f in names.items() if s not in quant_members}
    float_counts = Counter(t.dtype for t in plain.values() if t.dtype in FLOAT_DTYPES)
    bulk = max(float_counts, key=lambda d: (float_counts[d], -FLOAT_DTYPES[d])) if float_counts else None
    islands = sorted(s for s, t in plain.items()
                     if bulk and t.dtype in FLOAT_DTYPES and FLOAT_DTYPES[t.dtype] > FLOAT_DTYPES[bulk])
    bytes_by_dtype: Counter = Counter()
    for t in header.tensors.values():
        bytes_by_dtype[TORCH_DTYPE_NAMES[t.dtype]] += t.nbytes
    bytes_by_format: Counter = Counter()
    for entry in layers.values():
        bytes_by_format[entry["format"]] += entry["bytes"]
    for t in plain.values():
        bytes_by_format[TORCH_DTYPE_NAMES[t.dtype]] += t.nbytes

    quantized: dict[str, dict] = {}
    for entry in layers.values():
        q = quantized.setdefault(entry["format"], dict(count=0, bytes=0, layers=[]))
        q["count"] += 1
        q["bytes"] += entry["bytes"]
        q["layers"].append(entry)

    return dict(
        schema=REPORT_SCHEMA,
        file=str(path.resolve()),
        file_size=header.file_size,
        header_len=header.header_len,
        key_prefix=prefix,
        metadata=header.metadata or {},
        tensor_count=len(header.tensors),
        tensors=[dict(name=t.name, dtype=TORCH_DTYPE_NAMES[t.dtype], shape=list(t.shape), bytes=t.nbytes,
                      offset=t.offset) for t in header.tensors.values()],
        quantized=quantized,
        islands=dict(bulk_dtype=TORCH_DTYPE_NAMES[bulk] if bulk else None,
                     tensors=[dict(name=s, dtype=TORCH_DTYPE_NAMES[plain[s].dtype], bytes=plain[s].nbytes)
                              for s in islands],
                     bytes=sum(plain[s].nbytes for s in islands)),
        bytes_by_dtype=dict(sorted(bytes_by_dtype.items())),
        bytes_by_format=dict(sorted(bytes_by_format.items())),
        config=c,
        comfy_detected={**c, **override},
        metadata_override=override,
        pdd_heads=dict(count=0, note=PDD_NOTE, pdd_keys=pdd_keys),
        small_bytes_read=reader.spent,
        anomalies=anomalies,
    )


def summary(report: dict, report_path: Path | None) -> dict:
    """The compact stdout view of a report."""
    return dict(
        file=report["file"],
        report=str(report_path) if report_path else None,
        tensors=report["tensor_count"],
        file_size=report["file_size"],
        config=report["config"],
        quantized={f: q["count"] for f, q in report["quantized"].items()},
        bytes_by_format=report["bytes_by_format"],
        fp32_islands=len(report["islands"]["tensors"]),
        pdd_heads=report["pdd_heads"]["count"],
        anomalies=[f"{a['kind']}: {a['detail']}" for a in report["anomalies"]],
    )


def write_report(report: dict, out_dir: Path) -> Path:
    stem = Path(report["file"]).stem
    target = out_dir / f"{stem}.json"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=1) + "\n")
        tmp.replace(target)
    except OSError as exc:
        raise H3Error(f"cannot write the report: {exc.strerror}", path=target) from None
    return target


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a .safetensors DiT checkpoint (only its header is read)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="write the full report to DIR/<stem>.json (made if missing); the report file is written "
                             "only with --out (without it: the summary on stdout, no file)")


def run(*, checkpoint: str, out: str | None = None) -> int:
    report = inspect_checkpoint(checkpoint)
    target = write_report(report, Path(out)) if out else None
    print(json.dumps(summary(report, target)))
    return 0
