"""Which files a ComfyUI trace was recorded from: its checkpoint, its inputs file, its compute dtype and weights.

The trace vocabulary's pairing rules, shared by the gate's discovery (`parity_tests/discovery.py`) and the oracle's
replay. Most explicit first: a manifest's own `inputs` / `checkpoint` fields (relative to the trace's folder, with
their sha256 when recorded); otherwise the one inputs file of the folder whose `h3_inputs` variant equals the
manifest's task and which reproduces every recorded input the trace holds (`input_mismatch`).
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path

import torch

# How close an inputs file's tensors, recomputed in float64 (text states through condition_proj, condition rows,
# timestep), must come to a trace's recorded inputs to be the file it was recorded from: bf16 rounding moves them by
# at most 2^-8 relative and the 0.999/0.001 condition-noise mix by 1e-3, while another prompt or reference differs
# by O(1). Not a parity limit: it only decides which file a trace belongs to.
PAIRING_LIMIT = 5e-2


def compute_of(m: dict) -> str:
    """The compute dtype a manifest was recorded in: fp32 | bf16 | fp16."""
    req = str(m.get("compute_dtype_requested") or m.get("compute_dtype") or "")
    if req in ("fp32", "bf16", "fp16"):
        return req
    dt = str(m.get("inference_dtype") or m.get("model_dtype") or "")
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(dt, "fp32")


def weights_of(checkpoint: Path, m: dict) -> str:
    """bf16 | nvfp4_w4a16 | nvfp4_w4a4: the checkpoint's weights as the recording ran them."""
    from safetensors import safe_open

    with safe_open(str(checkpoint), "pt") as f:
        quant = any(k.endswith(".comfy_quant") for k in f.keys())
    if not quant:
        return "bf16"
    # ComfyUI runs NVFP4 as W4A4 only on CUDA devices of compute capability >= 10; CPU traces are W4A16
    return f"nvfp4_{m.get('nvfp4_mode', 'w4a16')}"


def _inputs_meta(path: Path) -> dict:
    st = Path(path).stat()
    return _inputs_meta_of(str(path), st.st_mtime_ns, st.st_size)


@cache
def _inputs_meta_of(path: str, mtime_ns: int, size: int) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return json.loads((f.metadata() or {}).get("h3_inputs", "{}"))
    except Exception:  # not an inputs file
        return {}


def file_sha256(path: Path) -> str:
    st = Path(path).stat()
    return _sha256_of(str(path), st.st_mtime_ns, st.st_size)


@cache
def _sha256_of(path: str, mtime_ns: int, size: int) -> str:  # cached per file version
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _linear64(checkpoint: Path, prefix: str, x: torch.Tensor) -> torch.Tensor | None:
    """`x @ W.T + b` in float64 with the checkpoint's dense `prefix` weights; None when quantized or absent."""
    from safetensors import safe_open

    with safe_open(str(checkpoint), "pt") as f:
        keys = set(f.keys())
        if f"{prefix}.weight" not in keys or f"{prefix}.comfy_quant" in keys:
            return None
        w = f.get_tensor(f"{prefix}.weight")
        bias = f.get_tensor(f"{prefix}.bias") if f"{prefix}.bias" in keys else None
    if not w.is_floating_point() or w.shape[-1] != x.shape[-1]:
        return None
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


def _weight_in_features(checkpoint: Path, prefix: str) -> int | None:
    from safetensors import safe_open

    with safe_open(str(checkpoint), "pt") as f:
        if f"{prefix}.weight" not in set(f.keys()) or f"{prefix}.comfy_quant" in set(f.keys()):
            return None
        return int(f.get_slice(f"{prefix}.weight").get_shape()[-1])


