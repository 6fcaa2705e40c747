"""End-to-end frames gate of the approximate paths (issue 12): a short generation through h3direct's own pipeline,
once on the exact path and once on an approximate one, both decoded to frames and compared frame by frame.

An *approximate path* is named like an attention backend: every registered backend that is not exact (sage2,
ck_int8, sol_attn, kj_head_sliced over an approximate inner backend, and any later one such as fa3_fp8 -- found by
`h3direct.dit.attention.is_exact`, so a new backend plugs in by registering), plus `fp8_linear`, the opt-in FP8
block linears (`generate --fp8-linear`). A path is a set of `generate` flags: `--attention NAME`, or
`--attention <exact reference> --fp8-linear`, or a combination `NAME+fp8_linear` (`--attention NAME --fp8-linear`: the
contract's approximate path is `sol_attn+fp8_linear`, keyed weights "fp8_w8a8", attention NAME); the runs are built
from the same argument parser and `load_pipeline`
as `python -m h3direct generate`, so whatever a flag does there it does here.

The exact reference of a device: fa3 (sm_90, fa3-fwd importable), else cudnn_sdpa, else sdpa. Same seed, same inputs
and geometry; only the path's flags differ. The video latent of each run is decoded by the pipeline's video VAE to
float frames in [0, 1] (before the uint8 rounding of an mp4, which would hide errors under 1/255) and compared:
PSNR per frame (peak 1) and SSIM per frame (scikit-image, data range 1), mean and min over frames, against the
budgets entry of mode "e2e", kind "frames", attention = the path name (fp8_linear: weights "fp8_w8a8", attention =
the reference), fields psnr_db, psnr_min_db, ssim_mean, ssim_min. No entry -> "no calibrated budget" (there is no
catch-all).

The model: a folder made by `python benchmarks/e2e_frames.py build` (`e2e.json` beside a DiT, the two VAEs and a
text-embeds file; the GPU gate uses a head_dim-128 "small" DiT at S ~ 4.5 k tokens so that sol_attn runs its
kernel), or None: the bundled tiny models at the bundled default size (CPU tests).

    from parity_tests.e2e_frames import E2EModel, compare_paths
    print(compare_paths(E2EModel.load("/tmp/e2e"), "sage2", device="cuda").report())
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3direct.dit.linear import FP8_WEIGHTS_KEY as FP8_WEIGHTS
from h3direct.errors import H3Error
from h3direct.traces import metrics
from h3direct.traces.budgets import Budget, BudgetTable, frames_verdict, load_budgets
from parity_tests.gate import CaseResult, KeyedBudgets, LayerResult

FP8_LINEAR = "fp8_linear"
REFERENCES = ("fa3", "cudnn_sdpa", "sdpa")  # the exact reference of a device: the first one available
SPEC = "e2e.json"
BUNDLED_PROMPT = "a red ball rolls across a wooden table"


# ---- the model and the request ------------------------------------------------------------------

@dataclass(frozen=True)
class E2EModel:
    """What both runs generate with. root None: the bundled tiny models (text through the bundled encoder)."""

    root: Path | None = None
    width: int = 96
    height: int = 64
    frames: int = 22
    steps: int = 4
    seed: int = 0
    weights: str = "bf16"  # the budgets key of the DiT checkpoint
    vae_config: str = "tiny"
    files: dict = field(default_factory=dict)  # dit, video_vae, audio_vae, text_embeds: names inside root
    about: str = "bundled tiny models"

    @classmethod
    def load(cls, root: str | Path | None) -> E2EModel:
        if root is None:
            return cls()
        root = Path(root)
        try:
            spec = json.loads((root / SPEC).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise H3Error(f"not an e2e model folder (needs {SPEC}, made by benchmarks/e2e_frames.py build): {exc}",
                          path=root) from None
        keys = ("width", "height", "frames", "steps", "seed", "weights", "vae_config", "files", "about")
        return cls(root=root, **{k: spec[k] for k in keys if k in spec})

    @property
    def id(self) -> str:
        where = self.root.name if self.root is not None else "bundled"
        return f"e2e_{where}_{self.width}x{self.height}x{self.frames}_{self.steps}steps"

    def argv(self) -> list[str]:
        a = ["--width", str(self.width), "--height", str(self.height), "--frames", str(self.frames),
             "--steps", str(self.steps), "--seed", str(self.seed)]
        if self.root is None:
            return a + ["--prompt", BUNDLED_PROMPT]
        f = {k: str(self.root / v) for k, v in self.files.items()}
        return a + ["--checkpoint", f["dit"], "--vae", f["video_vae"], "--audio-vae", f["audio_vae"],
                    "--vae-config", self.vae_config, "--text-embeds", f["text_embeds"]]


# ---- paths ----------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise H3Error(f"generate flags: {message}")


def generate_parser() -> argparse.ArgumentParser:
    from h3direct.app import generate

    p = _Parser(prog="h3direct generate")
    generate.add_arguments(p)
    return p


def knows_flag(flag: str) -> bool:
    return any(flag in a.option_strings for a in generate_parser()._actions)


def compute_of(device: str) -> str:
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def _probe(device: str) -> torch.Tensor:
    return torch.empty(0, device=device, dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[compute_of(device)])


def exact_reference(device: str) -> str:
    from h3direct.dit.attention import unavailable_reason

    probe = _probe(device)
    return next(n for n in REFERENCES if unavailable_reason(n, probe) is None)  # sdpa runs everywhere


def split_path(path: str) -> tuple[str | None, bool]:
    """(attention backend or None = the exact reference, FP8 linears?) of a path: "fp8_linear" -> (None, True),
    "NAME+fp8_linear" -> (NAME, True), "NAME" -> (NAME, False)."""
    if path == FP8_LINEAR:
        return None, True
    name, plus, rest = path.partition("+")
    if plus and rest == FP8_LINEAR and name:
        return name, True
    return path, False


def kind_of(path: str) -> str:
    """'approximate', 'exact' or 'unknown' (an unknown name is gated, and fails naming itself)."""
    from h3direct.dit.attention import backends, is_exact

    attention, fp8 = split_path(path)
    if fp8:
        return "approximate" if attention is None or attention in backends() else "unknown"
    if path not in backends():
        return "unknown"
    return "exact" if is_exact(path) else "approximate"


def unavailable(path: str, device: str) -> str | None:
    """Why `path` cannot run on `device` (None: it can)."""
    from h3direct.dit.attention import unavailable_reason

    attention, fp8 = split_path(path)
    if fp8 and not knows_flag("--fp8-linear"):
        return "this h3direct's generate has no --fp8-linear"
    if attention is None or kind_of(path) == "unknown":
        return None  # fp8_linear over the reference; an unknown name is not a skip: the run fails with one line
    return unavailable_reason(attention, _probe(device))


def path_flags(path: str, reference: str) -> list[str]:
    attention, fp8 = split_path(path)
    return ["--attention", attention or reference] + (["--fp8-linear"] if fp8 else [])


# ---- one run --------------------------------------------------------------------------------------

@dataclass
class FramesRun:
    frames: torch.Tensor  # float32 [T, H, W, 3] in [0, 1], on the CPU
    flags: list[str]
    seconds: float
    attention_calls: dict
    tokens: int  # video + audio rows of the DiT's packed sequence (the text rows come on top)


def run_frames(model: E2EModel, flags: list[str], *, device: str = "cpu") -> FramesRun:
    """One generation (the pipeline's own sampler and models), decoded to float frames. `flags`: extra `generate`
    flags (the path)."""
    from h3direct.app.generate import load_pipeline, resolve_args
    from h3direct.dit.attention import attention_stats, reset_attention_stats
    from h3direct.vae.api import decode_video

    argv = model.argv() + ["--device", device, "--vae-dtype", "fp32", "--quiet"] + list(flags)
    args = resolve_args(generate_parser().parse_args(argv), check_output=False)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        pipe, _, _, _ = load_pipeline(args)
        reset_attention_stats()
        res = pipe.generate(args.prompt, text_embeds=args.text_embeds, width=args.width, height=args.height,
                            frames=args.frames, steps=args.steps, seed=args.seed, sampler=args.sampler,
                            scheduler=args.scheduler, cfg=args.cfg, decode=False)
        calls = attention_stats()
        with torch.inference_mode():
            px = decode_video(pipe.video_vae, res.video_latent.to(pipe.device), dtype=pipe.vae_dtype,
                              tile_size=pipe.vae_tile_size)
        frames = px[0].float().cpu()
        tokens = _tokens(pipe, res)
    finally:
        torch.set_num_threads(threads)
    return FramesRun(frames, list(flags), time.perf_counter() - t0, calls, tokens)


def _tokens(pipe, res) -> int:
    c = pipe.dit.config
    _, _, t, h, w = res.video_latent.shape
    _, ph, pw = c.patch_size
    return t * math.ceil(h / ph) * math.ceil(w / pw) + res.audio_latent.shape[-1]


# ---- comparison and verdict -----------------------------------------------------------------------

_PAIR: tuple | None = None  # the clips of a parallel SSIM (read by forked workers, never copied)


def _ssim_one(i: int) -> float:
    from skimage.metrics import structural_similarity

    a, b, win = _PAIR
    return float(structural_similarity(a[i], b[i], channel_axis=-1, data_range=1.0, win_size=win))


def frame_metrics(ours: torch.Tensor, ref: torch.Tensor, workers: int | None = None) -> dict[str, float]:
    """parity_tests.vae_gate.frame_metrics (PSNR peak 1, scikit-image SSIM data range 1, mean and min over
    frames) with the per-frame SSIM spread over `workers` forked processes (default: up to 16 for clips over
    4 Mpx; the gate's clips are ~15 Mpx, ~0.1-0.25 s of SSIM per 512^2 frame)."""
    import os

    from parity_tests.vae_gate import frame_metrics as serial

    a = ours.double().reshape(-1, *ours.shape[-3:]).numpy()
    b = ref.double().reshape(-1, *ref.shape[-3:]).numpy()
    if workers is None:
        workers = min(16, os.cpu_count() or 1, len(a)) if a.size > 4e6 * 3 else 1
    if workers <= 1:
        return serial(ours, ref)
    import multiprocessing

    global _PAIR
    mse = ((a - b) ** 2).reshape(len(a), -1).mean(1)
    psnr = [math.inf if m == 0 else 10.0 * math.log10(1.0 / m) for m in mse.tolist()]
    side = min(a.shape[1:3])
    _PAIR = (a, b, 7 if side >= 7 else max(3, side - 1 + side % 2))
    try:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            ssim = pool.map_async(_ssim_one, range(len(a))).get(timeout=300)
    except multiprocessing.TimeoutError:  # a forked worker stuck (e.g. on a lock of the parent's threads)
        return serial(ours, ref)
    finally:
        _PAIR = None
    return {"psnr_mean": sum(psnr) / len(psnr), "psnr_min": min(psnr), "ssim_mean": sum(ssim) / len(ssim),
            "ssim_min": min(ssim), "frames": len(psnr)}


def budget_key(path: str, compute: str, weights: str, reference: str) -> dict:
    """The budgets key of a path's e2e frames entry: attention = the path; for fp8_linear, as every FP8-linear
    comparison of the gate is keyed, weights = "fp8_w8a8" and attention = the (exact) reference it runs with."""
    attention, fp8 = split_path(path)
    if fp8:
        return {"mode": "e2e", "kind": "frames", "compute": compute, "weights": FP8_WEIGHTS,
                "attention": attention or reference}
    return {"mode": "e2e", "kind": "frames", "compute": compute, "weights": weights, "attention": path}


def frames_budget(budgets: BudgetTable, path: str, compute: str, weights: str, reference: str = "sdpa") -> Budget:
    """The e2e frames entry of `path`; an entry without any frames floor is no frames budget, and an fp8_linear
    run takes only an entry that names weights "fp8_w8a8" (never one of the checkpoint's own weights or "*")."""
    key = budget_key(path, compute, weights, reference)
    b = (KeyedBudgets(budgets, FP8_WEIGHTS) if split_path(path)[1] else budgets).lookup(**key)
    if all(x is None for x in (b.psnr_db, b.psnr_min_db, b.ssim_mean, b.ssim_min)):
        what = f"e2e frames, {compute}, {key['weights']}, {key['attention']}"
        raise H3Error(f"no calibrated budget for ({what}): the matching entry has no PSNR/SSIM floor; add a "
                      f"calibrated e2e frames entry to the budgets table", path=budgets.path)
    return b


@dataclass
class E2ECase:
    id: str
    compute: str
    weights: str


def judge(model: E2EModel, path: str, ours: FramesRun, ref: FramesRun, b: Budget, *, compute: str,
          reference: str) -> CaseResult:
    if ours.frames.shape != ref.frames.shape:
        raise H3Error(f"{path}: frames {tuple(ours.frames.shape)} != exact {tuple(ref.frames.shape)}")
    fm = frame_metrics(ours.frames, ref.frames)
    ok, rule = frames_verdict(b, fm)
    case = E2ECase(model.id, compute, model.weights)
    result = CaseResult(case, "e2e", path, title=f"{model.id} [e2e frames, {compute}, {model.weights}, {path} vs "
                        f"{reference}]", unit="comparison", action="reproduce", attention_calls=ours.attention_calls)
    redo = (f"python benchmarks/e2e_frames.py compare --model {model.root or 'bundled'} --paths {path} "
            f"--device {'cuda' if compute == 'bf16' else 'cpu'}")
    result.layers.append(LayerResult("frames", "frames", "e2e", metrics.rel_l2(ours.frames, ref.frames),
                                     metrics.sqnr_db(ours.frames, ref.frames),
                                     metrics.max_abs(ours.frames, ref.frames), ok, rule, b.provenance, redo))
    result.frame_metrics = fm
    return result


def compare_paths(model: E2EModel, path: str, *, device: str = "cpu", budgets: BudgetTable | None = None,
                  reference: str | None = None, exact_run: FramesRun | None = None) -> CaseResult:
    """Exact reference vs `path` on `model`, judged by the e2e frames entry of `path` (looked up before any
    compute). `exact_run`: a reference run to reuse."""
    budgets = budgets or load_budgets()
    compute = compute_of(device)
    reference = reference or exact_reference(device)
    b = frames_budget(budgets, path, compute, model.weights, reference)
    ref = exact_run or run_frames(model, ["--attention", reference], device=device)
    ours = run_frames(model, path_flags(path, reference), device=device)
    return judge(model, path, ours, ref, b, compute=compute, reference=reference)


@contextlib.contextmanager
def budgets_with(entries: list[dict]):
    """A temporary budgets table of `entries` (dicts of the TOML fields): tests and calibration."""
    import tempfile

    lines = []
    for e in entries:
        lines.append("[[budget]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in e.items()]
        lines.append("")
    with tempfile.TemporaryDirectory(prefix="h3_e2e_budgets_") as d:
        p = Path(d) / "budgets.toml"
        p.write_text("\n".join(lines))
        yield load_budgets(p)
