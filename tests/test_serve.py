"""`h3direct serve` on loopback: health, real generations with the bundled tiny models (checked against the
`h3direct generate` CLI and PyAV), every bad-request class, serialisation of concurrent requests, SIGTERM."""

import hashlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from h3direct.app import cli
from h3direct.app.serve import MAX_BODY_BYTES, H3Server, load_service

av = pytest.importorskip("av")

TIMEOUT = 60  # seconds, every socket and wait in this file
SMALL = {"width": 96, "height": 64, "frames": 22, "steps": 2}
FAST = {"width": 96, "height": 64, "frames": 5, "steps": 1}
BUNDLED = {"dit": "bundled", "video_vae": "bundled", "audio_vae": "bundled", "text_encoder": "bundled"}
# per-run values: where the file went, how long it took, how much memory the process has touched so far
VOLATILE = {"output", "timings", "peak_memory_bytes"}




@pytest.fixture(scope="module")
def service(cache_env, tmp_path_factory):
    """The models, loaded once for the module, exactly as `h3direct serve` loads them."""
    out = tmp_path_factory.mktemp("served")
    args = cli.build_parser("serve").parse_args(["serve", "--port", "0", "--output-dir", str(out), "--quiet"])
    threads = torch.get_num_threads()
    yield load_service(args)
    torch.set_num_threads(threads)


def _start(service, **kw):
    srv = H3Server(service, "127.0.0.1", 0, quiet=True, **kw)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    return srv, t


@pytest.fixture
def server(service):
    srv, t = _start(service)
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(TIMEOUT)


@pytest.fixture
def server_no_queue(service):
    srv, t = _start(service, no_queue=True)
    yield srv
    srv.shutdown()
    srv.server_close()
    t.join(TIMEOUT)


def _call(srv, method: str, path: str, body=None, *, raw: bytes | None = None):
    host, port = srv.server_address[:2]
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        text = resp.read().decode()
        return resp.status, dict(resp.getheaders()), (json.loads(text) if text else None)
    finally:
        conn.close()


def _assert_error(got, status: int, needle: str = "") -> str:
    code, _, payload = got
    assert code == status, payload
    assert set(payload) == {"error"}, payload
    msg = payload["error"]
    assert isinstance(msg, str) and msg and "\n" not in msg and "Traceback" not in msg, msg
    assert needle in msg, msg
    return msg


def _assert_serving(srv) -> None:
    code, _, health = _call(srv, "GET", "/health")
    assert code == 200 and health["status"] == "ok" and health["busy"] is False, health


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _probe(path) -> dict:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        return {"frames": sum(1 for _ in c.decode(video=0)), "width": v.width, "height": v.height,
                "channels": a.channels, "rate": a.rate}


# ---- health and real generations ----------------------------------------------------------------

def test_health(server):
    code, headers, h = _call(server, "GET", "/health")
    assert code == 200 and headers["Content-Type"] == "application/json"
    assert (h["status"], h["device"], h["models"], h["busy"], h["queued"]) == ("ok", "cpu", BUNDLED, False, 0)


def test_generation_writes_the_mp4_its_summary_describes(server, service):
    code, _, s = _call(server, "POST", "/generate", {**SMALL, "prompt": "a red ball", "seed": 1, "output": "one.mp4"})
    assert code == 200, s
    out = Path(s["output"])
    assert out == service.output_dir / "one.mp4"
    assert _probe(out) == {"frames": s["frames"], "width": 96, "height": 64, "channels": 2, "rate": 32000}
    assert (s["frames"], s["task"], s["steps"], s["seed"]) == (22, "t2va", 2, 1)
    assert not [p.name for p in service.output_dir.iterdir() if p.name.startswith(".")]  # no temp file left


def test_same_seed_same_clip_and_the_same_as_generate_cli(server, tmp_path, capsys):
    req = {**SMALL, "prompt": "waves at dusk", "seed": 5}
    runs = []
    for name, seed in (("a.mp4", 5), ("b.mp4", 5), ("c.mp4", 6)):
        code, _, s = _call(server, "POST", "/generate", {**req, "seed": seed, "output": name})
        assert code == 200, s
        runs.append(s)
    a, b, c = runs
    assert _sha(a["output"]) == _sha(b["output"])
    assert {k: v for k, v in a.items() if k not in VOLATILE} == {k: v for k, v in b.items() if k not in VOLATILE}
    assert _sha(c["output"]) != _sha(a["output"])  # the seed reaches the sampler

    # the reference: `h3direct generate` with the same request, in this process
    cli_out = tmp_path / "cli.mp4"
    argv = ["generate", "--prompt", req["prompt"], "--seed", "5", "--output", str(cli_out)]
    argv += [x for k in ("width", "height", "frames", "steps") for x in (f"--{k}", str(req[k]))]
    rc = cli.main(argv)
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    ref = json.loads(stdout)
    assert _sha(cli_out) == _sha(a["output"])
    assert set(ref) == set(a)
    assert {k: v for k, v in ref.items() if k not in VOLATILE} == {k: v for k, v in a.items() if k not in VOLATILE}
    stages = {"conditioning", "text_encode", "sample", "decode_video", "decode_audio", "write", "total"}
    assert stages <= set(ref["timings"]) & set(a["timings"])


