"""`h3direct serve` with full-size synthetic models resident, exercised over HTTP: one Ref2VA request or more.

Steps (each timed, all logged to OUT/bench_serve.log, the results to OUT/bench_serve.json):
  1. files: the NVFP4 DiT checkpoint in ComfyUI's format (`h3direct make-checkpoint`, generated on --device), the
     video and audio VAE weights (`make-checkpoint --component video_vae|audio_vae`, on the CPU, in parallel with
     the DiT), text embeddings [1, text_len, text_dim] (a `text_embeds` file: no text encoder of full width runs;
     the server still loads its bundled tiny encoder, as it always loads one) and a reference image at the canvas
     size under the input root;
  2. `python -m h3direct serve --device ... --checkpoint ... --vae ... --audio-vae ... --input-root ... --output-root
     ...` on a free port; GET /ready polled until 200 (the load time as the client sees it);
  3. GET /ready recorded (memory figures, components, load seconds); POST /generate once per entry of --requests
     (attention backend per request; the first one pays the warm-up), each response's summary (per-stage timings,
     per-step seconds, peak memory) recorded with the client's wall time and a check of the mp4 (PyAV: frames,
     size, audio stream);
  4. GET /ready again, then SIGTERM: the server must exit 0.

    python -m benchmarks.bench_serve --preset full --device cuda --out $OUT      # on a GPU
    python -m benchmarks.bench_serve --preset tiny --device cpu --out /tmp/serve  # CPU dry run, about 10 s

Exit status: 0 when every step passed, 1 when one failed (the JSON says which), 2 on bad flags.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
GIB = 1024 ** 3

# preset -> DiT config, VAE preset, canvas, text tokens; `full` is the benchmark contract's workload
PRESETS = {
    "full": {"dit": "full-curve", "vae": "full", "width": 960, "height": 544, "frames": 124, "text_len": 256},
    "tiny": {"dit": "tiny-curve", "vae": "tiny", "width": 64, "height": 64, "frames": 22, "text_len": 8},
}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu", help="the server's --device (and where the DiT file is generated)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/h3direct_serve"), help="results folder")
    ap.add_argument("--work", default="/tmp/h3direct_serve_work", help="model files, input and output roots")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--requests", default=None,
                    help="comma-separated attention backend per request (default: full fa3,fa3,cudnn_sdpa; "
                         "tiny sdpa,sdpa)")
    ap.add_argument("--nvfp4-layers", choices=("all", "dit"), default="dit",
                    help="make-checkpoint --nvfp4-layers (dit: the 4 x 50 block linears, as the benchmarks)")
    ap.add_argument("--load-timeout", type=float, default=420.0, help="seconds to wait for GET /ready 200")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds per POST /generate")
    ap.add_argument("--keep-files", action="store_true", help="keep the model files (default: removed at the end)")
    ap.add_argument("--reuse-files", action="store_true", help="use model files already under --work")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    p = PRESETS[args.preset]
    args.requests = [r for r in (args.requests or ("fa3,fa3,cudnn_sdpa" if args.preset == "full" else "sdpa,sdpa"))
                     .split(",") if r]
    for k, v in p.items():
        setattr(args, f"p_{k}", v)
    return args


class Log:
    def __init__(self, path: Path):
        self.f = open(path, "a", buffering=1)
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        line = f"[{time.perf_counter() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.f.write(line + "\n")


def http(method: str, url: str, body: dict | None = None, timeout: float = 30.0) -> tuple[int, dict]:
    """(status, JSON body) of one request; HTTP errors are answers too, not exceptions."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")[:2000]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cmd(cmd: list[str], log: Log, env: dict) -> subprocess.Popen:
    log("$ " + " ".join(cmd))
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def finish(proc: subprocess.Popen, name: str, log: Log, timeout: float = 900.0) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    for line in out.strip().splitlines()[-5:]:
        log(f"   {name}: {line}")
    return proc.returncode, out


