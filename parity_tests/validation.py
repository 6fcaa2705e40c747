"""The gate's validation set: cases its rules were not tuned on, recorded with ComfyUI on a GPU.

Each case is a synthetic checkpoint in ComfyUI's format and one Ref2VA / t2va inputs file, made here from a seed
(`build`), then recorded by ComfyUI in bf16, in fp32 (the twin) and, where SageAttention is importable, in bf16
under `--use-sage-attention` (its fast mode: the reference of the quantized-attention class) with `python -m oracle
record --device cuda` (`record`; a case recorded before without its sage recording gets it added). The folder
then holds one sub-folder per case, laid out like ../shared/oracle, so the gate runs on it
as on any trace folder:

    python -m parity_tests.validation build --out DIR [--device cuda] [--only NAME ...]
    python -m parity_tests.validation record --out DIR --comfy-root R [--jobs 8]
    pytest -m parity --trace-dir DIR --device cuda --attention B

The cases span random and structured (`make-checkpoint --attention-structure local`) attention, eight seeds, four
sizes from ~200 to ~5,000 tokens (the largest above sol_attn's minimum, so its kernel runs), bf16 and NVFP4
weights, curve and full adaLN, and one case at full model size (50 blocks, hidden 5,376, NVFP4) with a small S.
What each case is and what the gate measured on it: fixtures/validation/README.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from h3direct.checkpoint.synthetic import LOCAL_SHIFT, LOCAL_STRENGTH


@dataclass(frozen=True)
class Case:
    name: str
    preset: str
    adaln: str  # curve | full
    quant: str  # none | nvfp4
    structure: str  # random | local
    seed: int
    task: str  # t2va | ref2va
    video: tuple[int, int, int]  # latent T, H, W (24 channels)
    audio_t: int
    text_len: int
    ref: tuple[int, int] | None = None  # image reference latent H, W (ref2va)
    sigma: float = 0.8  # where in a schedule the step is (early: near 1, late: near 0)
    sizes: tuple[tuple[str, int], ...] = ()  # the preset's sizes changed (heads, text_dim, ...), as H3Config fields
    strength: float = LOCAL_STRENGTH  # local structure: `make-checkpoint --attention-strength` (the logit temperature)
    shift: float = LOCAL_SHIFT  # local structure: `--attention-shift` (the positional part's size)

    @property
    def structured(self) -> bool:
        """Local attention at a length where the approximate modes engage (sol_attn's kernel from 4,096 tokens):
        the cases the frontier and the tiers are judged on."""
        return self.structure == "local" and seq_len(self) >= STRUCTURED_MIN_TOKENS

    @property
    def checkpoint(self) -> str:
        return f"h3_{self.name}.safetensors"

    @property
    def inputs(self) -> str:
        return f"inputs_{self.name}.safetensors"

    def detail(self) -> str:
        return "reduced" if self.preset.startswith("full") else "full"


STRUCTURED_MIN_TOKENS = 5000

CASES = [
    Case("v1_random_bf16_s260", "small", "curve", "none", "random", 101, "t2va", (4, 8, 16), 50, 32),
    Case("v2_random_nvfp4_s1144", "small", "full", "nvfp4", "random", 102, "ref2va", (6, 16, 32), 100, 48, (16, 32)),
    Case("v3_local_bf16_s2044", "small", "curve", "none", "local", 103, "ref2va", (6, 24, 40), 150, 64, (24, 40)),
    Case("v4_local_nvfp4_s5072", "small", "curve", "nvfp4", "local", 104, "ref2va", (8, 32, 64), 200, 64, (32, 64)),
    Case("v5_local_bf16_s5584", "small", "full", "none", "local", 105, "t2va", (10, 32, 64), 200, 64),
    Case("v6_random_bf16_s2044", "small", "full", "none", "random", 106, "ref2va", (6, 24, 40), 150, 64, (24, 40)),
    Case("v7_local_nvfp4_s260", "small", "curve", "nvfp4", "local", 107, "t2va", (4, 8, 16), 50, 32),
    Case("v8_full_random_nvfp4_s360", "full", "curve", "nvfp4", "random", 108, "ref2va", (3, 12, 16), 40, 112, (8, 12)),
    # structured, S >= 5,000, other heads, text widths, adaLN forms, weights and places in a schedule
    Case("v9_local_bf16_h4_s6224_late", "small", "curve", "none", "local", 109, "t2va", (10, 32, 72), 200, 64,
         sigma=0.2, sizes=(("num_attention_heads", 4), ("hidden_size", 512), ("ffn_hidden_size", 1024))),
    Case("v10_local_nvfp4_td192_s6768_mid", "small", "full", "nvfp4", "local", 110, "ref2va", (12, 32, 60), 200, 96,
         (32, 64), sigma=0.5, sizes=(("text_dim", 192),)),
    Case("v11_local_bf16_s8656_early", "small", "curve", "none", "local", 111, "t2va", (16, 32, 64), 200, 64,
         sigma=0.95),
    Case("v12_local_nvfp4_h3_s5664_late", "small", "full", "nvfp4", "local", 112, "ref2va", (10, 32, 64), 120, 64,
         (24, 40), sigma=0.35, sizes=(("num_attention_heads", 3), ("hidden_size", 384), ("ffn_hidden_size", 768))),
    # the rest of the structured set: what sparse attention is sensitive to, one axis at a time from v4/v5's
    # geometry: the local window (strength: the logit temperature, wider below 1.5, narrower above; shift: how much
    # of q/k is positional), 6 and 8 heads, S up to the workload's 20,050, the text length, a large reference, sigma
    # near 0 and near 1, and two more seeds of v4's form (NVFP4, curve adaLN, ref2va at S = 5,072)
    Case("v13_local_bf16_wide_s5072", "small", "curve", "none", "local", 113, "t2va", (9, 32, 64), 200, 64,
         strength=1.0),
    Case("v14_local_bf16_narrow_s5072", "small", "curve", "none", "local", 114, "t2va", (9, 32, 64), 200, 64,
         strength=2.2),
    Case("v15_local_nvfp4_wide_s5072", "small", "curve", "nvfp4", "local", 115, "ref2va", (8, 32, 64), 200, 64,
         (32, 64), strength=1.0, shift=2.0),
    Case("v16_local_nvfp4_narrow_s5072", "small", "curve", "nvfp4", "local", 116, "ref2va", (8, 32, 64), 200, 64,
         (32, 64), sigma=0.6, strength=2.2, shift=4.0),
    Case("v17_local_bf16_weak_s5724", "small", "full", "none", "local", 117, "ref2va", (8, 40, 64), 150, 64, (24, 40),
         sigma=0.7, shift=1.5),
    Case("v18_local_nvfp4_h8_s5072", "small", "curve", "nvfp4", "local", 118, "t2va", (9, 32, 64), 200, 64,
         sizes=(("num_attention_heads", 8), ("hidden_size", 1024), ("ffn_hidden_size", 2048))),
    Case("v19_local_bf16_h6_s5424", "small", "full", "none", "local", 119, "ref2va", (10, 32, 56), 200, 96, (32, 56),
         sigma=0.5, sizes=(("num_attention_heads", 6), ("hidden_size", 768), ("ffn_hidden_size", 1536))),
    Case("v20_local_nvfp4_s11896", "small", "curve", "nvfp4", "local", 120, "ref2va", (12, 48, 72), 300, 64, (48, 72)),
    Case("v21_local_bf16_s16088", "small", "curve", "none", "local", 121, "t2va", (16, 48, 80), 300, 128, sigma=0.6),
    Case("v22_local_nvfp4_s20024", "small", "curve", "nvfp4", "local", 122, "ref2va", (20, 46, 80), 300, 64, (48, 80)),
    Case("v23_local_bf16_wide_s20016", "small", "full", "none", "local", 123, "t2va", (20, 48, 80), 360, 96, sigma=0.4,
         strength=1.1),
    Case("v24_local_bf16_text256_s5264", "small", "curve", "none", "local", 124, "t2va", (9, 32, 64), 200, 256),
    Case("v25_local_nvfp4_text16_s5024", "small", "full", "nvfp4", "local", 125, "t2va", (9, 32, 64), 200, 16),
    Case("v26_local_bf16_bigref_s6096", "small", "curve", "none", "local", 126, "ref2va", (8, 32, 64), 200, 64,
         (64, 96)),
    Case("v27_local_nvfp4_sigma01_s5072", "small", "curve", "nvfp4", "local", 127, "ref2va", (8, 32, 64), 200, 64,
         (32, 64), sigma=0.1),
    Case("v28_local_bf16_sigma099_s5584", "small", "full", "none", "local", 128, "t2va", (10, 32, 64), 200, 64,
         sigma=0.99),
    Case("v29_local_nvfp4_v4b_s5072", "small", "curve", "nvfp4", "local", 129, "ref2va", (8, 32, 64), 200, 64,
         (32, 64)),
    Case("v30_local_nvfp4_v4c_s5072", "small", "curve", "nvfp4", "local", 130, "ref2va", (8, 32, 64), 200, 64,
         (32, 64)),
]


def structured() -> list[Case]:
    return [c for c in CASES if c.structured]


def recorded(folder: Path):
    """The bf16 case (`discovery.DitCase`) recorded in `folder` with ComfyUI's fp32 twin, or None."""
    from parity_tests.discovery import find_dit_cases

    if not folder.is_dir():
        return None
    cases, _ = find_dit_cases([folder])
    return next((c for c in cases if c.compute == "bf16" and c.twin_fp32 is not None), None)


def judgeable(folder: Path):
    """(the bf16 case recorded in `folder` with ComfyUI's fp32 twin and its --use-sage-attention recording, None), or
    (None, why not): what the tiers' quality needs of a case."""
    case = recorded(folder)
    if case is None:
        return None, "no ComfyUI bf16 trace with its fp32 twin"
    if case.sage_twin is None:
        return None, "no ComfyUI --use-sage-attention recording (`--sage-twin`; SageAttention must be importable)"
    return case, None


def own_cases(root: Path) -> tuple[list[str], dict[str, str]]:
    """The user's own cases in `root` beside the validation set's (any folder of `root` that is not a case of
    `CASES`, recorded with ComfyUI as `python -m oracle record` records one): (the names of those judged with the
    structured cases: a bf16 trace with its fp32 twin and its --use-sage-attention recording, S >=
    STRUCTURED_MIN_TOKENS), {name: why not} of the others."""
    known = {c.name for c in CASES}
    counted, not_counted = [], {}
    for folder in sorted(d for d in root.iterdir() if d.is_dir() and d.name not in known) if root.is_dir() else []:
        case, why = judgeable(folder)
        if case is None:
            not_counted[folder.name] = why
            continue
        s = json.loads(case.trace.with_suffix(".json").read_text()).get("layout", {}).get("seq_len")
        if not isinstance(s, int) or s < STRUCTURED_MIN_TOKENS:
            not_counted[folder.name] = f"S = {s}, below {STRUCTURED_MIN_TOKENS:,} (the approximate modes' range)"
            continue
        counted.append(folder.name)
    return counted, not_counted


def seq_len(case: Case) -> int:
    """The packed sequence length of a case (h3direct's layout, as ComfyUI packs it)."""
    import torch

    from h3direct.dit.sequence import build_layout

    t, h, w = case.video
    refs = [{"kind": "image", "latent": torch.zeros(1, 24, 1, *case.ref), "latent_h": case.ref[0],
             "latent_w": case.ref[1]}] if case.ref else []
    return build_layout(case.text_len, t, h, w, case.audio_t, refs=refs).seq_len


def write_inputs(case: Case, path: Path, text_dim: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(case.seed)
    video, audio = (1, 24, *case.video), (1, 32, 2, case.audio_t)
    sigma = torch.tensor([case.sigma], dtype=torch.float32)
    t = {"video_noise": torch.randn(video, generator=g), "audio_noise": torch.randn(audio, generator=g),
         "video_latent": torch.randn(video, generator=g), "audio_latent": torch.randn(audio, generator=g),
         "text_states": torch.randn(1, case.text_len, text_dim, generator=g), "sigma": sigma}
    tags = torch.ones(case.text_len, dtype=torch.int64)
    desc = {"schema": "h3-oracle-inputs/1", "sigma": float(sigma), "sampler_seed": case.seed, "task": case.task,
            "variant": case.name, "text_states": "text_states", "token_tags": "token_tags"}
    if case.ref:
        t["ref_image_latent"] = torch.randn(1, 24, 1, *case.ref, generator=g)
        tags[3:3 + min(4, case.text_len - 4)] = 0  # the reference's vision pads inside the prompt
        desc["refs"] = [{"kind": "image", "latent": "ref_image_latent", "latent_h": case.ref[0],
                         "latent_w": case.ref[1]}]
    t["token_tags"] = tags
    save_file(t, str(path), metadata={"h3_inputs": json.dumps(desc, sort_keys=True)})


def sizes_of(case: Case) -> dict:
    """The case's whole DiT config (its preset's, in the case's adaLN form, with its sizes changed) as
    `make-checkpoint --config` takes it."""
    import dataclasses

    from h3direct.checkpoint.synthetic import resolve_config

    cfg = dataclasses.replace(resolve_config(case.preset, None, case.adaln), **dict(case.sizes))
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


def build(out: Path, *, device: str = "cpu", only: list[str] | None = None) -> list[Case]:
    from h3direct.checkpoint.synthetic import resolve_config

    cases = [c for c in CASES if not only or c.name in only]
    for c in cases:
        folder = out / c.name
        folder.mkdir(parents=True, exist_ok=True)
        ckpt = folder / c.checkpoint
        if not ckpt.is_file():
            cmd = [sys.executable, "-m", "h3direct", "make-checkpoint", "--preset", c.preset, "--adaln", c.adaln,
                   "--quant", c.quant, "--seed", str(c.seed), "--attention-structure", c.structure, "--device",
                   device, "--output", str(ckpt)] + (["--config", json.dumps(sizes_of(c))] if c.sizes else [])
            cmd += ["--attention-strength", str(c.strength)] if c.strength != LOCAL_STRENGTH else []
            cmd += ["--attention-shift", str(c.shift)] if c.shift != LOCAL_SHIFT else []
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"validation build {c.name}: {(r.stderr or r.stdout).strip()[-400:]}")
        cfg = resolve_config(c.preset, json.dumps(sizes_of(c)) if c.sizes else None, c.adaln)
        write_inputs(c, folder / c.inputs, cfg.text_dim)
        print(f"{c.name}: S = {seq_len(c)}, {c.preset}/{c.adaln}{' ' + str(dict(c.sizes)) if c.sizes else ''}, "
              f"{c.quant}, {c.structure} (strength {c.strength}, shift {c.shift}), seed {c.seed}, sigma {c.sigma}")
    return cases


def record(out: Path, comfy_root: str, *, device: str = "cuda", jobs: int = 8,
           only: list[str] | None = None, sage: bool | None = None) -> int:
    """ComfyUI's bf16 trace, its fp32 twin and its sage recording of every case (one process each, `jobs` at a
    time). sage: record ComfyUI --use-sage-attention too (None: where SageAttention is importable)."""
    from oracle.record import sage_importable, sage_path

    sage = sage_importable() if sage is None else sage
    runs = []
    for c in [c for c in CASES if not only or c.name in only]:
        folder = out / c.name
        trace = folder / f"trace_{c.name}_bf16.safetensors"  # `oracle record` writes the twins beside it
        cmd = [sys.executable, "-m", "oracle", "record", "--comfy-root", comfy_root, "--device", device,
               "--checkpoint", str(folder / c.checkpoint), "--inputs", str(folder / c.inputs),
               "--compute-dtype", "bf16", "--detail", c.detail()]
        if not trace.is_file():
            runs.append(cmd + ["--sage-twin" if sage else "--no-sage-twin", "--out", str(trace)])
        elif sage and not sage_path(trace).is_file():
            runs.append(cmd + ["--attention", "sage", "--no-twin", "--no-sage-twin", "--out", str(sage_path(trace))])

    def one(cmd):
        r = subprocess.run(cmd, capture_output=True, text=True)
        print(f"{Path(cmd[-1]).name}: exit {r.returncode} {(r.stdout or r.stderr).strip().splitlines()[-1:]}",
              flush=True)
        return r.returncode

    with ThreadPoolExecutor(jobs) as pool:
        codes = list(pool.map(one, runs))
    return max(codes, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parity_tests.validation", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write every case's checkpoint and inputs file")
    r = sub.add_parser("record", help="record ComfyUI's bf16 trace and fp32 twin of every case")
    sub.add_parser("list", help="the cases and their sequence lengths")
    for q in (b, r):
        q.add_argument("--out", required=True, type=Path)
        q.add_argument("--only", action="append", help="a case name (repeatable)")
    b.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where make-checkpoint draws tensors")
    r.add_argument("--comfy-root", required=True)
    r.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    r.add_argument("--jobs", type=int, default=8)
    r.add_argument("--sage-twin", action=argparse.BooleanOptionalAction, default=None,
                   help="record ComfyUI --use-sage-attention too (default: where SageAttention is importable)")
    args = p.parse_args(argv)
    if args.cmd == "list":
        for c in CASES:
            print(f"{c.name}: S = {seq_len(c)}" + (", structured" if c.structured else ""))
        return 0
    if args.cmd == "build":
        build(args.out, device=args.device, only=args.only)
        return 0
    return record(args.out, args.comfy_root, device=args.device, jobs=args.jobs, only=args.only, sage=args.sage_twin)


if __name__ == "__main__":
    raise SystemExit(main())