# ---- bad requests -------------------------------------------------------------------------------

BAD = [  # (id, json body or raw bytes, words the one-line error must contain)
    ("invalid_json", b'{"prompt": ', "JSON"),
    ("not_an_object", b"[1, 2]", "object"),
    ("nan", b'{"cfg": NaN}', "NaN"),
    ("string_for_int", {"width": "96"}, "width"),
    ("bool_for_int", {"steps": True}, "steps"),
    ("float_for_int", {"frames": 22.0}, "frames"),
    ("string_for_list", {"ref_images": "a.png"}, "ref_images"),
    ("unknown_field", {"promt": "x"}, "promt"),
    ("frames_too_few", {"frames": 4}, "frames"),
    ("frames_too_many", {"frames": 3601}, "frames"),
    ("width_not_multiple_of_32", {"width": 100}, "width"),
    ("height_zero", {"height": 0}, "height"),
    ("steps_zero", {"steps": 0}, "steps"),
    ("seed_negative", {"seed": -1}, "seed"),
    ("cfg_zero", {"cfg": 0}, "cfg"),
    ("unknown_sampler", {"sampler": "ddim"}, "ddim"),
    ("bad_choice", {"ref_image_size": "huge"}, "ref_image_size"),
    ("missing_ref_image", {"ref_images": ["/nonexistent/ref.png"]}, "ref_images"),
    ("missing_text_embeds", {"text_embeds": "missing_embeds.safetensors"}, "text_embeds"),
    ("unknown_attention", {"attention": "flash9000"}, "flash9000"),
    ("output_parent", {"output": "../escape.mp4"}, "output"),
    ("output_absolute", {"output": "{parent}/escape.mp4"}, "output"),
    ("output_subdir", {"output": "sub/x.mp4"}, "output"),
    ("output_backslash", {"output": "..\\escape.mp4"}, "output"),
    ("output_dotdot", {"output": ".."}, "output"),
    ("output_hidden", {"output": ".x.mp4"}, "output"),
    ("output_not_mp4", {"output": "clip.txt"}, "output"),
]


@pytest.mark.parametrize("body", [pytest.param(b, id=i) for i, b, _ in BAD])
def test_bad_request_is_400_and_the_server_keeps_serving(server, service, body, request):
    needle = next(n for i, _, n in BAD if i == request.node.callspec.id)
    parent = service.output_dir.parent
    before = sorted(p.name for p in parent.rglob("*"))
    raw = body if isinstance(body, bytes) else None
    if not raw and "output" in body:
        body = {"output": body["output"].replace("{parent}", str(parent))}
    # a valid request apart from the one bad field: were that field not checked, this would generate a clip
    got = _call(server, "POST", "/generate", None if raw else {**FAST, **body}, raw=raw)
    _assert_error(got, 400, needle)
    assert sorted(p.name for p in parent.rglob("*")) == before  # nothing written, inside or beside output_dir
    _assert_serving(server)


def test_http_statuses(server):
    _assert_error(_call(server, "GET", "/nope"), 404, "/nope")
    _assert_error(_call(server, "POST", "/generate/../health", FAST), 404)
    got = _call(server, "GET", "/generate")
    _assert_error(got, 405, "POST")
    assert got[1]["Allow"] == "POST"
    got = _call(server, "POST", "/health", {})
    _assert_error(got, 405, "GET")
    assert got[1]["Allow"] == "GET"
    _assert_error(_call(server, "PUT", "/generate", FAST), 405)
    _assert_error(_call(server, "DELETE", "/health"), 405)

    host, port = server.server_address[:2]
    for headers, status in (({"Content-Length": str(MAX_BODY_BYTES + 1)}, 413), ({}, 411),
                            ({"Content-Length": "12x"}, 400)):
        conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT)
        conn.putrequest("POST", "/generate")
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()  # no body sent: the server must answer from the headers alone
        resp = conn.getresponse()
        _assert_error((resp.status, dict(resp.getheaders()), json.loads(resp.read())), status)
        conn.close()
    _assert_serving(server)


