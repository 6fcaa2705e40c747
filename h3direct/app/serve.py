"""`h3direct serve`: the models loaded once, generations over HTTP (standard library only).

    h3direct serve [--host 127.0.0.1] [--port 8188] [--output-dir output] [model flags of `h3direct generate`]

Startup prints one JSON line on stdout: {"url", "device", "models"}. Endpoints (every body is JSON):

    GET  /health    200 {"status": "ok"|"stopping", "device", "models", "busy", "queued", "generations",
                         "load_seconds"}
    POST /generate  body: a JSON object with the request fields of `h3direct generate`, named as in REQUEST_FIELDS
                    (file fields are paths on the server, relative ones from its working directory); answers
                    200 with the summary `h3direct generate` prints, the mp4 written under --output-dir.

One generation runs at a time: a concurrent request waits its turn, or with --no-queue gets 503 and a
Retry-After header. Errors are {"error": "<one line>"}: 400 bad request (JSON, types, unknown fields, values,
missing files, attention backend), 404 unknown path, 405 wrong method, 411 no Content-Length, 413 body over
MAX_BODY_BYTES, 503 busy or shutting down, 500 internal failure (its traceback goes to the server's stderr only).
SIGINT/SIGTERM: stop accepting, let the running generation finish and answer, exit 0 (a second signal: at once).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import re
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from h3direct.errors import H3Error

DEFAULT_PORT = 8188
MAX_BODY_BYTES = 1 << 20
SOCKET_TIMEOUT_S = 60  # a client that stalls mid-request loses its connection, not a server thread forever
OUTPUT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,123}\.mp4")  # a plain file name: no directories, no dotfiles

# server flags taken over from `h3direct generate` (same names, types, choices and defaults)
MODEL_FLAGS = ("checkpoint", "vae", "audio_vae", "vae_config", "audio_vae_config", "text_encoder", "tokenizer",
               "compute_dtype", "nvfp4_mode", "device", "attention", "threads", "mlp_chunks", "vae_dtype",
               "vae_tile_size", "ffmpeg_loglevel")

# request field -> (JSON type, `h3direct generate` argument it fills). null = the generate default.
STR, INT, NUM, BOOL, PATHS = "string", "integer", "number", "boolean", "list of strings"
REQUEST_FIELDS: dict[str, tuple[str, str]] = {
    "prompt": (STR, "prompt"), "negative_prompt": (STR, "negative_prompt"),
    "width": (INT, "width"), "height": (INT, "height"), "frames": (INT, "frames"), "steps": (INT, "steps"),
    "seed": (INT, "seed"), "sampler": (STR, "sampler"), "scheduler": (STR, "scheduler"), "cfg": (NUM, "cfg"),
    "ref_images": (PATHS, "ref_image"), "ref_videos": (PATHS, "ref_video"), "ref_audios": (PATHS, "ref_audio"),
    "ref_image_size": (STR, "ref_image_size"), "first_frame": (STR, "first_frame"), "last_frame": (STR, "last_frame"),
    "cache_mode": (STR, "cache_mode"), "cache_threshold": (NUM, "cache_threshold"),
    "cache_start_percent": (NUM, "cache_start_percent"), "cache_end_percent": (NUM, "cache_end_percent"),
    "cache_subsample_factor": (INT, "cache_subsample_factor"), "text_embeds": (STR, "text_embeds"),
    "attention": (STR, "attention"), "progress": (BOOL, "progress"), "profile_memory": (BOOL, "profile_memory"),
    "output": (STR, "output"),
}


class Busy(Exception):
    """A generation is running (--no-queue) or the server is stopping: 503."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


def _generate_parser() -> argparse.ArgumentParser:
    from h3direct.app import generate

    p = argparse.ArgumentParser(prog="h3direct generate", add_help=False)
    generate.add_arguments(p)
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT}; 0 = any free)")
    g.add_argument("--output-dir", default="output", help="where the mp4s are written (default ./output)")
    g.add_argument("--no-queue", action="store_true", help="answer 503 + Retry-After while a generation runs "
                   "instead of queueing the request")
    g.add_argument("--quiet", action="store_true", help="no access log on stderr")
    g = parser.add_argument_group("models and runtime (as `h3direct generate`; each omitted model: bundled tiny)")
    for a in _generate_parser()._actions:
        if a.dest in MODEL_FLAGS:
            g.add_argument(*a.option_strings, dest=a.dest, default=a.default, type=a.type, choices=a.choices,
                           metavar=a.metavar, help=a.help)


