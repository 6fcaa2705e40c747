"""What the text encoder's residency policies cost per request: the moves of `--text-encoder-policy` offload and
unload, timed on a full-size synthetic encoder.

    python -m benchmarks.bench_residency --device cuda [--weights nvfp4,bf16] [--policies offload,unload]
    python -m benchmarks.bench_residency --preset tiny --device cpu

Per weight format, the preset's synthetic Qwen3-VL encoder (`synthetic_gpu.text_encoder_tensors`, ComfyUI's file layout)
is written to a safetensors file in `--dir` (timed; unload reads it back), then served under each policy by
`h3direct.app.residency.TextEncoderSlot`, the slot `H3Pipeline` serves a request's encode from: `start` (load time),
then `--cycles` requests, each `acquire` (the encoder onto the device for the encode) and `release` (offload: the device
copy dropped, the page-locked host copy kept all along is the encoder again; unload: freed). Each move's seconds are the
slot's own timing (device-synchronised, as a request's `timings` report them); after each move, the device memory
allocated (GPU only). `resident` makes no moves and is not run. The encode itself is not timed here (`run_e2e.py` times
it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks import _common as C

POLICIES = ("offload", "unload")
WEIGHTS = ("nvfp4", "bf16")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.error = lambda msg: C.usage_error(msg, "bench_residency")  # one line, exit 2 (argparse's own errors too)
    ap.add_argument("--preset", choices=sorted(C.PRESETS), default="full", help="sizes (default full)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--weights", default="nvfp4", help=f"comma list of {', '.join(WEIGHTS)} (default nvfp4)")
    ap.add_argument("--policies", default=",".join(POLICIES), help=f"comma list of {', '.join(POLICIES)}")
    ap.add_argument("--cycles", type=int, default=3, help="requests per policy (default 3)")
    ap.add_argument("--dir", default=None, help="where the encoder files are written (default: a temporary folder)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON path (default: $OUT/bench_residency.json when OUT is set)")
    args = ap.parse_args(argv)
    for flag, value, allowed in (("--weights", args.weights, WEIGHTS), ("--policies", args.policies, POLICIES)):
        bad = [v for v in value.split(",") if v not in allowed]
        if bad or not value:
            ap.error(f"{flag}: {', '.join(bad) or 'empty'} not in {', '.join(allowed)}")
    if args.cycles < 1:
        ap.error("--cycles must be at least 1")
    if args.dir is not None and not Path(args.dir).is_dir():
        ap.error(f"--dir {args.dir}: not a directory")
    return args


def write_encoder(name: str, weights: str, device, seed: int, folder: Path) -> tuple[Path, dict]:
    """The synthetic encoder as a safetensors file in `folder`: (path, {"write_s", "file_gib"})."""
    from safetensors.torch import save_file

    from benchmarks.synthetic_gpu import text_encoder_config, text_encoder_tensors

    t = time.perf_counter()
    sd = {k: v.contiguous() for k, v in text_encoder_tensors(text_encoder_config(name), weights, device, seed)}
    path = folder / f"text_encoder_{weights}.safetensors"
    save_file(sd, str(path))
    del sd
    return path, {"write_s": time.perf_counter() - t, "file_gib": path.stat().st_size / C.GIB}


def serve(path: Path, policy: str, device, cycles: int) -> dict:
    """`start`, then `cycles` x (acquire, release) under `policy`: every move with its seconds and the memory after."""
    import torch

    from h3direct.app.residency import TextEncoderSlot
    from h3direct.text.load import load_text_encoder

    cuda = C.is_cuda(device)
    slot = TextEncoderSlot(lambda d: load_text_encoder(path, device=d), policy, device)
    moves = []

    def record(step, fn):
        if fn() is not None or step == "start":
            move = slot.last_move or {"move": "none", "seconds": 0.0}
            moves.append({"step": step, **move, "where": slot.where,
                          "allocated_gib": torch.cuda.memory_allocated() / C.GIB if cuda else None})

    record("start", slot.start)
    for _ in range(cycles):
        record("acquire", slot.acquire)
        record("release", slot.release)
    net = slot.encoder.net if slot.encoder is not None else None
    held = C.module_gib(net) if net is not None else None
    pinned = all(t.is_pinned() for t in (*net.parameters(), *net.buffers())) if net is not None else None
    return {"moves": moves, "encoder_gib_between_requests": held, "host_pinned": pinned, "loads": slot.loads}


def summary(moves: list[dict]) -> dict:
    """Median seconds per move name over the request cycles (`start` apart)."""
    by: dict[str, list[float]] = {}
    for m in moves:
        if m["step"] != "start":
            by.setdefault(m["move"], []).append(m["seconds"])
    return {name: sorted(v)[len(v) // 2] for name, v in by.items()}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    preset = C.PRESETS[args.preset]
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if C.is_cuda(dev) and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device available here (use --device cpu)")
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="h3_residency_"))
    result = {"bench": "residency", "preset": args.preset, "text_encoder": preset.text_encoder,
              "env": C.env_info(dev), "commit": C.git_commit(), "cycles": args.cycles, "formats": {}}
    try:
        for weights in args.weights.split(","):
            path, info = write_encoder(preset.text_encoder, weights, dev, args.seed, folder)
            entry = {**info, "policies": {}}
            for policy in args.policies.split(","):
                run = serve(path, policy, dev, args.cycles)  # its encoder is gone once it returns
                if C.is_cuda(dev):
                    torch.cuda.empty_cache()
                entry["policies"][policy] = {**run, "median_s": summary(run["moves"])}
                print(f"{weights} {policy}: file {info['file_gib']:.2f} GiB, " + ", ".join(
                    f"{k} {v:.3f} s" for k, v in entry["policies"][policy]["median_s"].items()), flush=True)
            path.unlink()
            result["formats"][weights] = entry
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    out = args.out or (str(Path(os.environ["OUT"]) / "bench_residency.json") if os.environ.get("OUT") else None)
    if out:
        C.write_result(out, result)
        print(f"result: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
