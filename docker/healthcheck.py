"""The image's HEALTHCHECK: GET /ready of `h3direct serve` when the container runs it, else nothing to check.

    python healthcheck.py arm -- CMD ARGS...   # entrypoint: if CMD is `h3direct serve`, remember where it listens
    python healthcheck.py [--url URL] [--token-file F]   # HEALTHCHECK: 0 ready, 1 not (loading: 503)

The entrypoint arms the probe with the command it is about to exec, so the same image serves both the
interactive shell (never armed: always healthy, since a shell has no readiness) and the resident service
(armed: healthy only once the models are loaded). `--url` probes that URL unconditionally (compose's
h3-hot-runtime healthcheck names its /ready explicitly). A service started with `--auth-token-file F` answers /ready
only with `Authorization: Bearer <token>`: the probe sends the token of `--token-file F` (when that file exists), or
of the serve command's own --auth-token-file when armed.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

PROBE_FILE = os.environ.get("H3_HEALTH_FILE", "/tmp/h3direct-serve.json")
DEFAULT_PORT = 8188
TIMEOUT_S = 4.0


def serve_flag(argv: list[str], flag: str) -> str | None:
    """The value of `flag` (`--flag V` or `--flag=V`) in `argv`, else None."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def serve_address(argv: list[str]) -> tuple[str, int] | None:
    """(host, port) that `argv` will listen on if it runs `h3direct serve`, else None.

    Recognizes `h3direct serve ...` and `python -m h3direct serve ...` (any python executable)."""
    args = list(argv)
    if args and os.path.basename(args[0]).startswith("python") and args[1:3] == ["-m", "h3direct"]:
        args = args[2:]
    if len(args) < 2 or os.path.basename(args[0]) != "h3direct" or args[1] != "serve":
        return None
    host, port = "127.0.0.1", DEFAULT_PORT
    rest = args[2:]
    for i, a in enumerate(rest):
        for flag in ("--host", "--port"):
            if a == flag and i + 1 < len(rest):
                value = rest[i + 1]
            elif a.startswith(flag + "="):
                value = a.split("=", 1)[1]
            else:
                continue
            if flag == "--host":
                host = value
            else:
                try:
                    port = int(value)
                except ValueError:
                    return None  # serve itself rejects it; nothing to probe
    if host in ("0.0.0.0", "", "::"):  # listening everywhere: ask over loopback
        host = "127.0.0.1"
    return host, port


def ready_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/ready" if ":" in host else f"http://{host}:{port}/ready"


def arm(argv: list[str]) -> int:
    address = serve_address(argv)
    if address is None:
        if os.path.exists(PROBE_FILE):
            os.remove(PROBE_FILE)
        return 0
    with open(PROBE_FILE, "w") as f:
        token_file = serve_flag(argv, "--auth-token-file")
        json.dump({"url": ready_url(*address), **({"token_file": token_file} if token_file else {})}, f)
    return 0


def _headers(token_file: str | None) -> dict:
    if not token_file or not os.path.isfile(token_file):
        return {}
    with open(token_file) as f:
        return {"Authorization": f"Bearer {f.read().strip()}"}


def probe(url: str | None, token_file: str | None = None) -> int:
    if url is None:
        if not os.path.exists(PROBE_FILE):
            return 0  # not running the service: nothing to be unhealthy about
        with open(PROBE_FILE) as f:
            armed = json.load(f)
        url, token_file = armed["url"], token_file or armed.get("token_file")
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_headers(token_file)),
                                    timeout=TIMEOUT_S) as r:
            status = r.status
    except urllib.error.HTTPError as exc:
        status = exc.code
    except (urllib.error.URLError, OSError) as exc:
        print(f"{url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"{url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["arm"]:
        rest = argv[1:]
        return arm(rest[1:] if rest[:1] == ["--"] else rest)
    token_file = serve_flag(argv, "--token-file")
    rest = [a for i, a in enumerate(argv) if a != "--token-file" and (i == 0 or argv[i - 1] != "--token-file")]
    if rest[:1] == ["--url"] and len(rest) == 2:
        return probe(rest[1], token_file)
    if not rest:
        return probe(None, token_file)
    print("usage: healthcheck.py [--url URL] [--token-file F] | arm -- CMD ARGS...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
