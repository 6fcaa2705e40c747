"""What the benchmark scripts (modules of the `benchmarks` package: `python -m benchmarks.<name>`) share: presets,
the workload geometry, timing, memory, JSON output, and what the two contract runners (`run_contract.py`,
`run_e2e.py`) share."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from h3direct.app.frontier.report import jsonable

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

GIB = 1024 ** 3


def reference(device: str | None) -> dict:
    """ComfyUI's default s/step and the hot floor as the benchmark contract measured them, for the quick scripts'
    "x ComfyUI" and "/ floor" (not same-run: the contract measures both in its own run and judges them): the committed
    contract result of `device` (torch's name of the GPU), else the newest committed one, named in `source`."""
    found = []
    for p in sorted(RESULTS.glob("contract-*.json")):
        r = json.loads(p.read_text())
        comfy = ((r.get("comfyui") or {}).get("configs") or {}).get("default") or {}
        floor = r.get("hot_floor") or {}
        if comfy.get("status") == "ok" and floor.get("status") == "ok":
            found.append((r.get("device") == device, r.get("date") or "", p.name, r.get("device"),
                          comfy["s_per_step"], floor["s_per_step"]))
    if not found:
        return {"comfyui_s_per_step": None, "floor_s_per_step": None, "source": "no committed contract result"}
    _, date, name, dev, comfy, floor = max(found)
    return {"comfyui_s_per_step": comfy, "floor_s_per_step": floor, "source": f"results/{name} ({dev}, {date})"}


@dataclass(frozen=True)
class Preset:
    """Sizes of one benchmark run. `full` is the PERFORMANCE.md workload; `tiny` is for CPU validation."""

    dit_config: str  # H3Config preset name
    width: int
    height: int
    frames: int
    text_len: int
    matmul_size: int
    vae_preset: str
    text_encoder: str  # synthetic_gpu.text_encoder_config name
    nvfp4_mode: str = "w4a16"  # the Hopper mode (ComfyUI on compute capability < 10)


PRESETS = {
    "full": Preset("full-curve", 960, 544, 124, 256, 8192, "full", "qwen3vl_32b"),
    "tiny": Preset("tiny-curve", 64, 64, 22, 8, 128, "tiny", "tiny"),
}


def add_common_arguments(parser, default_budget: float) -> None:
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full", help="sizes (default full)")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--frames", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-seconds", type=float, default=default_budget,
                        help="skip the remaining configurations once this much wall time is spent")
    parser.add_argument("--out", default=None, help="JSON path (default: $OUT/<bench>.json when OUT is set)")


def resolve_common(args):
    import torch

    p = PRESETS[args.preset]
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available here (use --device cpu)")
    args.width = args.width or p.width
    args.height = args.height or p.height
    args.frames = args.frames or p.frames
    return p


# ---------------------------------------------------------------- workload geometry

def workload(width: int, height: int, frames: int, text_len: int) -> dict:
    """Ref2VA geometry: one reference image at the target canvas, `text_len` text tokens.

    Latent shapes come from `h3direct.sampling.conditioning.latent_shapes`; rows are counted independently of the
    DiT's layout code (2x2 patches per video latent frame, stereo audio = 2 rows per latent frame).
    """
    from h3direct.sampling.conditioning import latent_shapes

    frame_count, vshape, ashape = latent_shapes(width, height, frames)
    _, c, t, h, w = vshape
    hp, wp = (h + h % 2) // 2, (w + w % 2) // 2
    rows = {"text": text_len, "ref_image": hp * wp, "audio": 2 * ashape[-1], "video": t * hp * wp}
    return {
        "width": width, "height": height, "frames": frames, "frame_count": frame_count,
        "video_latent": list(vshape), "audio_latent": list(ashape), "ref_latent": [1, c, 1, h, w],
        "text_len": text_len, "rows": rows, "seq_len": sum(rows.values()),
    }