# ---- the service: models + lock, no HTTP ---------------------------------------------------------

def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class Service:
    """The loaded pipeline and the one-generation-at-a-time lock. `handle(body)` -> summary dict; raises
    H3Error (the request is wrong), Busy (503) or anything else (a bug: 500)."""

    def __init__(self, args: argparse.Namespace, pipe, sources: dict, load_seconds: dict, load_memory: int):
        self.args, self.pipe, self.sources = args, pipe, sources
        self.load_seconds, self.load_memory = load_seconds, load_memory
        self.output_dir = Path(args.output_dir).resolve()
        self.defaults = vars(_generate_parser().parse_args([]))
        self.choices = {a.dest: a.choices for a in _generate_parser()._actions if a.choices}
        self.stopping = False
        self.generations = 0
        self._lock = threading.Lock()
        self._count_lock = threading.Condition()
        self._active = 0  # /generate requests between arrival and their answer (graceful shutdown waits for 0)
        self._queued = 0  # requests waiting for the lock
        self._last_seconds = 1.0
        self._counter = 0

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    def health(self) -> dict:
        return {"status": "stopping" if self.stopping else "ok", "device": str(self.pipe.device),
                "models": self.sources, "busy": self.busy, "queued": self._queued, "generations": self.generations,
                "load_seconds": self.load_seconds}

    # request accounting for graceful shutdown
    def enter(self) -> None:
        with self._count_lock:
            self._active += 1

    def leave(self) -> None:
        with self._count_lock:
            self._active -= 1
            self._count_lock.notify_all()

    def wait_idle(self, poll_s: float = 0.5) -> None:
        with self._count_lock:
            while self._active:
                self._count_lock.wait(poll_s)

    # ---- one request ----
    def request_args(self, body: dict) -> argparse.Namespace:
        """The JSON body as the `h3direct generate` arguments it stands for, validated by generate's checks."""
        from h3direct.app.generate import resolve_args

        if not isinstance(body, dict):
            raise H3Error(f"the body must be a JSON object of request fields, got a JSON {_json_type(body)}")
        unknown = sorted(set(body) - set(REQUEST_FIELDS))
        if unknown:
            near = difflib.get_close_matches(unknown[0], REQUEST_FIELDS, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else f"; fields: {', '.join(REQUEST_FIELDS)}"
            raise H3Error(f"unknown field {unknown[0]!r}{hint}")
        ns = argparse.Namespace(**self.defaults)
        for k in MODEL_FLAGS:
            setattr(ns, k, getattr(self.args, k))
        for name, value in body.items():
            kind, dest = REQUEST_FIELDS[name]
            if value is None:
                continue
            _check_type(name, value, kind)
            if self.choices.get(dest) and value not in self.choices[dest]:
                raise H3Error(f"{name} {value!r}: use one of {', '.join(self.choices[dest])}")
            setattr(ns, dest, float(value) if kind == NUM else value)
        ns.output = str(self.output_dir / self._output_name(body.get("output")))
        try:
            resolve_args(ns)  # generate's defaults and checks: sizes, frames, steps, sampler, files, ...
        except H3Error as e:
            raise H3Error(_field_names(str(e))) from None
        if ns.attention != self.pipe.attention:
            import torch

            from h3direct.dit.attention import check_backend

            check_backend(ns.attention, torch.empty(0, device=self.pipe.device))
        return ns

    def _output_name(self, name) -> str:
        if name is not None:
            if not OUTPUT_NAME.fullmatch(name):
                raise H3Error(f"output {name!r} must be a plain file name ending in .mp4 (letters, digits, '.', '_', "
                              f"'-'; no directories), e.g. clip.mp4")
            return name
        with self._count_lock:
            while True:
                self._counter += 1
                name = f"h3-{time.strftime('%Y%m%d-%H%M%S')}-{self._counter:04d}.mp4"
                if not (self.output_dir / name).exists():
                    return name

    def handle(self, body, *, wait: bool = True) -> dict:
        t_start = time.perf_counter()
        if self.stopping:
            raise Busy("the server is shutting down", 1)
        ns = self.request_args(body)
        t_wait = time.perf_counter()
        with self._count_lock:
            self._queued += 1
        try:
            acquired = self._lock.acquire(blocking=wait)
        finally:
            with self._count_lock:
                self._queued -= 1
        if not acquired:
            raise Busy("a generation is running; retry later", max(1, math.ceil(self._last_seconds)))
        try:
            if self.stopping:
                raise Busy("the server is shutting down", 1)
            t_run = time.perf_counter()
            summary = self._generate(ns, queue_s=t_run - t_wait, t_start=t_start)
            self._last_seconds = time.perf_counter() - t_run
            self.generations += 1
            return summary
        finally:
            self._lock.release()

    def _generate(self, ns: argparse.Namespace, *, queue_s: float, t_start: float) -> dict:
        from h3direct.app.generate import generate_clip, summary_of

        pipe = self.pipe
        attention = pipe.attention
        pipe.attention = ns.attention  # per-request backend (checked in request_args); under the lock
        try:
            res, out, write_s = generate_clip(pipe, ns)
        finally:
            pipe.attention = attention
        # timings: "queue" (wait for the lock) instead of the per-run "bundle"/"load" (paid once at startup:
        # GET /health "load_seconds")
        timings = {"queue": round(queue_s, 4), **res.timings, "write": round(write_s, 4),
                   "total": round(time.perf_counter() - t_start, 4)}
        ns.compute_dtype = self.args.compute_dtype
        return summary_of(ns, res, out, pipe, self.sources, timings, self.load_memory)


# generate's messages name its flags; a request names fields (longest flag first: --ref-image-size)
_FLAG_TO_FIELD = sorted((("--" + dest.replace("_", "-"), name) for name, (_, dest) in REQUEST_FIELDS.items()),
                        key=lambda fn: -len(fn[0]))


def _field_names(message: str) -> str:
    for flag, name in _FLAG_TO_FIELD:
        message = re.sub(re.escape(flag) + r"(?![\w-])", name, message)
    return message


def _json_type(v) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(v), type(v).__name__)