def make_files(args, work: Path, log: Log, env: dict, res: dict) -> dict:
    """Model files + input root. Returns {name: path}."""
    import numpy as np

    files = {"dit": work / "dit_nvfp4.safetensors", "vae": work / "video_vae.safetensors",
             "audio_vae": work / "audio_vae.safetensors"}
    inp = work / "in"
    inp.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if not (args.reuse_files and all(p.is_file() for p in files.values())):
        py = [sys.executable, "-m", "h3direct", "make-checkpoint"]
        dit_dev = "cuda" if args.device.startswith("cuda") else "cpu"
        procs = {
            "dit": run_cmd(py + ["--component", "dit", "--preset", args.p_dit, "--quant", "nvfp4", "--nvfp4-layers",
                                 args.nvfp4_layers, "--device", dit_dev, "--out", str(files["dit"])], log, env),
            "vae": run_cmd(py + ["--component", "video_vae", "--preset", args.p_vae, "--out", str(files["vae"])],
                           log, env),
            "audio_vae": run_cmd(py + ["--component", "audio_vae", "--preset", args.p_vae, "--out",
                                       str(files["audio_vae"])], log, env),
        }
        for name, proc in procs.items():
            rc, _ = finish(proc, name, log)
            res["files"][name] = {"rc": rc, "done_s": round(time.perf_counter() - t0, 2)}
            if rc != 0:
                raise RuntimeError(f"make-checkpoint {name} failed (exit {rc})")
    for name, p in files.items():
        res["files"].setdefault(name, {})["bytes"] = p.stat().st_size
    # text embeddings at the DiT's text width, and the reference image at the canvas size
    import torch
    from PIL import Image
    from safetensors.torch import save_file

    from h3direct.config import H3Config

    text_dim = H3Config.from_name(args.p_dit).text_dim
    g = torch.Generator().manual_seed(7)
    save_file({"text_states": torch.randn(1, args.p_text_len, text_dim, generator=g),
               "token_tags": torch.ones(args.p_text_len, dtype=torch.long)}, str(inp / "text.safetensors"))
    h, w = args.p_height, args.p_width
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    rgb = np.stack([xx / w, yy / h, 0.5 + 0.5 * np.sin(xx / 37.0 + yy / 23.0)], -1) * 255.0
    rgb += np.random.default_rng(0).normal(0, 8, rgb.shape)
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(inp / "ref.png")
    res["files"]["text_embeds"] = {"shape": [1, args.p_text_len, text_dim]}
    res["files"]["ref_image"] = {"size": [w, h]}
    res["files"]["seconds"] = round(time.perf_counter() - t0, 2)
    log(f"files ready in {res['files']['seconds']} s: " + ", ".join(
        f"{k} {v['bytes'] / GIB:.2f} GiB" for k, v in res["files"].items() if isinstance(v, dict) and "bytes" in v))
    return files


def check_mp4(path: Path) -> dict:
    try:
        import av
    except ImportError as e:
        return {"error": f"PyAV missing: {e}"}
    with av.open(str(path)) as c:
        v = c.streams.video[0]
        frames = sum(1 for _ in c.decode(video=0))
        info = {"bytes": path.stat().st_size, "video_frames": frames, "width": v.codec_context.width,
                "height": v.codec_context.height, "audio_streams": len(c.streams.audio)}
        if c.streams.audio:
            a = c.streams.audio[0]
            info["audio_rate"], info["audio_channels"] = a.rate, a.codec_context.channels
    return info


def ready_brief(ready: dict) -> dict:
    m = ready.get("memory", {})
    return {"memory_gib": {k.removesuffix("_bytes"): round(v / GIB, 3) for k, v in m.items() if k.endswith("_bytes")},
            "queue": ready.get("queue"), "weight_loads": ready.get("weight_loads")}


