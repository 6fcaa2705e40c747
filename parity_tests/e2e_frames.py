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
rel-L2, PSNR per frame (peak 1) and SSIM per frame (scikit-image, data range 1), mean and min over frames, and the
audio latent decoded by the audio VAE to a waveform (its rel-L2 and SNR). Where the exact path runs in a low
precision (bf16 on CUDA) it also runs once in fp32 (sdpa): its own error against that run is the rounding scale of
the drift rule. The frames' and the waveform's rel-L2 are what the mode records in its baseline beside the model
folder (`drift.py`: `<model>/baselines/`, the bundled models' in `fixtures/baselines/`); the pytest item holds them
to it.

The model: a folder made by `python -m parity_tests.e2e_frames build` (`e2e.json` beside a DiT, the two VAEs and a
text-embeds file; the GPU gate uses a head_dim-128 "small" DiT at S ~ 4.5 k tokens so that sol_attn runs its
kernel), or None: the bundled tiny models at the bundled default size (CPU tests).

    from parity_tests.e2e_frames import E2EModel, compare_paths
    print(compare_paths(E2EModel.load("/tmp/e2e"), "sage2", device="cuda").report())
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from h3direct.dit.options import assignments
from h3direct.errors import H3Error, RequestError, flag_name
from h3direct.traces import metrics
from parity_tests.results import CaseResult, LayerResult

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
            raise H3Error(f"not an e2e model folder (needs {SPEC}, made by python -m parity_tests.e2e_frames "
                          f"build): {exc}", path=root) from None
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
    from h3direct.app import cli_generate

    p = _Parser(prog="h3direct generate")
    cli_generate.add_arguments(p)
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


def unavailable(path: str, device: str, options=None) -> str | None:
    """Why `path` cannot run on `device` with the attention backends' `options` (an AttentionOptions, e.g. the gate's
    `--option` values; None: their defaults). None: it can."""
    from h3direct.dit.attention import as_options, unavailable_reason

    attention, fp8 = split_path(path)
    if fp8 and not knows_flag("--fp8-linear"):
        return "this h3direct's generate has no --fp8-linear"
    if attention is None or kind_of(path) == "unknown":
        return None  # fp8_linear over the reference; an unknown name is not a skip: the run fails with one line
    return unavailable_reason(as_options(options or attention).using(attention), _probe(device))


def path_flags(path: str, reference: str, options: dict | None = None) -> list[str]:
    """`generate`'s flags of a path; `options`: {flat name: value} of the attention backends' options, as their
    flags (`--sol-tau 2.0`, `--no-sol-exact-rows`)."""
    attention, fp8 = split_path(path)
    flags = ["--attention", attention or reference] + (["--fp8-linear"] if fp8 else [])
    for name, value in (options or {}).items():
        flag = flag_name(name)
        flags += [flag if value else "--no-" + flag[2:]] if isinstance(value, bool) else [flag, str(value)]
    return flags


# ---- one run --------------------------------------------------------------------------------------

@dataclass
class FramesRun:
    frames: torch.Tensor  # float32 [T, H, W, 3] in [0, 1], on the CPU
    waveform: torch.Tensor  # float32 [channels, samples], on the CPU
    flags: list[str]
    seconds: float
    attention_calls: dict
    tokens: int  # video + audio rows of the DiT's packed sequence (the text rows come on top)


def run_frames(model: E2EModel, flags: list[str], *, device: str = "cpu") -> FramesRun:
    """One generation (the pipeline's own sampler and models), decoded to float frames. `flags`: extra `generate`
    flags (the path)."""
    from h3direct.app.cli_generate import parse
    from h3direct.app.models import load_pipeline
    from h3direct.vae.api import decode_audio, decode_video

    argv = model.argv() + ["--device", device, "--vae-dtype", "fp32", "--quiet"] + list(flags)
    try:
        job = parse(generate_parser().parse_args(argv), output=False)
    except RequestError as exc:
        raise H3Error(f"generate flags: {exc.render(flag_name)}") from None
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        pipe, _, _, _ = load_pipeline(job.spec, job.options.kernels, text_encoder=job.request.text_embeds is None)
        res = pipe.generate(job.request, job.options, decode=False)
        calls = res.calls.get("attention", {})
        with torch.inference_mode():
            px = decode_video(pipe.video_vae, res.video_latent.to(pipe.device), dtype=pipe.vae_dtype,
                              tile_size=pipe.vae_tile_size)
            wave = decode_audio(pipe.audio_vae, res.audio_latent.to(pipe.device))
        frames = px[0].float().cpu()
        tokens = _tokens(pipe, res)
    finally:
        torch.set_num_threads(threads)
    return FramesRun(frames, wave.reshape(-1, wave.shape[-1]).float().cpu(), list(flags), time.perf_counter() - t0,
                     calls, tokens)


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


@dataclass
class E2ECase:
    id: str
    compute: str
    weights: str


@dataclass(frozen=True)
class FramesReplay:
    """How one row of the e2e frames gate is re-run (`python -m parity_tests.e2e_frames compare`): the model folder,
    the path and its options, the device; for a drift row, the baseline it was held to and the drift rule (the
    `oracle.request.ReplayRequest` protocol: `at`, `command`, `unreplayable`)."""

    model: str  # a model folder, or "bundled"
    path: str
    device: str = "cpu"
    options: dict = field(default_factory=dict)
    layer: str = ""
    baseline: Path | None = None
    rule: object = None  # oracle.request.Rule
    unreplayable: str = ""

    def at(self, layer: str, rule=None) -> FramesReplay:
        return dataclasses.replace(self, layer=layer, rule=rule)

    def command(self) -> str:
        import shlex

        a = ["compare", "--model", self.model, "--path", self.path, "--device", self.device]
        for item in assignments(self.options):
            a += ["--option", item]
        if self.baseline is not None:
            a += ["--baseline", str(self.baseline), "--quantity", self.layer.removeprefix("drift.")]
            a += self.rule.flags() if self.rule is not None else []
        return "python -m parity_tests.e2e_frames " + shlex.join(a)


def mode_label(path: str, options: dict | None = None) -> str:
    """The label of a path with its options (`sol_attn+fp8_linear (sol_tau=2.5)`): its baseline's name."""
    spelled = assignments(options or {})
    return path + (f" ({', '.join(spelled)})" if spelled else "")


def judge(model: E2EModel, path: str, ours: FramesRun, ref: FramesRun, *, compute: str, reference: str,
          options: dict | None = None, fp32: FramesRun | None = None, device: str = "cpu") -> CaseResult:
    """The path's decoded frames and waveform against the exact path's, reported and measured for the path's
    baseline (`drift.py`); `fp32`: the exact path's fp32 run, whose distance to `ref` is the rounding scale."""
    from parity_tests.drift import Quantity

    if ours.frames.shape != ref.frames.shape:
        raise H3Error(f"{path}: frames {tuple(ours.frames.shape)} != exact {tuple(ref.frames.shape)}")
    case = E2ECase(model.id, compute, model.weights)
    label = mode_label(path, options)
    result = CaseResult(case, "e2e", label, title=f"{model.id} [quality, {compute}, {model.weights}, {label} vs "
                        f"{reference}]", unit="comparison", action="reproduce", attention_calls=ours.attention_calls,
                        approx=label)
    result.drift_request = FramesReplay(str(model.root or "bundled"), path, device, dict(options or {}))
    redo = result.drift_request.command()
    fm = frame_metrics(ours.frames, ref.frames)
    for name, a, e, m in (("frames", ours.frames, ref.frames, fm), ("waveform", ours.waveform, ref.waveform, None)):
        rel = metrics.rel_l2(a, e)
        scale = metrics.rel_l2(e, getattr(fp32, name)) if fp32 is not None else 0.0
        result.measured[name] = Quantity(rel, scale, 2)
        info = (f"{fm['frames']} frames: PSNR mean {fm['psnr_mean']:.2f} / min {fm['psnr_min']:.2f} dB, SSIM mean "
                f"{fm['ssim_mean']:.6f} / min {fm['ssim_min']:.6f}") if m else f"SNR {metrics.sqnr_db(a, e):.1f} dB"
        info += f"; the exact path vs its fp32 run: {scale:.3e}" if fp32 is not None else ""
        result.layers.append(LayerResult(name, name, "e2e", rel, metrics.sqnr_db(a, e), metrics.max_abs(a, e),
                                         True, "reported; held to the path's baseline (drift rule)", "", redo, None,
                                         rel, math.inf, "quality", info))
    result.frame_metrics = fm
    return result


def compare_paths(model: E2EModel, path: str, *, device: str = "cpu", reference: str | None = None,
                  exact_run: FramesRun | None = None, options: dict | None = None) -> CaseResult:
    """Exact reference vs `path` on `model` (and, where the exact path runs in bf16, the exact path in fp32 for the
    rounding scale). `exact_run`: a reference run to reuse; `options`: the attention backends' options `path` runs
    with ({flat name: value}, `path_flags`)."""
    compute = compute_of(device)
    reference = reference or exact_reference(device)
    ref = exact_run or run_frames(model, ["--attention", reference], device=device)
    fp32 = None if compute == "fp32" else run_frames(model, ["--attention", "sdpa", "--compute-dtype", "fp32"],
                                                     device=device)
    ours = run_frames(model, path_flags(path, reference, options), device=device)
    return judge(model, path, ours, ref, compute=compute, reference=reference, options=options, fp32=fp32,
                 device=device)


# ---- command line: build a model folder, compare one path -----------------------------------------

def build(out: Path, *, preset: str = "small", weights: str = "bf16", vae_preset: str = "tiny",
          dit_args: tuple[str, ...] = (), width: int = 512, height: int = 512, frames: int = 56, steps: int = 4,
          seed: int = 0, text_len: int = 64) -> dict:
    """An e2e model folder: a `make-checkpoint` DiT (extra flags `dit_args`), the synthetic VAEs, seeded text states
    and `e2e.json`. The default geometry packs 17x16x16 = 4,352 video + 93 audio + 64 text = 4,509 tokens: above
    sol_attn's minimum, so its kernel runs in the DiT blocks."""
    import subprocess
    import sys

    from safetensors.torch import save_file

    from h3direct.config import H3Config

    out.mkdir(parents=True, exist_ok=True)
    files = {"dit": "dit.safetensors", "video_vae": "video_vae.safetensors", "audio_vae": "audio_vae.safetensors",
             "text_embeds": "text_embeds.safetensors"}
    make = [sys.executable, "-m", "h3direct", "make-checkpoint", "--seed", str(seed)]
    dit = make + ["--component", "dit", "--preset", preset, "--quant", "nvfp4" if weights == "nvfp4" else "none",
                  "--output", str(out / files["dit"])] + (["--nvfp4-layers", "dit"] if weights == "nvfp4" else [])
    for cmd in [dit + list(dit_args)] + [make + ["--component", c, "--preset", vae_preset, "--output",
                                                 str(out / files[c])] for c in ("video_vae", "audio_vae")]:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise H3Error(f"{' '.join(cmd[2:])} failed: {(r.stderr or r.stdout).strip()[-400:]}")
    cfg = H3Config.from_name(preset)
    g = torch.Generator().manual_seed(seed + 1)
    save_file({"text_states": torch.randn(1, text_len, cfg.text_dim, generator=g),
               "token_tags": torch.ones(text_len, dtype=torch.long)}, str(out / files["text_embeds"]))
    spec = {"width": width, "height": height, "frames": frames, "steps": steps, "seed": seed,
            "weights": "nvfp4_w4a16" if weights == "nvfp4" else "bf16", "vae_config": vae_preset, "files": files,
            "about": f"{preset} DiT ({weights}{' ' + ' '.join(dit_args) if dit_args else ''}), {vae_preset} VAEs, "
                     f"{width}x{height}x{frames}, {steps} steps, text {text_len}"}
    (out / SPEC).write_text(json.dumps(spec, indent=1) + "\n")
    return spec


def main(argv: list[str] | None = None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="python -m parity_tests.e2e_frames", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write an e2e model folder")
    b.add_argument("--out", required=True)
    b.add_argument("--preset", default="small")
    b.add_argument("--weights", choices=["bf16", "nvfp4"], default="bf16")
    b.add_argument("--vae-preset", default="tiny")
    b.add_argument("--dit-arg", action="append", default=[],
                   help="extra make-checkpoint flag for the DiT (repeatable: --dit-arg=--attention-structure "
                        "--dit-arg=local)")
    for flag, default in (("--width", 512), ("--height", 512), ("--frames", 56), ("--steps", 4), ("--seed", 0),
                          ("--text-len", 64)):
        b.add_argument(flag, type=int, default=default)
    c = sub.add_parser("compare", help="the exact path vs one approximate path, decoded frames and audio")
    c.add_argument("--model", default="bundled", help="model folder or 'bundled'")
    c.add_argument("--path", required=True, help="an approximate attention backend, fp8_linear, or NAME+fp8_linear")
    c.add_argument("--device", default="cpu")
    c.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="an attention backend's option by its flat name (repeatable), e.g. sol_tau=2.0")
    c.add_argument("--baseline", help="the path's recorded baseline (.npz): its frames and waveform are held to it")
    c.add_argument("--quantity", choices=("frames", "waveform"),
                   help="with --baseline: the one quantity held to it (default: both)")
    c.add_argument("--drift", type=float, metavar="K", help="with --baseline: the drift rule's k")
    c.add_argument("--floor", type=float, default=0.0, help="with --baseline: the drift rule's floor")
    args = p.parse_args(argv)
    try:
        if args.cmd == "build":
            spec = build(Path(args.out), preset=args.preset, weights=args.weights, vae_preset=args.vae_preset,
                         dit_args=tuple(args.dit_arg), width=args.width, height=args.height, frames=args.frames,
                         steps=args.steps, seed=args.seed, text_len=args.text_len)
            print(f"e2e model folder {args.out}: {spec['about']}")
            return 0
        from h3direct.dit.options import parse_assignments

        options = parse_assignments(args.option, only="attention")
        if args.baseline is not None and args.drift is None:
            raise H3Error("--baseline holds the path to the drift rule: give --drift K (the gate's command has it)")
        if args.quantity is not None and args.baseline is None:
            raise H3Error("--quantity names a drift quantity: give the --baseline it is held to (and --drift K)")
        before = _baseline(args.baseline) if args.baseline else None
        model = E2EModel.load(None if args.model == "bundled" else args.model)
        result = compare_paths(model, args.path, device=args.device, options=options)
    except H3Error as exc:
        print(f"e2e_frames: error: {exc}", file=sys.stderr)
        return 2
    print(result.report())
    for r in result.layers:
        print(r.line())
    if before is None:
        return 0 if result.passed else 1
    from oracle.replay_report import verdict_text
    from oracle.request import Figures, Rule

    rule, held = Rule(drift=args.drift, floor=args.floor), []
    for name, q in result.measured.items():
        if args.quantity not in (None, name):
            continue
        if f"{name}.err" not in before:  # as the gate: a note, not a verdict
            print(f"[drift] drift.{name}: the baseline has no {name} (rerun the gate with --force-regen)")
            continue
        v = rule.judge(Figures(q.err, baseline=before[f"{name}.err"], scale=q.scale, paths=q.paths))
        held.append(v.passed)
        print(f"[drift] drift.{name}: now {q.err:.4e}, baseline {before[f'{name}.err']:.4e}" + verdict_text(v))
    if not held:  # a replay that compares nothing is no verdict
        print(f"e2e_frames: error: nothing compared: the baseline {args.baseline} holds none of "
              f"{args.quantity or ', '.join(result.measured)}", file=sys.stderr)
        return 2
    return 0 if all(held) else 1


def _baseline(path: str) -> dict:
    from parity_tests.drift import read_baseline

    values = read_baseline(Path(path))
    if values is None:
        raise H3Error("--baseline: no baseline file there", path=Path(path))
    return values


if __name__ == "__main__":
    raise SystemExit(main())