def reference_image(wl: dict, seed: int):
    """The workload's reference image [1, H, W, 3] in [0, 1] at the canvas size: the same values in every process
    and every benchmark (a CPU generator at seed + 3)."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(seed + 3)
    return torch.rand(1, wl["height"], wl["width"], 3, generator=g)


def step_flops(config, seq_len: int) -> dict:
    """TFLOP of one DiT forward in the 4·num_layers block linears and in attention (2 FLOP per MAC)."""
    c = config
    inner = c.num_attention_heads * c.attention_head_dim
    macs_per_row = (c.hidden_size * 3 * inner + inner * c.hidden_size + c.hidden_size * 2 * c.ffn_hidden_size
                    + c.ffn_hidden_size * c.hidden_size)
    lin = 2.0 * seq_len * macs_per_row * c.num_layers
    attn = 4.0 * seq_len * seq_len * inner * c.num_layers  # QK^T and PV
    return {"block_linears_tflop": lin / 1e12, "attention_tflop": attn / 1e12, "total_tflop": (lin + attn) / 1e12}


def block_gemm_shapes(config, seq_len: int) -> list[tuple[str, int, int, int]]:
    """(name, M, N, K) of the four block linears, x [M, K] @ W[N, K]^T."""
    c = config
    inner = c.num_attention_heads * c.attention_head_dim
    return [("qkv_proj", seq_len, 3 * inner, c.hidden_size), ("out_proj", seq_len, c.hidden_size, inner),
            ("fc1", seq_len, 2 * c.ffn_hidden_size, c.hidden_size), ("fc2", seq_len, c.hidden_size, c.ffn_hidden_size)]


# ---------------------------------------------------------------- timing and memory

def is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def sync(device) -> None:
    if is_cuda(device):
        import torch

        torch.cuda.synchronize()


def time_calls(fn, device, warmup: int = 1, iters: int = 3) -> dict:
    """Run fn() `warmup` times untimed, then `iters` times timed (CUDA events on GPU, perf_counter on CPU).

    Returns {"warmup_s", "times_s", "median_s", "wall_s"} — times per call in seconds.
    """
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    sync(device)
    t1 = time.perf_counter()
    times = []
    if is_cuda(device):
        import torch

        events = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            events.append((a, b))
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / 1e3 for a, b in events]
    else:
        for _ in range(iters):
            s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - s)
    t2 = time.perf_counter()
    return {"warmup_s": t1 - t0, "times_s": times, "median_s": statistics.median(times) if times else float("nan"),
            "wall_s": t2 - t1}


# ---------------------------------------------------------------- clocks and power while a measurement runs

POWER_CAP_BIT = 0x4  # nvidia-smi clocks_throttle_reasons: "SW power cap" (the board holds its power limit)
_SMI_FIELDS = "clocks.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"


def summarize_gpu_samples(lines: list[str]) -> dict | None:
    """nvidia-smi CSV lines (`_SMI_FIELDS`, no header, no units) -> medians of the samples taken under load (power
    above a third of the limit), the share of those samples that held the power cap, and the maximum clock seen.
    None when no sample was under load."""
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 5:
            continue
        try:
            clock, power, limit, temp = (float(v) for v in parts[:4])
            reasons = int(parts[4], 16)
        except ValueError:
            continue
        rows.append((clock, power, limit, temp, reasons))
    loaded = [r for r in rows if r[1] > r[2] / 3]
    if not loaded:
        return None
    return {"sm_clock_mhz_median": statistics.median(r[0] for r in loaded),
            "sm_clock_mhz_max": max(r[0] for r in loaded),
            "power_w_median": statistics.median(r[1] for r in loaded),
            "power_limit_w": loaded[-1][2],
            "temperature_c_median": statistics.median(r[3] for r in loaded),
            "power_capped_share": sum(1 for r in loaded if r[4] & POWER_CAP_BIT) / len(loaded),
            "samples": len(loaded)}


class GpuSampler:
    """`with GpuSampler(device) as s: ...` samples SM clock, power and throttle reasons every `period_ms` through
    nvidia-smi; afterwards `s.summary` is `summarize_gpu_samples` of them (None on the CPU or without nvidia-smi).
    A step that holds the power cap runs at a lower clock than the same kernels measured alone."""

    def __init__(self, device, period_ms: int = 100):
        self.device, self.period_ms, self.summary, self._proc = device, period_ms, None, None

    def __enter__(self):
        import shutil
        import subprocess

        import torch

        if is_cuda(self.device) and shutil.which("nvidia-smi"):
            index = str(torch.device(self.device).index or 0)
            self._proc = subprocess.Popen(
                ["nvidia-smi", "-i", index, f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits",
                 "-lms", str(self.period_ms)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc):
        if self._proc is not None:
            self._proc.terminate()
            try:
                out, _ = self._proc.communicate(timeout=5)
            except Exception:  # noqa: BLE001 - a sampler must never fail the measurement
                self._proc.kill()
                out = ""
            self.summary = summarize_gpu_samples(out.splitlines())
        return False


def reset_peak(device) -> None:
    if is_cuda(device):
        import torch

        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device) -> float | None:
    if not is_cuda(device):
        return None
    import torch

    return torch.cuda.max_memory_allocated() / GIB


def allocated_gib(device) -> float | None:
    if not is_cuda(device):
        return None
    import torch

    return torch.cuda.memory_allocated() / GIB


def free_memory(device) -> None:
    gc.collect()
    if is_cuda(device):
        import torch

        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def failed(exc: BaseException) -> str:
    """The status of a path that raised while it was measured: the error's type and first line. The run records it
    and measures the other paths; a result holding one exits 1 (`any_failed`)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"failed: {type(exc).__name__}: {first}"[:300]