def test_internal_failure_is_500_with_one_line_and_traceback_on_stderr(server, service, monkeypatch, capsys):
    def boom(*a, **k):
        raise RuntimeError("kaboom\n  second line of a bug")

    monkeypatch.setattr(service.pipe, "generate", boom)
    msg = _assert_error(_call(server, "POST", "/generate", FAST), 500, "kaboom")
    assert "second line" in msg  # folded into the one line
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.undo()
    _assert_serving(server)  # the lock was released


# ---- concurrency --------------------------------------------------------------------------------

class _Gate:
    """Wraps pipe.generate: holds each call at the gate until released; counts calls running at once."""

    def __init__(self, real):
        self.real, self.entered, self.release = real, threading.Event(), threading.Event()
        self.guard, self.calls, self.active, self.peak = threading.Lock(), 0, 0, 0

    def __call__(self, *a, **k):
        with self.guard:
            self.calls += 1
            self.active += 1
            self.peak = max(self.peak, self.active)
        self.entered.set()
        try:
            assert self.release.wait(TIMEOUT)
            return self.real(*a, **k)
        finally:
            with self.guard:
                self.active -= 1


def _post_in_thread(srv, body, results, key):
    def go():
        results[key] = _call(srv, "POST", "/generate", body)

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _wait_for(pred, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_concurrent_requests_are_serialised(server, service, monkeypatch):
    gate = _Gate(service.pipe.generate)
    monkeypatch.setattr(service.pipe, "generate", gate)
    results = {}
    ta = _post_in_thread(server, {**FAST, "output": "first.mp4"}, results, "a")
    assert gate.entered.wait(TIMEOUT)
    tb = _post_in_thread(server, {**FAST, "output": "second.mp4"}, results, "b")
    _wait_for(lambda: _call(server, "GET", "/health")[2]["queued"] == 1, "the second request to queue")
    h = _call(server, "GET", "/health")[2]
    assert h["busy"] is True and gate.calls == 1  # the second request waits outside the pipeline
    gate.release.set()
    ta.join(TIMEOUT)
    tb.join(TIMEOUT)
    assert results["a"][0] == 200 and results["b"][0] == 200, results
    assert gate.calls == 2 and gate.peak == 1
    assert {Path(results[k][2]["output"]).name for k in "ab"} == {"first.mp4", "second.mp4"}
    assert results["b"][2]["timings"]["queue"] > 0
    _assert_serving(server)


def test_no_queue_answers_503_with_retry_after(server_no_queue, service, monkeypatch):
    gate = _Gate(service.pipe.generate)
    monkeypatch.setattr(service.pipe, "generate", gate)
    results = {}
    ta = _post_in_thread(server_no_queue, FAST, results, "a")  # default output name
    assert gate.entered.wait(TIMEOUT)
    got = _call(server_no_queue, "POST", "/generate", FAST)
    _assert_error(got, 503, "running")
    assert int(got[1]["Retry-After"]) >= 1
    gate.release.set()
    ta.join(TIMEOUT)
    code, _, s = results["a"]
    assert code == 200 and Path(s["output"]).parent == service.output_dir and s["output"].endswith(".mp4")
    assert gate.calls == 1
    _assert_serving(server_no_queue)


# ---- the command --------------------------------------------------------------------------------

def test_command_startup_line_and_graceful_sigterm(cache_env, tmp_path):
    """`h3direct serve` as a user runs it: one JSON line, then SIGTERM lets the running request finish."""
    env = {**os.environ, "H3_CACHE_DIR": str(cache_env), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "h3direct", "serve", "--port", "0", "--output-dir", "out",
                             "--quiet"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        start = json.loads(proc.stdout.readline())
        assert set(start) == {"url", "device", "models"} and start["models"] == BUNDLED
        host, port = start["url"].removeprefix("http://").split(":")

        class Remote:
            server_address = (host, int(port))

        results = {}
        t = _post_in_thread(Remote, {**SMALL, "output": "last.mp4"}, results, "a")
        _wait_for(lambda: "a" in results or _call(Remote, "GET", "/health")[2]["busy"], "the generation to start")
        proc.send_signal(signal.SIGTERM)
        t.join(TIMEOUT)
        assert results["a"][0] == 200, results["a"]
        rc = proc.wait(TIMEOUT)
        err = proc.stderr.read()
        assert rc == 0, err
        assert "SIGTERM" in err and "Traceback" not in err, err
        assert _probe(tmp_path / "out" / "last.mp4")["frames"] == 22
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
