"""The gate's cases: ComfyUI traces and what they need (checkpoint, inputs, fp32 twin) in folders laid out like
../shared/oracle (`<name>.safetensors` + `<name>.json` manifests, under any name, beside the checkpoints and inputs
files or naming where those were recorded from), or in a folder
of such folders. Which inputs file and checkpoint a trace belongs to is the trace vocabulary's
(`h3direct.traces.pairing`); this module finds the cases and their twins.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from h3direct.traces.pairing import (
    checkpoint_problem,
    compute_of,
    digest_problem,
    file_sha256,
    missing_file,
    pair_inputs,
    recorded_file,
    vae_files,
    vae_weights_in,
    weights_of,
)

VAE_KINDS = ("video_decode", "video_encode", "audio_decode", "audio_encode")
# ComfyUI's attention functions of its fast modes (a recording's manifest `attention`) -> the mode: such a trace is
# the reference of the approximate modes of its class (`ladder.py`), not a case of the exact gate
FAST_MODES = {"attention_sage": "sage"}
ROOT = Path(__file__).resolve().parents[1]  # the checkout: parity_tests/ -> repo root
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
    sage_twin: Path | None = None  # ComfyUI --use-sage-attention's trace of the same case (same compute dtype)

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
        if any(root.glob("*.json")) and any(root.glob("*.safetensors")):
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


def _same_case(m: dict, om: dict, inputs: Path, other_inputs: Path | None) -> bool:
    """Two DiT recordings of the same checkpoint, task and inputs file (a twin, a fast mode's reference)."""
    same_sha = not (m.get("checkpoint_sha256") and om.get("checkpoint_sha256")) or \
        m["checkpoint_sha256"] == om["checkpoint_sha256"]
    return (om.get("checkpoint") == m.get("checkpoint") and same_sha and om.get("set") == m.get("set")
            and (om.get("variant") or om.get("task")) == (m.get("variant") or m.get("task")) and other_inputs == inputs)


def find_dit_cases(roots: list[Path]) -> tuple[list[DitCase], list[str]]:
    """(cases, problems): problems are traces that could not be paired, as one-line reasons."""
    cases, problems = [], []
    for folder in trace_dirs(roots):
        metas = _traces(folder, lambda m: "unet_config_detected" in m and "checkpoint" in m)
        paired = {}
        for st, m in metas.items():
            ckpt = recorded_file(st, m, "checkpoint")
            problem = digest_problem(st) or checkpoint_problem(st, m, ckpt)
            if problem is None:
                inputs, problem = pair_inputs(folder, m, st, ckpt)
            if problem:
                problems.append(problem)
                continue
            paired[st] = (ckpt, inputs)
        for st, (ckpt, inputs) in paired.items():
            m = metas[st]
            if m.get("attention") in FAST_MODES:  # a fast mode's reference, found by its case below
                continue
            compute = compute_of(m)
            twin = sage = None
            for other, om in metas.items():
                if other == st or not _same_case(m, om, inputs, paired.get(other, (None, None))[1]):
                    continue
                if om.get("attention") in FAST_MODES:
                    if compute != "fp32" and compute_of(om) == compute:
                        sage = other
                elif compute_of(om) == "fp32":
                    twin = other
            cases.append(DitCase(st, ckpt, inputs, compute, weights_of(ckpt, m), str(m.get("variant") or m.get("task")),
                                 twin if compute != "fp32" else None, sage))
    return cases, problems


def low_case(case: DitCase, compute: str | None = None) -> DitCase | None:
    """ComfyUI's low-precision case (`compute`; None: bf16, else fp16) whose fp32 twin is the fp32 `case`; `case`
    itself when it is not fp32 (None: not recorded)."""
    if case.compute != "fp32":
        return case
    cases, _ = find_dit_cases([case.trace.parent])
    twins = [c for c in cases if c.twin_fp32 is not None and c.twin_fp32.name == case.trace.name
             and (compute is None or c.compute == compute)]
    return min(twins, key=lambda c: c.compute != "bf16", default=None)


def find_vae_cases(roots: list[Path]) -> tuple[list[VaeCase], list[str]]:
    cases, problems = [], []
    for folder in trace_dirs(roots):
        metas = _traces(folder, lambda m: m.get("kind") in VAE_KINDS)
        if not metas:
            continue
        weights = vae_weights_in(folder)
        for st, m in metas.items():
            files, problem = vae_files(st, m, weights)
            problem = problem or digest_problem(st)
            if problem:
                problems.append(problem)
                continue
            w, config, inputs = files
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
            cases.append(VaeCase(st, w, config, inputs, m["kind"], dtype, twin))
    return cases, problems


@dataclass(frozen=True)
class GenerateCase:
    trace: Path
    checkpoint: Path
    inputs: Path
    manifest: dict = field(hash=False, compare=False)
    twin_fp32: Path | None = None  # ComfyUI's fp32 recording of the same generation (a low-precision case's)

    @property
    def id(self) -> str:
        return f"{self.trace.parent.name}/{self.trace.stem}"

    @property
    def compute(self) -> str:
        return str(self.manifest.get("compute_dtype_requested", "fp32"))

    @property
    def weights(self) -> str:
        return weights_of(self.checkpoint, self.manifest)


def find_generate_cases(roots: list[Path]) -> tuple[list[GenerateCase], list[str]]:
    cases, problems = [], []
    for folder in trace_dirs(roots):
        for st, m in _traces(folder, lambda m: m.get("kind") == "generate").items():
            ckpt = recorded_file(st, m, "checkpoint") or folder / "(no checkpoint named)"
            inputs = recorded_file(st, m, "inputs") or folder / "(no inputs named)"
            missing = [missing_file(what, p, st, m, key) for what, p, key in
                       (("checkpoint", ckpt, "checkpoint"), ("inputs file", inputs, "inputs")) if not p.is_file()]
            if missing:
                problems.append("; ".join(missing))
                continue
            problem = digest_problem(st) or checkpoint_problem(st, m, ckpt)
            if problem is None and m.get("inputs_sha256") and file_sha256(inputs) != m["inputs_sha256"]:
                problem = f"{st}: {inputs.name} does not match the manifest's inputs_sha256 (edited or replaced)"
            if problem:
                problems.append(problem)
                continue
            cases.append(GenerateCase(st, ckpt, inputs, m))
    same = ("checkpoint", "inputs", "sampler", "scheduler", "steps", "cache")
    for i, c in enumerate(cases):
        if c.compute != "fp32":
            twin = next((o for o in cases if o.compute == "fp32" and o.trace.parent == c.trace.parent
                         and all(o.manifest.get(k) == c.manifest.get(k) for k in same)), None)
            cases[i] = dataclasses.replace(c, twin_fp32=twin.trace if twin else None)
    return cases, problems


def recording(case, cases: list) -> tuple[str, str]:
    """(the recording a case's trace belongs to, what the trace's rows judge). A low-precision trace and ComfyUI's
    fp32 twin of it are one recording: the twin's rows hold h3direct's fp32 path to the fp32 rule, and are the
    reference of the low-precision rows' ratio rule. `cases`: the cases of its kind found beside it."""
    compute = getattr(case, "compute", None) if not isinstance(case, VaeCase) else case.dtype
    if compute != "fp32":
        if case.twin_fp32 is None:
            return case.id, f"{compute}, no fp32 twin: h3direct {compute} vs ComfyUI {compute} by rounding bounds"
        return case.id, (f"{compute}: h3direct {compute} vs ComfyUI {compute}, the ratio rule against its fp32 twin "
                         f"({case.twin_fp32.stem})")
    low = next((c for c in cases if getattr(c, "twin_fp32", None) == case.trace), None)
    if low is not None:
        return low.id, (f"its fp32 twin ({case.trace.stem}): h3direct fp32 vs ComfyUI fp32, the fp32 rule; the "
                        f"ratio rule's reference")
    return case.id, "fp32: h3direct fp32 vs ComfyUI fp32, the fp32 rule"


def unused_files(roots: list[Path], dit: list[DitCase], vae: list[VaeCase], gen: list[GenerateCase],
                 problems: list[str]) -> list[str]:
    """One line for each `.json` / `.safetensors` file of the trace folders that no case uses and no problem line
    names already: what it looks like, and why the gate does not use it."""
    used: set[Path] = set()
    for c in dit:
        used |= {c.trace, c.checkpoint, c.inputs, *(p for p in (c.twin_fp32, c.sage_twin) if p is not None)}
    for c in vae:
        used |= {c.trace, c.weights, c.config, c.inputs, *(p for p in (c.twin_fp32,) if p is not None)}
    for c in gen:
        used |= {c.trace, c.checkpoint, c.inputs}
    used = {p.resolve() for p in used} | {p.resolve().with_suffix(".json") for p in used}
    named = {line.split(": ", 1)[0] for line in problems}
    same = {file_sha256(p) for p in used if p.suffix == ".safetensors" and p.is_file()}
    out = []
    for folder in trace_dirs(roots):
        for p in sorted(folder.iterdir()):
            if p.suffix not in (".json", ".safetensors") or p.resolve() in used or str(p) in named \
                    or str(p.with_suffix(".safetensors")) in named:
                continue
            why = _why_unused(p)
            if why in RESOURCE_REASONS and file_sha256(p) in same:  # a copy of a checkpoint or inputs file in use
                continue
            if why:
                out.append(f"{p}: {why}")
    return out


INPUTS_UNUSED, CHECKPOINT_UNUSED, VAE_UNUSED = ("an inputs file that no trace here pairs with",
                                               "a DiT checkpoint that no trace here names",
                                               "VAE weights that no VAE trace here uses")
RESOURCE_REASONS = (INPUTS_UNUSED, CHECKPOINT_UNUSED, VAE_UNUSED)


def _why_unused(p: Path) -> str | None:
    from safetensors import safe_open

    if p.suffix == ".json":
        m = _manifest(p)
        if m is None:
            return "not a JSON object"
        if "unet_config_detected" in m or m.get("kind") in (*VAE_KINDS, "generate"):
            if not p.with_suffix(".safetensors").is_file():
                return f"a trace manifest without its tensors ({p.with_suffix('.safetensors').name})"
            if m.get("attention") in FAST_MODES:
                return ("ComfyUI --use-sage-attention's recording, with no recording of the same case in ComfyUI's "
                        "own attention beside it (it is the class rule's reference, not a case)")
            return "a trace manifest the gate paired with no case"
        if "constructor_args" in m:
            return "a VAE config that no VAE trace here uses"
        return "not a trace manifest (no `kind`, no detected DiT config)"
    if p.with_suffix(".json").is_file():
        return None  # a trace: its manifest's line says it
    try:
        with safe_open(str(p), "pt") as f:
            keys, meta = list(f.keys()), f.metadata() or {}
    except Exception:  # noqa: BLE001 (whatever it is, it is not readable as safetensors)
        return "not a readable safetensors file"
    if "h3_inputs" in meta:
        return INPUTS_UNUSED
    weights = [k for k in keys if k.endswith(".weight")]  # (a trace's tensors are named .out, .in.N, ...)
    if any(k.startswith("blocks.") for k in weights):
        return CHECKPOINT_UNUSED
    if any(k.startswith(("decoder.", "encoder.", "dec_in_proj")) for k in weights):
        return VAE_UNUSED
    return f"no manifest beside it ({p.with_suffix('.json').name}): not a trace the gate can read"
