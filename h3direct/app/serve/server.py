"""Running the service: the socket bound first (before any model loads), uvicorn on it, the models loaded in a
thread (GET /ready answers 503 "loading" meanwhile; once they are resident one JSON line goes to stdout: {"url",
"device", "models"}), and the signals.

One generation runs at a time (a worker thread); the mp4 is written under a temporary name and renamed, and the
temporary file is removed on every path. SIGTERM/SIGINT: refuse new jobs, /ready says 503 "stopping", cancel the
running job at its next step, answer the waiting clients, exit 0; a second signal exits at once (status 1).
"""

# no `from __future__ import annotations` (the annotations of the uvicorn subclass)
import json
import os
import socket
import sys
import threading
import time

from h3direct.app.jobs import one_line
from h3direct.app.serve.http import create_app
from h3direct.app.serve.service import Service
from h3direct.errors import H3Error


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


def run(service: Service) -> int:
    """Serve until a signal: bind, load in a thread, serve in this one; exit 0 when stopped cleanly."""
    import signal

    import torch

    from h3direct.dit import parallel

    if parallel.env_world_size() > 1:  # every rank would bind the port and take requests alone
        raise H3Error("serve does not run under torchrun yet (sequence parallelism needs every rank to see each "
                      "request); use h3direct generate under torchrun, or serve with one process")
    threads = torch.get_num_threads()
    service.prepare()
    sock = bind(service.settings.host, service.settings.port)
    http = HTTPServer(service, sock, quiet=service.settings.quiet)
    loader = threading.Thread(target=_load, args=(service, http), name="h3direct-load", daemon=True)
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


def _load(service: Service, http: HTTPServer) -> None:
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