def _check_type(name: str, value, kind: str) -> None:
    ok = {STR: isinstance(value, str), BOOL: isinstance(value, bool),
          INT: isinstance(value, int) and not isinstance(value, bool),
          NUM: isinstance(value, int | float) and not isinstance(value, bool),
          PATHS: isinstance(value, list) and all(isinstance(x, str) for x in value)}[kind]
    if not ok:
        shown = _one_line(json.dumps(value), 60)
        raise H3Error(f"field {name!r} must be a {kind}, got a JSON {_json_type(value)}: {shown}")


def load_service(args: argparse.Namespace) -> Service:
    """Validate the server's model flags with generate's checks, then load the pipeline once."""
    from h3direct.app.generate import load_pipeline, resolve_args

    ns = argparse.Namespace(**vars(_generate_parser().parse_args([])))
    for k in MODEL_FLAGS:
        setattr(ns, k, getattr(args, k))
    resolve_args(ns)  # model files, --vae-config without --vae, vae dtype/tile size, threads, mlp chunks, ...
    for k in ("vae_dtype", "vae_tile_size"):  # environment-backed defaults, now filled
        setattr(args, k, getattr(ns, k))
    out_dir = Path(args.output_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise H3Error(f"--output-dir: cannot create it ({e.strerror})", path=out_dir) from None
    if not out_dir.is_dir():
        raise H3Error("--output-dir is not a directory", path=out_dir)
    pipe, sources, seconds, load_memory = load_pipeline(args, text_encoder_always=True)
    return Service(args, pipe, sources, seconds, load_memory)


# ---- HTTP --------------------------------------------------------------------------------------

ROUTES = {"/health": "GET", "/generate": "POST"}


class Handler(BaseHTTPRequestHandler):
    server: H3Server
    server_version = "h3direct"
    timeout = SOCKET_TIMEOUT_S

    # every answer is JSON, the ones http.server makes itself (bad request line, 501, ...) too
    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        self._send(code, {"error": _one_line(message or HTTPStatus(code).phrase)}, close=True)

    def _send(self, code: int, payload: dict, headers: dict | None = None, *, close: bool = False) -> None:
        data = (json.dumps(payload, separators=(",", ":")) + "\n").encode()
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client left; nothing to answer
            self.close_connection = True

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's signature)
        if not self.server.quiet:
            sys.stderr.write(f"h3direct serve: {self.address_string()} {format % args}\n")

    def _route(self) -> None:
        path = urlsplit(self.path).path
        method = ROUTES.get(path)
        if method is None:
            return self._send(404, {"error": f"no such endpoint {path!r}; endpoints: GET /health, POST /generate"})
        if self.command != method:
            return self._send(405, {"error": f"{self.command} {path}: use {method}"}, {"Allow": method}, close=True)
        try:
            if path == "/health":
                return self._send(200, self.server.service.health())
            return self._generate()
        except Exception as exc:  # a bug: one line to the client, the traceback to our stderr only
            traceback.print_exc(file=sys.stderr)
            return self._send(500, {"error": _one_line(f"internal error: {type(exc).__name__}: {exc}")}, close=True)

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None:
            self._send(411, {"error": "a POST body needs a Content-Length header"}, close=True)
            return None
        if not length.strip().isdigit():
            self._send(400, {"error": f"Content-Length {length!r} is not a byte count"}, close=True)
            return None
        n = int(length)
        if n > MAX_BODY_BYTES:
            self._send(413, {"error": f"body of {n} bytes is over the limit of {MAX_BODY_BYTES} bytes"}, close=True)
            return None
        raw = self.rfile.read(n)
        if len(raw) != n:
            self._send(400, {"error": f"body ended after {len(raw)} of {n} bytes"}, close=True)
            return None
        try:
            return (json.loads(raw.decode("utf-8"), parse_constant=_reject_constant),)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            self._send(400, {"error": _one_line(f"the body is not valid JSON: {e}")})
            return None

    def _generate(self) -> None:
        service = self.server.service
        service.enter()
        try:
            got = self._read_body()
            if got is None:
                return
            try:
                summary = service.handle(got[0], wait=not self.server.no_queue)
            except H3Error as e:
                return self._send(400, {"error": _one_line(str(e))})
            except Busy as e:
                return self._send(503, {"error": str(e)}, {"Retry-After": str(e.retry_after)})
            self._send(200, summary)
        finally:
            service.leave()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_HEAD = _route


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


class H3Server(ThreadingHTTPServer):
    # request threads are joined by server_close(), so no thread is still inside torch/PyAV while the interpreter
    # shuts down (that aborted the process now and then); a stuck client is bounded by the socket timeout
    daemon_threads = False
    block_on_close = True

    def __init__(self, service: Service, host: str, port: int, *, no_queue: bool = False, quiet: bool = False):
        self.service, self.no_queue, self.quiet = service, no_queue, quiet
        try:
            super().__init__((host, port), Handler)
        except OSError as e:
            raise H3Error(f"cannot listen on {host}:{port} ({e.strerror or e})") from None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"


# ---- the command ---------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    import signal

    import torch

    from h3direct.dit import parallel

    if parallel.env_world_size() > 1:  # every rank would bind the port and take requests alone
        raise H3Error("serve does not run under torchrun yet (sequence parallelism needs every rank to see each "
                      "request); use h3direct generate under torchrun, or serve with one process")
    threads = torch.get_num_threads()
    try:
        service = load_service(args)
        server = H3Server(service, args.host, args.port, no_queue=args.no_queue, quiet=args.quiet)
        stop = threading.Event()

        def on_signal(signum, frame):
            if stop.is_set():
                raise KeyboardInterrupt  # a second signal: do not wait for the running generation
            print(f"h3direct serve: {signal.Signals(signum).name}: finishing the running request, then exiting",
                  file=sys.stderr, flush=True)
            stop.set()

        worker = threading.Thread(target=server.serve_forever, name="h3direct-serve", daemon=True)
        previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            worker.start()
            print(json.dumps({"url": server.url, "device": str(service.pipe.device), "models": service.sources},
                             separators=(",", ":")), flush=True)
            while not stop.wait(0.5):
                pass
            service.stopping = True
            server.shutdown()
            service.wait_idle()
        finally:
            server.server_close()  # joins the request threads
            if worker.is_alive():
                worker.join(timeout=10)
            for s, h in previous.items():
                signal.signal(s, h)
        return 0
    finally:
        torch.set_num_threads(threads)