def input_mismatch(inputs: Path, trace, checkpoint: Path | None) -> str | None:
    """Why the inputs file cannot be the one `trace` was recorded from, or None when it reproduces every recorded
    input the trace holds: the text states (`condition_proj.in.0`, or through the checkpoint's condition_proj:
    `condition_proj.out`), the sampler inputs `sampler.x_in.video` (σ·noise + (1 − σ)·latent, bitwise) and
    `sampler.x_in.audio`, the timestep (1000·σ) and the reference / keyframe latents (the condition rows of
    `video_patch_proj` and `audio_patch_proj`, inputs or outputs)."""
    from h3direct.dit.embed import pack_audio, patchify_video
    from h3direct.dit.model import Conditioning
    from h3direct.traces.inputs import load_inputs

    try:
        inp = load_inputs(inputs)
    except Exception as exc:  # noqa: BLE001 (any unreadable candidate is simply not the one)
        return f"unreadable ({exc})"
    limit = PAIRING_LIMIT
    text = inp.text_states.float()
    if "condition_proj.in.0" in trace:
        ref = trace.get("condition_proj.in.0")
        if tuple(ref.shape[-2:]) != tuple(text.shape[-2:]):
            return f"text states {tuple(text.shape)} vs recorded condition_proj input {tuple(ref.shape)}"
        if _rel(text.reshape(ref.shape), ref) > limit:
            return "text states differ from the recorded condition_proj input"
    if "condition_proj.out" in trace and checkpoint is not None:
        ref = trace.get("condition_proj.out")
        width = _weight_in_features(checkpoint, "condition_proj")
        if width is not None and width != text.shape[-1]:
            return f"text states have dim {text.shape[-1]}, the checkpoint's condition_proj takes {width}"
        if ref.shape[-2] != text.shape[-2]:
            return f"{text.shape[-2]} text tokens, the trace's condition_proj.out has {ref.shape[-2]}"
        ours = _linear64(checkpoint, "condition_proj", text.reshape(-1, text.shape[-1]))
        if ours is not None and _rel(ours, ref.reshape(ours.shape)) > limit:
            return "text states through condition_proj differ from the recorded condition_proj.out"
    sigma = float(inp["sigma"].reshape(-1)[0]) if "sigma" in inp.tensors else float(inp.sigma)
    if "sampler.x_in.video" in trace:
        ref = trace.get("sampler.x_in.video")
        noise, lat = inp["video_noise"].float(), inp["video_latent"].float()
        if noise.shape != ref.shape:
            return f"video noise {tuple(noise.shape)} vs recorded sampler.x_in.video {tuple(ref.shape)}"
        s = torch.tensor([sigma], dtype=torch.float32)
        if not torch.equal(s * noise + (1.0 - s) * lat, ref):
            return "σ·noise + (1 − σ)·latent differs from the recorded sampler.x_in.video"
    if "sampler.x_in.audio" in trace:  # the audio latent rides ×audio_scale in the packed sampler state
        ref = trace.get("sampler.x_in.audio")
        noise, lat = inp["audio_noise"].float(), inp["audio_latent"].float()
        scale = float((trace.manifest.get("sampling") or {}).get("audio_scale", 4.0))
        if noise.shape != ref.shape:
            return f"audio noise {tuple(noise.shape)} vs recorded sampler.x_in.audio {tuple(ref.shape)}"
        if _rel(sigma * noise.double() + (1.0 - sigma) * scale * lat.double(), ref) > limit:
            return "σ·noise + (1 − σ)·scale·latent differs from the recorded sampler.x_in.audio"
    for name in ("dit_forward.in.timestep", "dit_inner.in.timestep"):
        if name in trace:
            t = trace.get(name).reshape(-1)
            if t.numel() == 1 and _rel(torch.tensor([1000.0 * sigma]), t) > limit:
                return f"1000·σ = {1000.0 * sigma:g} differs from the recorded {name} {float(t[0]):g}"
            break
    cond = Conditioning(keyframes=inp.keyframes, refs=inp.refs, seed=inp.seed)
    patch = (1, 2, 2)
    for stream, lats, rows_of in (("video", cond.cond_video_latents(), lambda z: patchify_video(z.float(), patch)),
                                  ("audio", cond.cond_audio_latents(), lambda z: pack_audio(z.float()))):
        rows = torch.cat([rows_of(z) for z in lats]) if lats else None
        if rows is None:
            continue
        n = rows.shape[0]
        if f"{stream}_patch_proj.in.0" in trace:
            ref = trace.get(f"{stream}_patch_proj.in.0")
            if ref.shape[0] < n or ref.shape[-1] != rows.shape[-1]:
                return f"{n} {stream} condition rows do not fit the recorded {stream}_patch_proj input"
            if _rel(rows, ref[:n]) > limit:
                return f"reference/keyframe {stream} latents differ from the recorded condition rows"
        elif f"{stream}_patch_proj.out" in trace and checkpoint is not None:
            ref = trace.get(f"{stream}_patch_proj.out")
            ours = _linear64(checkpoint, f"{stream}_patch_proj", rows)
            if ref.shape[0] < n:
                return f"{n} {stream} condition rows, the trace's {stream}_patch_proj.out has {ref.shape[0]} rows"
            if ours is not None and _rel(ours, ref[:n]) > limit:
                return f"reference/keyframe {stream} latents differ from the recorded condition rows"
    return None


