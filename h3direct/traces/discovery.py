"""Find ComfyUI traces and what they need (checkpoint, inputs, fp32 twin) in directories laid out like
../shared/oracle: `trace_*.safetensors` + `.json` manifests beside the checkpoints and inputs files.

Pairing rules, most explicit first: a manifest's own `inputs` / `checkpoint` fields (relative to the
trace's folder); otherwise the one inputs file of the folder whose `h3_inputs` variant equals the manifest's
task and which reproduces every recorded input the trace holds (`input_mismatch`, `pair_inputs`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

VAE_KINDS = ("video_decode", "video_encode", "audio_decode", "audio_encode")
ROOT = Path(__file__).resolve().parents[2]  # the checkout: h3direct/traces/ -> repo root
FIXTURES = ROOT / "fixtures"
SHARED_ORACLE = ROOT.parent / "shared" / "oracle"  # the shared oracle set, when it sits beside the checkout


def default_roots() -> list[Path]:
    """The gate's default trace roots: the committed fixtures/ and, when it sits beside the checkout,
    ../shared/oracle."""
    roots = [FIXTURES] if FIXTURES.is_dir() else []
    if SHARED_ORACLE.is_dir():
        roots.append(SHARED_ORACLE)
    return roots


@dataclass(frozen=True)
class DitCase:
    trace: Path
    checkpoint: Path
    inputs: Path
    compute: str  # fp32 | bf16 | fp16
    weights: str  # bf16 | nvfp4_w4a4 | nvfp4_w4a16
    task: str
    twin_fp32: Path | None  # ComfyUI's fp32 trace of the same checkpoint and inputs

    @property
    def id(self) -> str:
        return f"{self.trace.parent.name}/{self.trace.stem}"


@dataclass(frozen=True)
class VaeCase:
    trace: Path
    weights: Path
    config: Path
    inputs: Path
    kind: str  # video_decode | ...
    dtype: str  # fp32 | fp16
    twin_fp32: Path | None

    @property
    def id(self) -> str:
        return f"{self.trace.parent.name}/{self.trace.stem}"


def trace_dirs(roots: list[Path]) -> list[Path]:
    """Each root, or its subfolders holding traces (a folder of such directories)."""
    out = []
    for root in roots:
        if any(root.glob("trace_*.json")) or any(root.glob("*.json")) and any(root.glob("*.safetensors")):
            out.append(root)
        out.extend(sorted(d for d in root.iterdir() if d.is_dir() and any(d.glob("*.json"))))
    seen, uniq = set(), []
    for d in out:
        if d.resolve() not in seen:
            seen.add(d.resolve())
            uniq.append(d)
    return uniq


def _manifest(path: Path) -> dict | None:
    try:
        m = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def _traces(folder: Path, accept) -> dict[Path, dict]:
    """{trace .safetensors: manifest} for the manifests of `folder` that `accept` and whose tensors exist."""
    out = {}
    for j in sorted(folder.glob("*.json")):
        m = _manifest(j)
        st = j.with_suffix(".safetensors")
        if m and accept(m) and st.is_file():
            out[st] = m
    return out


def _compute(m: dict) -> str:
    req = str(m.get("compute_dtype_requested") or m.get("compute_dtype") or "")
    if req in ("fp32", "bf16", "fp16"):
        return req
    dt = str(m.get("inference_dtype") or m.get("model_dtype") or "")
    return {"torch.bfloat16": "bf16", "torch.float16": "fp16"}.get(dt, "fp32")


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


def _pairing_limit() -> float:
    """rel-L2 under which a candidate's recomputed input counts as the recorded one (budgets.toml, mode pairing)."""
    from h3direct.traces.budgets import load_budgets

    b = load_budgets().lookup(mode="pairing", kind="*", compute="*", weights="*", attention="*")
    return float(b.rel_l2)


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
    limit = _pairing_limit()
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
        p = folder / Path(str(m["inputs"])).name
        if not p.is_file():
            return None, f"{trace_path}: inputs file {p.name} named by the manifest not found beside the trace"
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
        return f"{trace_path}: checkpoint {ckpt.name} not found beside the trace"
    want = m.get("checkpoint_sha256")
    if want and file_sha256(ckpt) != want:
        return f"{trace_path}: {ckpt.name} does not match the manifest's checkpoint_sha256 (another file of that name)"
    return None


def _weights_label(checkpoint: Path, m: dict) -> str:
    from safetensors import safe_open

    with safe_open(str(checkpoint), "pt") as f:
        quant = any(k.endswith(".comfy_quant") for k in f.keys())
    if not quant:
        return "bf16"
    # ComfyUI runs NVFP4 as W4A4 only on CUDA devices of compute capability >= 10; CPU traces are W4A16
    return f"nvfp4_{m.get('nvfp4_mode', 'w4a16')}"