def any_failed(statuses) -> list[str]:
    """The statuses among `statuses` that say a path failed (`failed`)."""
    return [s for s in statuses if isinstance(s, str) and s.startswith("failed: ")]


def module_gib(module) -> float:
    """Bytes of a module's parameters and buffers, in GiB (device independent)."""
    n = sum(t.numel() * t.element_size() for t in module.parameters())
    n += sum(t.numel() * t.element_size() for t in module.buffers())
    return n / GIB



# ---------------------------------------------------------------- what the contract runners share

def usage_error(msg: str, prog: str = "run_contract"):
    """A bad flag or input of a benchmark (`prog`; the contract runners by default): one line on stderr, exit 2 (before
    anything is built)."""
    print(f"{prog}: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def check_run_flags(args) -> None:
    """The flags both contract runners take: --comfy-root a ComfyUI checkout with H3, --steps at least 1."""
    if args.comfy_root:
        from h3direct.errors import H3Error
        from oracle.comfy_env import resolve_root

        try:
            resolve_root(args.comfy_root)
        except H3Error as exc:
            usage_error(f"--comfy-root: {exc}")
    if args.steps is not None and args.steps < 1:
        usage_error(f"--steps {args.steps}: at least 1")


def path_settings(model, options, build: dict, like) -> dict:
    """Everything of one path that changes its numbers (the one place a result records them): the typed options it
    ran with, every one under its flat name (`options`), and what they came to on this machine: the attention
    backend and whether it is exact, the FP8 linears, whether the fused Triton kernels run, the NVFP4 compute mode
    and dequantization path, the compute dtype."""
    from h3direct.checkpoint.quant.nvfp4 import dequant_backend
    from h3direct.dit import fused
    from h3direct.dit.attention import is_exact

    k = options.kernels
    return {"attention": options.attention.backend, "options": options.flat(),
            "attention_exact": is_exact(options.attention), "fp8_linear": k.fp8_linear,
            "fused_kernels": fused.enabled(like, whole_rows=False, on=k.fused), "nvfp4_mode": build.get("nvfp4_mode"),
            "nvfp4_dequant": dequant_backend(like.device.type, k.nvfp4_dequant)
            if build.get("weights") == "nvfp4" else None,
            "compute_dtype": str(model.compute_dtype).removeprefix("torch.")}



def package_versions() -> dict:
    """Versions of the packages that change the numbers (None: not installed)."""
    from importlib import metadata

    out = {}
    for name in ("torch", "triton", "comfy-kitchen", "sageattention", "fa3-fwd", "flash-attn"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_result(path, result: dict) -> None:
    """A result (or a ComfyUI worker's part of one) as JSON."""
    Path(path).write_text(json.dumps(jsonable(result), indent=1, default=str))


def comfy_provenance(env) -> dict:
    """Which ComfyUI ran and how it was opened (`oracle.comfy_env.ComfyEnv`), for a worker's result."""
    from oracle.comfy_env import comfy_version

    return {"commit": env.commit, "version": comfy_version(env.root), "attention_function": env.attention_function(),
            "environment": env.describe()}


def run_device(args) -> str:
    """The runner's device: --device, else cuda when there is one; --device cuda without one is a usage error."""
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        usage_error("--device cuda: no CUDA device here (use --device cpu with --smoke)")
    return args.device


def result_header(contract: dict, args, argv, dev: str, wl: dict) -> dict:
    """What every contract result starts with: the contract, whether it is a smoke run, the device and environment,
    the code (commit and the tree of the files that ran), the command, the date and the workload."""
    return {"contract": contract["contract"], "smoke": args.smoke, "device": env_info(dev).get("gpu") or dev,
            "env": {**env_info(dev), "packages": package_versions()}, "commit": git_commit(), "tree": source_tree(),
            "command": ["python", "-m", "benchmarks.run_contract", *(argv if argv is not None else sys.argv[1:])],
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "workload": wl}


def git_commit(root: Path = REPO_ROOT) -> str:
    """This checkout's HEAD, `+changes` when tracked files differ from it. A copy of the checkout made elsewhere (a
    GPU machine's) may carry a stale HEAD: `source_tree` names the files that ran."""
    try:
        p = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                           timeout=10)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return p.stdout.strip() + ("+changes" if dirty else "") if p.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def source_tree(root: Path = REPO_ROOT) -> str | None:
    """The git tree hash of the checkout's files as they are (tracked files and the untracked ones git does not
    ignore), whatever its HEAD: equal to `git rev-parse C^{tree}` for the commit C whose files ran (`commit_of_tree`
    finds C). The files are hashed into a scratch index, not stored; only the (small, unreferenced) tree objects are
    written. None without git."""
    import tempfile

    def git(*args, **kw):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=60, check=True, **kw)

    try:
        with tempfile.TemporaryDirectory() as tmp:
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
            files = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout
            # --remove: a tracked file deleted from the copy is not in the files that ran
            git("update-index", "--add", "--remove", "--info-only", "-z", "--stdin", input=files, env=env)
            return git("write-tree", "--missing-ok", env=env).stdout.decode().strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit_of_tree(tree: str | None, root: Path = REPO_ROOT) -> str | None:
    """The newest commit of this repository whose files are `tree` (None: none here has them)."""
    if not tree:
        return None
    try:
        log = subprocess.run(["git", "-C", str(root), "log", "--all", "--format=%H %T"], capture_output=True,
                             text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return next((c for c, t in (line.split() for line in log.splitlines() if line.strip()) if t == tree), None)


def run_comfy_process(args, only: str, dev: str) -> dict:
    """`python -m benchmarks.run_contract --comfy-only ONLY` for `args.contract` in its own process (ComfyUI reads its
    flags once per process, and each configuration gets the GPU to itself): its JSON, or {"status": "failed: ..."}
    with the process's last line."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "comfy.json"
        cmd = [sys.executable, "-m", "benchmarks.run_contract", "--contract", args.contract, "--comfy-root",
               args.comfy_root, "--comfy-only", only, "--device", dev, "--out", str(target)]
        cmd += ["--smoke"] * args.smoke + (["--steps", str(args.steps)] if args.steps else [])
        try:
            p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=args.comfy_timeout,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   [str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])})
        except subprocess.TimeoutExpired:
            return {"status": f"failed: over --comfy-timeout {args.comfy_timeout:g} s"}
        if p.returncode == 0 and target.is_file():
            return json.loads(target.read_text())
        last = (p.stderr.strip().splitlines() or [""])[-1][:300]
        return {"status": f"failed: exit {p.returncode}: {last}"}


def comfy_dit(env, config, weights: str, seed: int, device) -> tuple:
    """(ComfyUI's model patcher, load seconds) of the synthetic DiT (`iter_dit_tensors`, the tensors h3direct's
    build draws on the same device with the same seed) through ComfyUI's own loader."""
    from h3direct.checkpoint.synthetic import iter_dit_tensors

    quant = "nvfp4" if weights == "nvfp4" else "none"
    sd = {k: (t.cpu() if k.endswith(".comfy_quant") else t)
          for k, t in iter_dit_tensors(config, quant, seed, str(device), nvfp4_refiner=False)}
    t0 = time.perf_counter()
    patcher = env.sd.load_diffusion_model_state_dict(sd)
    del sd
    if patcher is None or type(patcher.model).__name__ != "MiniMaxH3":
        raise RuntimeError(f"ComfyUI did not detect MiniMaxH3 in the synthetic weights "
                           f"({type(getattr(patcher, 'model', None)).__name__})")
    return patcher, time.perf_counter() - t0

# ---------------------------------------------------------------- run bookkeeping

class Run:
    """Phase timer, budget, and incremental JSON writer of one benchmark script."""

    def __init__(self, bench: str, args, out_name: str | None = None):
        self.start = time.perf_counter()
        self.bench = bench
        self.budget = float(args.budget_seconds)
        out = args.out
        if out is None and os.environ.get("OUT"):
            out = str(Path(os.environ["OUT"]) / f"{out_name or bench}.json")
        self.out_path = Path(out) if out else None
        self.data: dict = {"bench": bench, "args": {k: v for k, v in vars(args).items()}, "phases": {},
                           "skipped": [], "errors": []}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def over_budget(self, expected_s: float = 0.0) -> bool:
        return self.elapsed() + expected_s > self.budget

    def skip(self, what: str, reason: str) -> None:
        self.data["skipped"].append({"what": what, "reason": reason})
        log(f"SKIP {what}: {reason}")

    def error(self, what: str, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        self.data["errors"].append({"what": what, "error": msg})
        log(f"ERROR {what}: {msg}")
        traceback.print_exc(file=sys.stdout)

    def phase(self, name: str):
        return _Phase(self, name)

    def save(self) -> None:
        self.data["total_s"] = self.elapsed()
        if self.out_path is None:
            return
        self.out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out_path.with_name(self.out_path.name + ".tmp")
        tmp.write_text(json.dumps(jsonable(self.data), indent=1, sort_keys=False))
        os.replace(tmp, self.out_path)


class _Phase:
    def __init__(self, run: Run, name: str):
        self.run, self.name = run, name

    def __enter__(self):
        self.t = time.perf_counter()
        log(f"-- {self.name} ...")
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t
        self.seconds = dt
        phases = self.run.data["phases"]
        key = self.name
        k = 2
        while key in phases:
            key = f"{self.name}#{k}"
            k += 1
        phases[key] = dt
        log(f"   {self.name}: {dt:.2f} s (elapsed {self.run.elapsed():.1f} s)")
        return False


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def env_info(device) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
            "cuda": torch.version.cuda, "hostname_cpus": os.cpu_count()}
    if is_cuda(device):
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["gpu_total_gib"] = torch.cuda.get_device_properties(0).total_memory / GIB
        info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    for mod in ("triton", "comfy_kitchen"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "present")
        except Exception as exc:  # noqa: BLE001 - report whatever keeps it from importing
            info[mod] = f"unavailable ({type(exc).__name__})"
    return info


def fmt(x, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, spec) if math.isfinite(x) else str(x)
    return str(x)


def print_table(title: str, header: list[str], rows: list[list]) -> None:
    cells = [[str(h) for h in header]] + [[fmt(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n== {title}")
    for i, r in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
        if i == 0:
            print("  " + "  ".join("-" * w for w in widths))
    sys.stdout.flush()