def _same_content(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    if file_sha256(a) == file_sha256(b):
        return True
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta) and \
        _inputs_meta(a).get("refs") == _inputs_meta(b).get("refs")


def pair_inputs(folder: Path, m: dict, trace_path: Path, checkpoint: Path | None) -> tuple[Path | None, str | None]:
    """(inputs file, None) or (None, one-line problem) for a DiT or generation trace.

    Most explicit first: the manifest's `inputs` name (+ `inputs_sha256` when recorded, which must match); without
    a name, every inputs file of the folder whose variant is the trace's task is tried, and exactly one must
    reproduce every recorded input the trace holds (`input_mismatch`); two that differ but both fit are ambiguous.
    """
    from h3direct.traces.format import load_trace

    trace = load_trace(trace_path)
    if m.get("inputs"):
        p = recorded_file(trace_path, m, "inputs")
        if not p.is_file():
            return None, missing_file(f"inputs file {p.name} named by the manifest", p, trace_path, m, "inputs")
        want = m.get("inputs_sha256")
        if want and file_sha256(p) != want:
            return None, f"{trace_path}: {p.name} does not match the manifest's inputs_sha256 (edited or replaced)"
        why = input_mismatch(p, trace, checkpoint)
        if why:
            return None, f"{trace_path}: {p.name} named by the manifest does not reproduce the trace: {why}"
        return p, None
    task = m.get("variant") or m.get("task")

    def variant(p):
        meta = _inputs_meta(p)
        return meta.get("variant") or meta.get("task") if meta.get("schema") else None

    cands = [p for p in sorted(folder.glob("*.safetensors")) if variant(p) is not None
             and (task is None or variant(p) == task)]
    fits, why = [], {}
    for p in cands:
        reason = input_mismatch(p, trace, checkpoint)
        if reason is None:
            fits.append(p)
        else:
            why[p] = reason
    distinct = []
    for p in fits:
        if not any(_same_content(p, q) for q in distinct):
            distinct.append(p)
    if len(distinct) > 1:
        return None, (f"{trace_path}: ambiguous inputs: {distinct[0].name} and {distinct[1].name} both reproduce its "
                      f"recorded inputs; name one in the manifest's `inputs` field")
    if not distinct:
        closest = "; ".join(f"{p.name}: {r}" for p, r in list(why.items())[:2])
        return None, (f"{trace_path}: no inputs file in {folder} reproduces its recorded inputs"
                      + (f" ({closest})" if closest else f" (no inputs file of task {task!r})"))
    return distinct[0], None


def recorded_file(trace_path: Path, m: dict, key: str) -> Path | None:
    """The file a trace's manifest names under `key` (checkpoint, inputs, weights, config): beside the trace by its
    name (a folder laid out like ../shared/oracle, or a copy that travelled with it), else where it was recorded from
    (`<key>_path`, absolute: `oracle record` writes it, so a trace is gated where it was written, nothing copied).
    The first candidate whose sha256 matches the manifest's `<key>_sha256` wins; with none matching, the first that
    exists (the caller names the mismatch), else the name beside the trace (the caller names it missing). None: the
    manifest names no such file."""
    name = m.get(key)
    if not name:
        return None
    folder = Path(trace_path).parent
    beside = folder / Path(str(name)).name
    candidates = [beside] + ([Path(str(m[f"{key}_path"]))] if m.get(f"{key}_path") else [])
    present = [p for p in candidates if p.is_file()]
    want = m.get(f"{key}_sha256")
    for p in present:
        if not want or file_sha256(p) == want:
            return p
    return present[0] if present else beside