def find_dit_cases(roots: list[Path]) -> tuple[list[DitCase], list[str]]:
    """(cases, problems): problems are traces that could not be paired, as one-line reasons."""
    cases, problems = [], []
    for folder in trace_dirs(roots):
        metas = _traces(folder, lambda m: "unet_config_detected" in m and "checkpoint" in m)
        paired = {}
        for st, m in metas.items():
            ckpt = folder / Path(m["checkpoint"]).name
            problem = digest_problem(st) or checkpoint_problem(st, m, ckpt)
            if problem is None:
                inputs, problem = pair_inputs(folder, m, st, ckpt)
            if problem:
                problems.append(problem)
                continue
            paired[st] = (ckpt, inputs)
        for st, (ckpt, inputs) in paired.items():
            m = metas[st]
            twin = None
            for other, om in metas.items():
                if (other != st and om.get("checkpoint") == m.get("checkpoint") and _compute(om) == "fp32"
                        and (om.get("variant") or om.get("task")) == (m.get("variant") or m.get("task"))
                        and om.get("set") == m.get("set") and paired.get(other, (None, None))[1] == inputs):
                    twin = other
            cases.append(DitCase(st, ckpt, inputs, _compute(m), _weights_label(ckpt, m),
                                 str(m.get("variant") or m.get("task")), twin if _compute(m) != "fp32" else None))
    return cases, problems


def find_vae_cases(roots: list[Path]) -> tuple[list[VaeCase], list[str]]:
    from safetensors import safe_open

    cases, problems = [], []
    for folder in trace_dirs(roots):
        metas = _traces(folder, lambda m: m.get("kind") in VAE_KINDS)
        if not metas:
            continue
        weights = {}
        for p in sorted(folder.glob("*.safetensors")):
            try:
                with safe_open(str(p), "pt") as f:
                    keys = set(f.keys())
            except Exception:
                continue
            if any(k.startswith("decoder.x_embedder") or k.startswith("post_quant_conv") for k in keys):
                weights.setdefault("video", p)
            elif "dec_in_proj.weight" in keys or any(k.startswith("dec_in_proj") for k in keys):
                weights.setdefault("audio", p)
        for st, m in metas.items():
            modality = m["kind"].split("_")[0]
            s = m.get("set", "public")
            config = folder / (m.get("config") or f"vae_config_{s}.json")
            inputs = folder / (m.get("inputs") or f"vae_inputs_{s}.safetensors")
            w = folder / m["weights"] if m.get("weights") else weights.get(modality)
            missing = [str(p) for p in (w, config, inputs) if p is None or not Path(p).is_file()]
            if missing:
                problems.append(f"{st}: missing {', '.join(missing) or modality + ' weights'}")
                continue
            files = ((w, "weights_sha256"), (config, "config_sha256"), (inputs, "inputs_sha256"))
            bad = [Path(p).name for p, key in files if m.get(key) and file_sha256(Path(p)) != m[key]]
            if bad:
                problems.append(f"{st}: {', '.join(bad)} do(es) not match the manifest's sha256 (edited or replaced)")
                continue
            problem = digest_problem(st)
            if problem:
                problems.append(problem)
                continue
            dtype = str(m.get("compute_dtype", "fp32"))
            twin = None
            if dtype != "fp32":
                def same_source(om, m=m):
                    explicit = [k for k in ("weights", "config", "inputs") if m.get(k) or om.get(k)]
                    if explicit:
                        return all(Path(str(m.get(k))).name == Path(str(om.get(k))).name for k in explicit)
                    return om.get("set", "public") == m.get("set", "public")

                twin = next((o for o, om in metas.items() if om.get("kind") == m["kind"]
                             and str(om.get("compute_dtype", "fp32")) == "fp32" and same_source(om)), None)
            cases.append(VaeCase(st, Path(w), config, inputs, m["kind"], dtype, twin))
    return cases, problems


@dataclass(frozen=True)
class GenerateCase:
    trace: Path
    checkpoint: Path
    inputs: Path
    manifest: dict = field(hash=False, compare=False)

    @property
    def id(self) -> str:
        return f"{self.trace.parent.name}/{self.trace.stem}"

    @property
    def compute(self) -> str:
        return str(self.manifest.get("compute_dtype_requested", "fp32"))

    @property
    def weights(self) -> str:
        return _weights_label(self.checkpoint, self.manifest)


def find_generate_cases(roots: list[Path]) -> tuple[list[GenerateCase], list[str]]:
    cases, problems = [], []
    for folder in trace_dirs(roots):
        for st, m in _traces(folder, lambda m: m.get("kind") == "generate").items():
            ckpt, inputs = folder / str(m.get("checkpoint")), folder / str(m.get("inputs"))
            missing = [p.name for p in (ckpt, inputs) if not p.is_file()]
            if missing:
                problems.append(f"{st}: {', '.join(missing)} not found beside the trace")
                continue
            problem = digest_problem(st) or checkpoint_problem(st, m, ckpt)
            if problem is None and m.get("inputs_sha256") and file_sha256(inputs) != m["inputs_sha256"]:
                problem = f"{st}: {inputs.name} does not match the manifest's inputs_sha256 (edited or replaced)"
            if problem:
                problems.append(problem)
                continue
            cases.append(GenerateCase(st, ckpt, inputs, m))
    return cases, problems
