"""`h3direct serve`: the models loaded once, generations over HTTP/1.1 (FastAPI + uvicorn; OpenAPI at
/openapi.json, interactive docs at /docs).

    h3direct serve [--host 127.0.0.1] [--port 8188] [--output-root output] [--input-root DIR] [--queue-size 8]
                   [--job-timeout 600] [--max-steps 100 ...] [model flags of `h3direct generate`]

The socket is bound first, then the models load (GET /ready answers 503 "loading" meanwhile); once they are
resident one JSON line goes to stdout: {"url", "device", "models"}.

    GET    /health             liveness: 200 {"status": "loading" | "ready" | "stopping"}
    GET    /ready              200 when every model is resident: components (dtype, quantization, device), memory
                               in use, the attention values a request may use, limits, queue, version;
                               503 while loading or stopping
    POST   /generate           a request (JSON, fields of `GenerateRequest`): waits, answers the summary
                               `h3direct generate` prints (with provenance); a client that leaves drops its job
    POST   /jobs               the same request; answers 202 {"id", ...} at once
    GET    /jobs               the most recent jobs (?limit=100), newest first
    GET    /jobs/{id}          state (queued | running | done | failed | cancelled), stage, step, progress,
                               timings, summary or error
    DELETE /jobs/{id}          cancel: a queued job at once, a running one at its next stage or sampler step
    GET    /jobs/{id}/output   the mp4 (video/mp4) of a finished job
    GET    /jobs/{id}/events   progress as server-sent events (`event: progress` ... then `event: done|failed|
                               cancelled`), each `data:` the job as GET /jobs/{id} shows it

A file field (references, first/last frame, text_embeds) is either a name relative to --input-root or an upload
sent with the request, {"filename": "cat.png", "base64": "..."}; uploads live in a private temporary folder while
their job exists and are deleted with it.

Every request is checked at the door, before it is queued (answers within milliseconds): 422 a field of the wrong
type, an unknown field, a value outside its choices, non-UTF-8 text (the error names the field); 400 a value out of
range or beyond a limit (`h3direct.app.limits`, flags --max-*), an input file that is not under --input-root or
does not exist (one answer for both), a reference that is not a readable image/video/audio, an `output` that is not
a relative `.mp4` path inside --output-root; 413 a body over --max-body-mb; 429 + Retry-After the queue is full;
503 + Retry-After loading or stopping. A job that fails once running answers its error: 400 (its input turned out
bad), 504 (over --job-timeout), 409 (cancelled), 503 (shutdown), 507 (out of memory), 500 (a bug; traceback on
the server's stderr only) — and the service stays ready. Errors are {"error": "<one line>"}.

One generation runs at a time (a worker thread); the mp4 is written under a temporary name and renamed, and the
temporary file is removed on every path. Switching `attention` per request never reloads weights.
SIGTERM/SIGINT: refuse new jobs, /ready says 503 "stopping", cancel the running job at its next step, answer the
waiting clients, exit 0; a second signal exits at once (status 1).
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations, some of them local classes
import argparse
import asyncio
import functools
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Literal

from h3direct.app import generate as gen
from h3direct.app import limits as lim
from h3direct.app.jobs import FINAL, Full, Job, JobQueue, Stopping, one_line
from h3direct.errors import H3Error

DEFAULT_PORT = 8188
DEFAULT_QUEUE = 8
DEFAULT_JOB_TIMEOUT_S = 600.0
DEFAULT_MAX_BODY_MB = 16  # room for a few uploaded reference images (base64) in one request
POLL_S = 0.02  # how often a waiting /generate looks at its job and its client

# server flags taken over from `h3direct generate` (same names, types, choices and defaults)
MODEL_FLAGS = ("checkpoint", "vae", "audio_vae", "vae_config", "audio_vae_config", "text_encoder", "tokenizer",
               "compute_dtype", "nvfp4_mode", "device", "attention", "threads", "mlp_chunks", "vae_dtype",
               "vae_tile_size", "ffmpeg_loglevel", "fp8_linear")
# request field -> `h3direct generate` destination (file fields: lists of names under --input-root)
FIELD_DEST = {"ref_images": "ref_image", "ref_videos": "ref_video", "ref_audios": "ref_audio"}
FILE_FIELDS = ("ref_images", "ref_videos", "ref_audios", "first_frame", "last_frame", "text_embeds")


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"{v} is not a port number (0..65535; 0 = any free port)")
    return v


def _generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="h3direct generate", add_help=False)
    gen.add_arguments(p)
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = gen.HelpFormatter
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    g.add_argument("--port", type=_port, default=DEFAULT_PORT, help="TCP port (0 = any free)")
    g.add_argument("--output-root", "--output-dir", dest="output_root", default="output",
                   help="the folder every mp4 is written under (--output-dir is an old spelling)")
    g.add_argument("--input-root", default=None, help="the folder requests may read reference and text-embedding "
                   "files from (relative names); none: requests name no files")
    g.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE, help="jobs that may wait behind the running "
                   "one; more get 429 + Retry-After")
    g.add_argument("--no-queue", action="store_true", help="same as --queue-size 0")
    g.add_argument("--job-timeout", type=float, default=DEFAULT_JOB_TIMEOUT_S, metavar="S",
                   help="a job running longer is stopped at its next step (504)")
    g.add_argument("--max-body-mb", type=int, default=DEFAULT_MAX_BODY_MB, metavar="MB",
                   help="largest request body (uploads included); larger ones get 413")
    g.add_argument("--quiet", action="store_true", help="no access log on stderr")
    lim.add_arguments(parser)
    g = parser.add_argument_group("models and runtime (as `h3direct generate`; each omitted model: bundled tiny)")
    for a in _generate_parser()._actions:
        if a.dest in MODEL_FLAGS:
            extra = {"nargs": a.nargs, "const": a.const} if a.nargs == "?" else {}  # e.g. a bare --fp8-linear
            g.add_argument(*a.option_strings, dest=a.dest, default=a.default, type=a.type, choices=a.choices,
                           metavar=a.metavar, help=a.help, **extra)


# ---- the request model ---------------------------------------------------------------------------

@functools.cache
def _request_model():
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

    Number = float | StrictInt

    class Upload(BaseModel):
        """A file sent with the request (instead of a name under the server's --input-root)."""

        model_config = ConfigDict(extra="forbid", strict=True)
        filename: StrictStr = Field("upload", max_length=255, description="its name (extension kept)")
        base64: StrictStr = Field(description="the file's bytes, base64-encoded")

    File = StrictStr | Upload

    class GenerateRequest(BaseModel):
        """One generation: the fields of `h3direct generate`; omitted ones take its defaults. File fields are names
        relative to the server's --input-root; `output` is relative to its --output-root."""

        model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

        prompt: StrictStr = ""
        negative_prompt: StrictStr = ""
        width: StrictInt | None = Field(None, description="multiple of 32")
        height: StrictInt | None = Field(None, description="multiple of 32")
        frames: StrictInt | None = Field(None, description="snapped up to 17k+5")
        steps: StrictInt | None = None
        seed: StrictInt = 0
        sampler: Literal[gen.SAMPLERS] = "euler"  # type: ignore[valid-type]
        scheduler: Literal[gen.SCHEDULERS] = "simple"  # type: ignore[valid-type]
        cfg: Number = 1.0
        ref_images: list[File] = []
        ref_videos: list[File] = []
        ref_audios: list[File] = []
        ref_image_size: Literal["match", "max"] = "match"
        first_frame: File | None = None
        last_frame: File | None = None
        text_embeds: File | None = None
        attention: Literal[gen.ATTENTION] | None = None  # type: ignore[valid-type]
        cache_mode: Literal[gen.CACHE_MODES] = "off"  # type: ignore[valid-type]
        cache_threshold: Number = gen.CACHE_DEFAULTS["threshold"]
        cache_start_percent: Number = gen.CACHE_DEFAULTS["start_percent"]
        cache_end_percent: Number = gen.CACHE_DEFAULTS["end_percent"]
        cache_subsample_factor: StrictInt = gen.CACHE_DEFAULTS["subsample_factor"]
        progress: StrictBool = False
        profile_memory: StrictBool = False
        output: StrictStr | None = Field(None, description="relative .mp4 path under --output-root")

        @field_validator("*", mode="after")
        @classmethod
        def _utf8(cls, v):
            for s in v if isinstance(v, list) else [v]:
                if isinstance(s, str):
                    try:
                        s.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ValueError("is not valid UTF-8 text (a lone surrogate)") from None
                    if "\x00" in s:
                        raise ValueError("holds a NUL character")
            return v

    return GenerateRequest


# ---- the service: models, checks and jobs; no HTTP -----------------------------------------------

class NotReady(Exception):
    def __init__(self, status: str):
        super().__init__(f"the server is {status}")
        self.status = status


class Service:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.limits = lim.Limits.from_args(args)
        self.output_root = Path(args.output_root).resolve()
        self.input_root = Path(args.input_root).resolve() if args.input_root else None
        self.state = "loading"
        self.error: str | None = None
        self.pipe = None
        self.sources: dict = {}
        self.load_seconds: dict = {}
        self.load_memory = 0
        self.weight_loads = 0
        self.weights: dict = {}  # component -> {"file", "sha256"}
        self.defaults = vars(_generate_parser().parse_args([]))
        queue_size = 0 if getattr(args, "no_queue", False) else args.queue_size
        self.queue = JobQueue(self._run_job, size=queue_size, timeout_s=args.job_timeout, on_finish=self._forget)
        self.max_body_bytes = args.max_body_mb << 20
        self._uploads: Path | None = None  # a private temporary folder, made on the first upload
        self._lock = threading.Lock()
        self._counter = 0

    # ---- startup ----
    def check_flags(self) -> None:
        """The server's own flags and model files, before the socket is bound or any model loads."""
        ns = argparse.Namespace(**self.defaults)
        for k in MODEL_FLAGS:
            setattr(ns, k, getattr(self.args, k))
        gen.resolve_args(ns, check_output=False)
        for k in ("vae_dtype", "vae_tile_size"):  # environment-backed defaults, now filled
            setattr(self.args, k, getattr(ns, k))
        if self.args.queue_size < 0:
            raise H3Error(f"--queue-size {self.args.queue_size} must be >= 0")
        if not self.args.job_timeout > 0:
            raise H3Error(f"--job-timeout {self.args.job_timeout} must be > 0 seconds")
        if self.args.max_body_mb < 1:
            raise H3Error(f"--max-body-mb {self.args.max_body_mb} must be >= 1")
        from h3direct.app.paths import check_output_dir

        if self.input_root is not None and not self.input_root.is_dir():
            raise H3Error("--input-root: folder not found", path=self.input_root)
        check_output_dir(self.output_root, "--output-root")  # the folder, or where it will be made
        try:
            self.output_root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise H3Error(f"--output-root: cannot create it ({e.strerror})", path=self.output_root) from None

    def load(self) -> None:
        from h3direct.app import provenance

        pipe, sources, seconds, load_memory = gen.load_pipeline(self.args, text_encoder_always=True)
        self.weight_loads += 1
        t = time.perf_counter()
        self.weights = provenance.weights(pipe.files)  # hashed once here (and remembered on disk), not per request
        seconds["sha256"] = round(time.perf_counter() - t, 4)
        self.pipe, self.sources, self.load_seconds, self.load_memory = pipe, sources, seconds, load_memory
        with self._lock:
            if self.state != "loading":  # a signal came while loading: stay stopping, run nothing
                return
            self.state = "ready"
        self.queue.start()

    def stop(self) -> None:
        with self._lock:
            if self.state != "failed":
                self.state = "stopping"
        self.queue.stop()

    def close(self) -> None:
        """After the worker has stopped: remove the uploads folder."""
        import shutil

        if self._uploads is not None:
            shutil.rmtree(self._uploads, ignore_errors=True)

    # ---- /ready ----
    def ready(self) -> dict:
        import torch

        from h3direct.app.pipeline import peak_memory
        from h3direct.app.provenance import version
        from h3direct.dit.attention import attention_stats, backends, unavailable_reason

        pipe = self.pipe
        like = torch.empty(0, device=pipe.device, dtype=pipe.dit.compute_dtype)
        reasons = {b: unavailable_reason(b, like) for b in backends()}
        peak, kind = peak_memory(pipe.device)
        if pipe.device.type == "cuda":
            memory = {"kind": "cuda", "allocated_bytes": int(torch.cuda.memory_allocated(pipe.device)),
                      "reserved_bytes": int(torch.cuda.memory_reserved(pipe.device)), "peak_bytes": peak}
        else:
            memory = {"kind": "cpu_rss", "rss_bytes": _rss_bytes(), "peak_bytes": peak}
        comps = {"dit": pipe.dit, "video_vae": pipe.video_vae, "audio_vae": pipe.audio_vae,
                 "text_encoder": pipe.text_encoder}
        components = {k: {"source": self.sources.get(k), **self.weights.get(k, {}), **_describe(m)}
                      for k, m in comps.items() if m is not None}
        components["dit"]["compute_dtype"] = str(pipe.dit.compute_dtype).removeprefix("torch.")
        fp8 = getattr(pipe.dit, "fp8_linear", "off")
        if fp8 != "off":  # opt-in approximate block linears, chosen when the weights loaded (a server flag)
            from h3direct.checkpoint.quant.w8a8 import fp8_linear_stats

            components["dit"]["fp8_linear"] = {"mode": fp8, "calls": fp8_linear_stats()}
        running = self.queue.running
        return {"status": "ready", "version": version(), "device": str(pipe.device), "components": components,
                "memory": memory,
                "attention": {"default": pipe.attention, "available": [b for b, r in reasons.items() if r is None],
                              "unavailable": {b: r for b, r in reasons.items() if r is not None},
                              # sol_attn: kernel calls vs each documented fallback since the start
                              "calls": attention_stats()},
                "limits": {**self.limits.as_dict(), "max_body_bytes": self.max_body_bytes,
                           "job_timeout_s": self.queue.timeout_s},
                "queue": {"depth": self.queue.depth(), "size": self.queue.size,
                          "running": running.id if running is not None else None,
                          "completed": self.queue.completed},
                "weight_loads": self.weight_loads, "load_seconds": self.load_seconds,
                "output_root": str(self.output_root),
                "input_root": str(self.input_root) if self.input_root else None}

    # ---- a request at the door ----
    def admit(self, req) -> Job:
        """Check a request completely (types were checked by the model), then queue it. Raises H3Error (400),
        NotReady (503), Full (429) or Stopping (503)."""
        if self.state != "ready":
            raise NotReady(self.state)
        ns = argparse.Namespace(upload_dir=None)
        try:
            ns = self.request_args(req, ns)
            return self.queue.submit(ns, self._output_path(req.output))
        except BaseException:
            self._remove_uploads(ns)
            raise

    def _forget(self, job: Job) -> None:
        """A job is over (done, failed, cancelled): its uploads go."""
        self._remove_uploads(job.args)

    @staticmethod
    def _remove_uploads(ns) -> None:
        import shutil

        if ns is not None and getattr(ns, "upload_dir", None) is not None:
            shutil.rmtree(ns.upload_dir, ignore_errors=True)

    def request_args(self, req, ns: argparse.Namespace | None = None) -> argparse.Namespace:
        """The request as the `h3direct generate` arguments it stands for, checked by generate's own checks.
        Uploaded files are written under `ns.upload_dir` (the caller removes it if this raises)."""
        import torch

        from h3direct.dit.attention import check_backend

        ns = ns if ns is not None else argparse.Namespace(upload_dir=None)
        for k, v in self.defaults.items():
            setattr(ns, k, v)
        for k in MODEL_FLAGS:  # compute_dtype included: as load_pipeline resolved it
            setattr(ns, k, getattr(self.args, k))
        body = req.model_dump(exclude_unset=True)
        for name, value in body.items():
            if name == "output" or value is None:
                continue
            if name in FILE_FIELDS:
                value = self._input_paths(name, value, ns)
            setattr(ns, FIELD_DEST.get(name, name), float(value) if isinstance(value, int) and name in (
                "cfg", "cache_threshold", "cache_start_percent", "cache_end_percent") else value)
        ns.output = "unused.mp4"
        try:
            # generate's defaults and checks: sizes, frames, steps, limits, media probes, text embeddings
            gen.resolve_args(ns, check_output=False, limits=self.limits)
            if ns.text_embeds is not None:
                self.pipe.check_text(ns.text_embeds)  # the pipeline's own check, here before queueing
            check_backend(ns.attention, torch.empty(0, device=self.pipe.device, dtype=self.pipe.dit.compute_dtype))
        except H3Error as e:
            raise H3Error(self._field_names(str(e))) from None
        return ns

    def _field_names(self, message: str) -> str:
        import re

        if self.input_root is not None:
            message = message.replace(str(self.input_root) + os.sep, "")
        if self._uploads is not None:
            message = re.sub(re.escape(str(self._uploads)) + r"/request-[^/]*/", "upload:", message)
        for flag, name in _flag_to_field():
            message = re.sub(re.escape(flag) + r"(?![\w-])", name, message)
        return message

    def _input_paths(self, name: str, value, ns: argparse.Namespace):
        """Names under --input-root and uploads (written to this request's folder) -> paths on this machine."""
        if isinstance(value, list):
            return [self._input_path(f"{name}[{i}]", v, ns) for i, v in enumerate(value)]
        return self._input_path(name, value, ns)

    def _input_path(self, field: str, value, ns: argparse.Namespace) -> str:
        import base64
        import binascii
        import re
        import tempfile

        from h3direct.app.paths import confined

        if isinstance(value, str):
            if self.input_root is None:
                raise H3Error(f"{field}: this server reads no input files by name (it was started without "
                              f"--input-root); send the file itself: {{\"filename\": ..., \"base64\": ...}}")
            return str(confined(self.input_root, value, field, must_exist=True))
        try:
            data = base64.b64decode(value["base64"], validate=True)
        except (binascii.Error, ValueError):
            raise H3Error(f"{field}: the upload is not valid base64") from None
        if not data:
            raise H3Error(f"{field}: the upload is empty")
        with self._lock:
            if self._uploads is None:
                self._uploads = Path(tempfile.mkdtemp(prefix="h3direct-uploads-"))
        if ns.upload_dir is None:
            ns.upload_dir = tempfile.mkdtemp(prefix="request-", dir=self._uploads)
        given = Path(value.get("filename") or "upload").name
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", given).lstrip(".")[-100:] or "upload"
        path = Path(ns.upload_dir) / f"{len(os.listdir(ns.upload_dir)):02d}-{safe}"
        path.write_bytes(data)
        return str(path)

    def _output_path(self, name: str | None) -> Path:
        from h3direct.app.paths import confined

        if name is None:
            with self._lock:
                self._counter += 1
                name = f"h3-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._counter:05d}.mp4"
        if not name.lower().endswith(".mp4") or Path(name).name.startswith("."):
            raise H3Error(f"output {name!r} must be a file name ending in .mp4 (not hidden), e.g. clip.mp4")
        target = confined(self.output_root, name, "output", must_exist=False)
        try:
            if not target.parent.is_dir():
                raise H3Error(f"output {name!r}: its folder does not exist under the output folder")
            if target.is_dir():
                raise H3Error(f"output {name!r} is a folder")
        except OSError as e:
            raise H3Error(f"output {name!r}: not a usable file name ({e.strerror})") from None
        return target

    # ---- a job on the worker ----
    def _run_job(self, job: Job, check) -> dict:
        ns = job.args
        pipe = self.pipe
        t_start = time.perf_counter()
        queue_s = max(0.0, (job.started or time.time()) - job.created)
        check(stage="conditioning")

        def on_stage(name: str) -> None:
            if name.endswith(":tile"):  # within a stage: only a chance to stop
                check()
            elif name != "done":  # (done: the mp4 is in place, too late to cancel)
                check(stage=name)

        def on_step(ev) -> None:
            check(step=ev.index + 1)

        import torch

        attention = pipe.attention
        pipe.attention = ns.attention  # per-request backend (checked at the door); only this thread uses pipe
        try:
            res, out, write_s = gen.generate_clip(pipe, ns, callback=on_step, on_stage=on_stage, output=job.output)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()  # give the cached blocks back, so the next (smaller) job can run
            raise
        finally:
            pipe.attention = attention
        timings = {"queue": round(queue_s, 4), **res.timings, "write": round(write_s, 4),
                   "total": round(queue_s + time.perf_counter() - t_start, 4)}
        job.timings = timings
        return gen.summary_of(ns, res, out, pipe, self.sources, timings, self.load_memory)


@functools.cache
def _flag_to_field() -> list[tuple[str, str]]:
    """generate's messages name its flags; a request names fields. (flag, field) for every request field, longest
    flag first (--ref-image-size before --ref-image)."""
    pairs = [(f"--{FIELD_DEST.get(k, k).replace('_', '-')}", k) for k in _request_model().model_fields]
    return sorted([*pairs, ("--cache-*", "cache_*")], key=lambda fn: -len(fn[0]))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _describe(module) -> dict:
    """dtype (by bytes), quantization, device, parameter count and bytes of a loaded model."""
    module = getattr(module, "net", module)  # the text encoder wraps its torch module
    by_dtype: dict[str, int] = {}
    devices = set()
    count = 0
    for t in [*module.parameters(), *module.buffers()]:
        name = str(t.dtype).removeprefix("torch.")
        by_dtype[name] = by_dtype.get(name, 0) + t.numel() * t.element_size()
        devices.add(str(t.device))
        count += t.numel()
    modes = sorted({getattr(m, "mode", "?") for m in module.modules() if type(m).__name__ == "NVFP4Linear"})
    return {"dtype": max(by_dtype, key=by_dtype.get) if by_dtype else None, "dtypes": by_dtype,
            "quantization": f"nvfp4 ({', '.join(modes)})" if modes else "none",
            "device": ",".join(sorted(devices)), "parameters": count, "bytes": sum(by_dtype.values())}


# ---- HTTP ----------------------------------------------------------------------------------------

def _error(status: int, message: str, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": one_line(message)}, status_code=status, headers=headers)


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 (declared or streamed)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = f"the body is over the limit of {self.limit} bytes"
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.limit):
            resp = _error(413 if declared.strip().isdigit() else 400,
                          too_big if declared.strip().isdigit() else "Content-Length is not a byte count")
            return await resp(scope, receive, send)
        seen = 0
        over = False

        async def counted():
            # past the limit the body is cut short (the app sees an end), and `answer` swaps its reply for a 413
            nonlocal seen, over
            if over:
                return {"type": "http.request", "body": b"", "more_body": False}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    over = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg

        async def answer(msg):
            if not over:
                return await send(msg)
            if msg["type"] == "http.response.start":
                await _error(413, too_big)(scope, receive, send)

        await self.app(scope, counted, answer)


def _validation_message(errors) -> tuple[int, str]:
    """FastAPI's validation errors as (status, one line): 400 for a body that is not JSON, else 422 naming the
    field and, for a bad choice or type, the value given."""
    e = errors[0]
    if e.get("type") == "json_invalid":
        return 400, f"the body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})"
    loc = list(e.get("loc", ()))
    loc = loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc
    # the field, and an index into a list field; not the union member names pydantic appends (cfg.float)
    where = "".join([str(loc[0])] + [f"[{x}]" for x in loc[1:2] if isinstance(x, int)]) if loc else "body"
    msg = e.get("msg", "invalid")
    if e.get("type") == "extra_forbidden":
        import difflib

        fields = list(_request_model().model_fields)
        near = difflib.get_close_matches(str(loc[-1]) if loc else "", fields, n=1)
        return 422, f"unknown field {where!r}" + (f" (did you mean {near[0]!r}?)" if near else "")
    if e.get("type") == "model_attributes_type" or where == "body":
        return 422, f"the body must be a JSON object of request fields: {msg}"
    given = e.get("input")
    shown = "" if isinstance(given, dict) else f", got {one_line(json.dumps(given, default=str), 60)}"
    return 422, f"field {where!r}: {msg}{shown}"


def create_app(service: Service):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    from h3direct.app.provenance import version

    GenerateRequest = _request_model()
    app = FastAPI(title="h3direct", version=version(), description=__doc__.split("\n\n")[0])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        status, msg = _validation_message(exc.errors())
        return _error(status, msg)

    @app.exception_handler(HTTPException)
    async def _http(request, exc):
        from http import HTTPStatus

        msg = str(exc.detail)
        if msg == HTTPStatus(exc.status_code).phrase:  # starlette's own: say what to do
            msg = {404: f"no such endpoint {request.url.path!r}; see /docs",
                   405: f"{request.method} {request.url.path}: method not allowed"}.get(exc.status_code, msg)
        elif "parsing the body" in msg:
            msg = "cannot parse the body as JSON (UTF-8, nested at most ~1000 deep, integers under 4300 digits)"
        return _error(exc.status_code, msg, getattr(exc, "headers", None))

    @app.exception_handler(UnicodeDecodeError)
    async def _not_utf8(request, exc):
        return _error(400, "the body is not UTF-8 JSON")

    @app.exception_handler(Exception)
    async def _bug(request, exc):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")

    async def admitted(req):
        """(job, None) or (None, the error response)."""
        try:
            return await run_in_threadpool(service.admit, req), None
        except H3Error as e:
            return None, _error(400, str(e))
        except Full as e:
            return None, _error(429, f"the queue is full ({service.queue.size} waiting); retry later",
                                {"Retry-After": str(e.retry_after)})
        except (Stopping, NotReady) as e:
            status = "stopping" if isinstance(e, Stopping) else e.status
            return None, _error(503, f"the server is {status}", {"Retry-After": "5"})

    @app.get("/health", summary="liveness")
    def health():
        return {"status": service.state}

    @app.get("/ready", summary="readiness: resident models, memory, attention values, limits, queue")
    def ready():
        if service.state != "ready":
            body = {"status": service.state}
            if service.error:
                body["error"] = service.error
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        return service.ready()

    @app.post("/generate", summary="generate and wait: the summary of `h3direct generate`")
    async def generate(req: GenerateRequest, request: Request):
        job, err = await admitted(req)
        if err is not None:
            return err
        while not job.done.is_set():
            if await request.is_disconnected():
                service.queue.cancel(job, "the client disconnected")
                return _error(499, "client disconnected")
            await asyncio.sleep(POLL_S)
        if job.state == "done":
            return job.summary
        return _error(job.status, job.error or job.state)

    @app.post("/jobs", status_code=202, summary="queue a generation; answers its id at once")
    async def submit(req: GenerateRequest):
        job, err = await admitted(req)
        if err is not None:
            return err
        return JSONResponse({**job.view(), "links": _links(job)}, status_code=202,
                            headers={"Location": f"/jobs/{job.id}"})

    @app.get("/jobs", summary="the most recent jobs (newest first), as GET /jobs/{id} shows each")
    def job_list(limit: int = 100):
        jobs = service.queue.recent(max(0, min(limit, 1000)))
        return {"jobs": [{**j.view(), "links": _links(j)} for j in jobs]}

    def find(job_id: str) -> Job:
        job = service.queue.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job

    @app.get("/jobs/{job_id}", summary="a job's state, stage, step, progress, timings, summary or error")
    def job_status(job_id: str):
        job = find(job_id)
        return {**job.view(), "links": _links(job)}

    @app.delete("/jobs/{job_id}", summary="cancel a job (a running one stops at its next step)")
    def job_cancel(job_id: str):
        job = find(job_id)
        service.queue.cancel(job, "cancelled by the client")
        return {**job.view(), "cancel_requested": job.state not in FINAL}

    @app.get("/jobs/{job_id}/output", summary="the finished job's mp4", response_class=FileResponse)
    def job_output(job_id: str):
        job = find(job_id)
        if job.state != "done":
            return _error(409, f"job {job_id} is {job.state}; its output exists once it is done")
        if not job.output.is_file():
            return _error(410, f"the output of job {job_id} is gone from the output folder")
        return FileResponse(job.output, media_type="video/mp4", filename=job.output.name)

    @app.get("/jobs/{job_id}/events", summary="progress as server-sent events")
    async def job_events(job_id: str, request: Request):
        job = find(job_id)

        async def stream():
            seen = -1
            while True:
                version_now = job.version
                if version_now != seen:
                    seen = version_now
                    view = job.view()
                    kind = job.state if job.state in FINAL else "progress"
                    yield f"event: {kind}\ndata: {json.dumps(view, separators=(',', ':'))}\n\n"
                    if kind != "progress":
                        return
                if await request.is_disconnected():
                    return
                await run_in_threadpool(service.queue.wait_changed, job, seen, 0.5)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return _BodyLimit(app, service.max_body_bytes), app


def _links(job: Job) -> dict:
    base = f"/jobs/{job.id}"
    return {"self": base, "events": f"{base}/events", "output": f"{base}/output"}


# ---- running it ----------------------------------------------------------------------------------

def bind(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family = infos[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as e:
        raise H3Error(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    sock.setblocking(False)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class HTTPServer:
    """uvicorn serving `service` on a bound socket; `serve()` in the calling thread, `start()` in a new one
    (tests). Its signal handling is ours (`on_signal`): uvicorn's would re-raise the signal after shutdown."""

    def __init__(self, service: Service, sock: socket.socket, *, quiet: bool = True):
        import contextlib

        import uvicorn

        self.service, self.sock = service, sock
        self.url = _url(sock)
        asgi, self.app = create_app(service)
        config = uvicorn.Config(asgi, log_level="warning" if quiet else "info", access_log=not quiet,
                                lifespan="off", timeout_graceful_shutdown=5, timeout_keep_alive=5)
        outer = self

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield  # the caller installs its own handlers (see run)

            def handle_exit(self, sig, frame):
                outer.on_signal(sig)

        self.server = _Server(config)
        self._signals = 0
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        self.server.run(sockets=[self.sock])

    def start(self) -> "HTTPServer":
        self._thread = threading.Thread(target=self.serve, name="h3direct-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(0.01)
        return self

    def on_signal(self, signum) -> None:
        import signal

        self._signals += 1
        name = signal.Signals(signum).name
        if self._signals > 1:
            print(f"h3direct serve: {name} again: exiting now", file=sys.stderr, flush=True)
            self._remove_partial()
            os._exit(1)
        print(f"h3direct serve: {name}: stopping (new requests get 503; the running job stops at its next step)",
              file=sys.stderr, flush=True)
        self.shutdown(wait=False)

    def shutdown(self, *, wait: bool = True, drain_s: float = 10.0) -> None:
        """Stop accepting jobs, cancel them, let the waiting clients have their answers, then close the socket."""
        self.service.stop()

        def drain():
            deadline = time.monotonic() + drain_s
            while not self.service.queue.idle() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.2)  # the cancelled clients' answers go out
            self.server.should_exit = True

        t = threading.Thread(target=drain, name="h3direct-drain", daemon=True)
        t.start()
        if wait:
            t.join()
            if self._thread is not None:
                self._thread.join(30)

    def _remove_partial(self) -> None:
        job = self.service.queue.running
        if job is not None:
            for p in job.output.parent.glob(f".{job.output.stem}.*.mp4"):
                p.unlink(missing_ok=True)


def run(args: argparse.Namespace) -> int:
    import signal

    import torch

    from h3direct.dit import parallel

    if parallel.env_world_size() > 1:  # every rank would bind the port and take requests alone
        raise H3Error("serve does not run under torchrun yet (sequence parallelism needs every rank to see each "
                      "request); use h3direct generate under torchrun, or serve with one process")
    threads = torch.get_num_threads()
    service = Service(args)
    service.check_flags()  # flags and model files: before binding
    sock = bind(args.host, args.port)
    http = HTTPServer(service, sock, quiet=args.quiet)

    def load():
        try:
            service.load()
        except H3Error as e:
            service.state, service.error = "failed", str(e)
            http.server.should_exit = True
            return
        except Exception as e:  # a bug while loading: the traceback, then exit 1
            import traceback

            traceback.print_exc(file=sys.stderr)
            service.state, service.error = "failed", one_line(f"internal error: {type(e).__name__}: {e}")
            http.server.should_exit = True
            return
        if service.state == "ready":
            print(json.dumps({"url": http.url, "device": str(service.pipe.device), "models": service.sources},
                             separators=(",", ":")), flush=True)

    loader = threading.Thread(target=load, name="h3direct-load", daemon=True)
    previous = {s: signal.signal(s, lambda signum, frame: http.on_signal(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        loader.start()
        http.serve()
        service.stop()
        clean = service.queue.join(10) if service.pipe is not None else True
        loader.join(0 if service.state == "failed" else 10)
        if clean:
            service.close()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        torch.set_num_threads(threads)
    if service.error is not None:
        raise H3Error(service.error)
    if not clean or loader.is_alive():  # a thread still inside torch: leave without waiting for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