def missing_file(what: str, path: Path, trace_path: Path, m: dict, key: str) -> str:
    """One line for a recorded file that is nowhere: where it was looked for."""
    where = f"beside the trace ({path.name})"
    if m.get(f"{key}_path"):
        where += f" nor at {m[f'{key}_path']}, where it was recorded from"
    return f"{trace_path}: {what} not found {where}"


def digest_problem(trace_path: Path) -> str | None:
    """One line when the trace's tensors do not match its manifest's digests (`format.verify_trace`)."""
    st, js = Path(trace_path).stat(), Path(trace_path).with_suffix(".json").stat()
    return _digest_problem(str(trace_path), st.st_mtime_ns, st.st_size, js.st_mtime_ns, js.st_size)


@cache
def _digest_problem(path: str, *version) -> str | None:
    from h3direct.errors import H3Error
    from h3direct.traces.format import load_trace, verify_trace

    try:
        bad = verify_trace(load_trace(path))
    except H3Error as exc:
        return f"{path}: unreadable trace ({exc})"
    if bad:
        return f"{path}: tensors do not match the manifest ({len(bad)} problem(s), first: {bad[0]})"
    return None


def checkpoint_problem(trace_path: Path, m: dict, ckpt: Path) -> str | None:
    if not ckpt.is_file():
        return missing_file(f"checkpoint {ckpt.name}", ckpt, trace_path, m, "checkpoint")
    want = m.get("checkpoint_sha256")
    if want and file_sha256(ckpt) != want:
        return f"{trace_path}: {ckpt.name} does not match the manifest's checkpoint_sha256 (another file of that name)"
    return None


def vae_weights_in(folder: Path) -> dict[str, Path]:
    """{"video" | "audio": the folder's VAE weights file of that modality}, by their keys."""
    from safetensors import safe_open

    found: dict[str, Path] = {}
    for p in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(p), "pt") as f:
                keys = set(f.keys())
        except Exception:  # noqa: BLE001 (not a weights file)
            continue
        if any(k.startswith("decoder.x_embedder") or k.startswith("post_quant_conv") for k in keys):
            found.setdefault("video", p)
        elif any(k.startswith("dec_in_proj") for k in keys):
            found.setdefault("audio", p)
    return found


def vae_files(trace_path: Path, m: dict, weights: dict[str, Path] | None = None) -> tuple[tuple[Path, Path, Path]
                                                                                        | None, str | None]:
    """((weights, config, inputs), None) of a VAE trace, or (None, one-line problem): the manifest's names, else the
    folder's weights of the trace's modality and `vae_config_<set>.json` / `vae_inputs_<set>.safetensors`; recorded
    sha256 must match."""
    folder = Path(trace_path).parent
    modality = str(m["kind"]).split("_")[0]
    s = m.get("set", "public")
    config = recorded_file(trace_path, m, "config") or folder / f"vae_config_{s}.json"
    inputs = recorded_file(trace_path, m, "inputs") or folder / f"vae_inputs_{s}.safetensors"
    if m.get("weights"):
        w = recorded_file(trace_path, m, "weights")
    else:
        w = (weights if weights is not None else vae_weights_in(folder)).get(modality)
    missing = [str(p) for p in (w, config, inputs) if p is None or not Path(p).is_file()]
    if missing:
        return None, f"{trace_path}: missing {', '.join(missing) or modality + ' weights'}"
    files = ((w, "weights_sha256"), (config, "config_sha256"), (inputs, "inputs_sha256"))
    bad = [Path(p).name for p, key in files if m.get(key) and file_sha256(Path(p)) != m[key]]
    if bad:
        return None, f"{trace_path}: {', '.join(bad)} do(es) not match the manifest's sha256 (edited or replaced)"
    return (Path(w), config, inputs), None