def main(argv=None) -> int:
    args = parse_args(argv)
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    log = Log(out / "bench_serve.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                                            if p])
    env.setdefault("H3_CACHE_DIR", str(work / "cache"))
    res: dict = {"preset": args.preset, "device": args.device, "steps": args.steps, "requests_asked": args.requests,
                 "workload": {k.removeprefix("p_"): v for k, v in vars(args).items() if k.startswith("p_")},
                 "files": {}, "failures": []}
    try:
        import torch

        res["torch"] = torch.__version__
        if torch.cuda.is_available():
            res["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    server = None
    rc = 1
    try:
        files = make_files(args, work, log, env, res)
        port = free_port()
        outroot = work / "out"
        cmd = [sys.executable, "-m", "h3direct", "serve", "--port", str(port), "--device", args.device,
               "--checkpoint", str(files["dit"]), "--vae", str(files["vae"]), "--vae-config", args.p_vae,
               "--audio-vae", str(files["audio_vae"]), "--audio-vae-config", args.p_vae,
               "--attention", args.requests[0], "--input-root", str(work / "in"), "--output-root", str(outroot),
               "--job-timeout", str(args.request_timeout)]
        log("$ " + " ".join(cmd))
        server_log = open(out / "server.log", "w", buffering=1)
        t_start = time.perf_counter()
        server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        ready_line: list[str] = []

        def pump():
            for line in server.stdout:
                server_log.write(line)
                if line.startswith("{") and '"url"' in line:
                    ready_line.append(line.strip())

        pumper = threading.Thread(target=pump, daemon=True)
        pumper.start()
        base = f"http://127.0.0.1:{port}"
        status, ready = 0, {}
        while time.perf_counter() - t_start < args.load_timeout:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited with {server.returncode} while loading (server.log)")
            try:
                status, ready = http("GET", base + "/ready", timeout=10)
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                status = 0
            if status == 200:
                break
            time.sleep(0.5)
        if status != 200:
            raise RuntimeError(f"GET /ready not 200 after {args.load_timeout} s (last {status}: {ready})")
        res["ready_after_s"] = round(time.perf_counter() - t_start, 2)
        res["ready_line"] = ready_line[0] if ready_line else None
        res["ready_before"] = ready
        log(f"/ready 200 after {res['ready_after_s']} s: {json.dumps(ready_brief(ready))}; load_seconds "
            f"{json.dumps(ready.get('load_seconds'))}")
        available = set(ready.get("attention", {}).get("available", []))
        res["requests"] = []
        for i, backend in enumerate(args.requests):
            entry: dict = {"attention": backend}
            res["requests"].append(entry)
            if backend not in available:
                reason = ready.get("attention", {}).get("unavailable", {}).get(backend, "not offered")
                entry["skipped"] = reason
                res["failures"].append(f"request {i}: {backend} unavailable: {reason}")
                log(f"request {i}: {backend} not available on this server: {reason}")
                continue
            body = {"ref_images": ["ref.png"], "text_embeds": "text.safetensors", "width": args.p_width,
                    "height": args.p_height, "frames": args.p_frames, "steps": args.steps, "seed": i,
                    "attention": backend, "progress": True, "profile_memory": True,
                    "output": f"ref2va_{i}_{backend}.mp4", "overwrite": True}  # (--work is reused across runs)
            entry["body"] = body
            t0 = time.perf_counter()
            status, summary = http("POST", base + "/generate", body, timeout=args.request_timeout + 30)
            entry["client_s"] = round(time.perf_counter() - t0, 3)
            entry["status"] = status
            entry["response"] = summary
            if status != 200:
                res["failures"].append(f"request {i}: HTTP {status}: {summary}")
                log(f"request {i} ({backend}): HTTP {status}: {summary}")
                continue
            entry["mp4"] = check_mp4(Path(summary["output"]))
            t = summary.get("timings", {})
            log(f"request {i} ({backend}): 200 in {entry['client_s']} s; timings {json.dumps(t)}; steps "
                f"{summary.get('step_seconds')}; peak {summary.get('peak_memory_bytes', 0) / GIB:.2f} GiB; "
                f"mp4 {json.dumps(entry['mp4'])}")
            want = (args.p_frames, args.p_width, args.p_height)
            got = (entry["mp4"].get("video_frames"), entry["mp4"].get("width"), entry["mp4"].get("height"))
            if got != want or entry["mp4"].get("audio_streams") != 1:
                res["failures"].append(f"request {i}: mp4 {got} audio {entry['mp4'].get('audio_streams')}, "
                                       f"wanted {want} + 1 audio stream")
        status, ready2 = http("GET", base + "/ready", timeout=30)
        res["ready_after"] = ready2
        log(f"/ready again ({status}): {json.dumps(ready_brief(ready2))}")
        t0 = time.perf_counter()
        server.send_signal(signal.SIGTERM)
        res["exit_code"] = server.wait(timeout=60)
        res["exit_s"] = round(time.perf_counter() - t0, 2)
        pumper.join(5)
        log(f"SIGTERM: exit {res['exit_code']} after {res['exit_s']} s")
        if res["exit_code"] != 0:
            res["failures"].append(f"exit code {res['exit_code']} after SIGTERM")
        rc = 1 if res["failures"] else 0
    except Exception as e:  # record what broke, keep what was measured
        res["failures"].append(f"{type(e).__name__}: {e}")
        log(f"FAILED: {type(e).__name__}: {e}")
    finally:
        if server is not None and server.poll() is None:
            server.kill()
            server.wait(10)
        if not args.keep_files:
            for name in ("dit_nvfp4.safetensors", "video_vae.safetensors", "audio_vae.safetensors"):
                (work / name).unlink(missing_ok=True)
        (out / "bench_serve.json").write_text(json.dumps(res, indent=1, default=str))
        log(f"result: {'ok' if rc == 0 else 'FAILED'}; {out / 'bench_serve.json'}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
