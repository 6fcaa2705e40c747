"""Find ComfyUI traces and what they need (checkpoint, inputs, fp32 twin) in directories laid out like
../shared/oracle: `trace_*.safetensors` + `.json` manifests beside the checkpoints and inputs files.

Pairing rules, most explicit first: a manifest's own `inputs` / `checkpoint` fields (relative to the
trace's folder); otherwise the inputs files of the folder whose `h3_inputs` variant equals the manifest's
task and whose σ·noise + (1 − σ)·latent reproduces the trace's `sampler.x_in.video` exactly.
"""

from __future__ import annotations

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


@cache
def _inputs_meta(path: Path) -> dict:
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return json.loads((f.metadata() or {}).get("h3_inputs", "{}"))
    except Exception:  # not an inputs file
        return {}


def _x_in_matches(inputs: Path, trace: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(trace), "pt") as f:
            if "sampler.x_in.video" not in f.keys():
                return True
            ref = f.get_tensor("sampler.x_in.video")
        with safe_open(str(inputs), "pt") as f:
            noise, lat = f.get_tensor("video_noise").float(), f.get_tensor("video_latent").float()
            sigma = f.get_tensor("sigma").reshape(-1)[:1].float() if "sigma" in f.keys() else None
    except Exception:
        return False
    if sigma is None:
        sigma = torch.tensor([float(_inputs_meta(inputs).get("sigma", 0.0))])
    if noise.shape != ref.shape:
        return False
    return torch.equal(sigma * noise + (1.0 - sigma) * lat, ref)


def _find_inputs(folder: Path, m: dict, trace: Path) -> Path | None:
    if m.get("inputs"):
        p = (folder / Path(m["inputs"]).name)
        if p.is_file():
            return p
    task = m.get("variant") or m.get("task")
    def variant(p):
        meta = _inputs_meta(p)
        return meta.get("variant") or meta.get("task") if meta.get("schema") else None

    cands = [p for p in sorted(folder.glob("*.safetensors")) if variant(p) == task]
    for p in cands:
        if _x_in_matches(p, trace):
            return p
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
        for st, m in metas.items():
            ckpt = folder / Path(m["checkpoint"]).name
            if not ckpt.is_file():
                problems.append(f"{st}: checkpoint {ckpt.name} not found beside the trace")
                continue
            inputs = _find_inputs(folder, m, st)
            if inputs is None:
                problems.append(f"{st}: no inputs file in {folder} reproduces its sampler.x_in")
                continue
            twin = None
            for other, om in metas.items():
                if (other != st and om.get("checkpoint") == m.get("checkpoint") and _compute(om) == "fp32"
                        and (om.get("variant") or om.get("task")) == (m.get("variant") or m.get("task"))
                        and om.get("set") == m.get("set") and _find_inputs(folder, om, other) == inputs):
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
            cases.append(GenerateCase(st, ckpt, inputs, m))
    return cases, problems
