"""`h3direct serve` over a real socket on 127.0.0.1 with the bundled tiny models: readiness, generations checked
against the CLI and PyAV, provenance, every bad-request class answered 4xx at the door within a second, jobs with
progress events and cancel, a full queue, a dropped client, a timeout, a failing job, attention switches without
reloads, outputs never replaced unasked (409), /docs without a CDN, 200+ mixed requests from 8 threads, and SIGTERM on
the real command."""

import base64
import hashlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import av  # (the media and serve extras: CI installs them, so their absence fails)
import fastapi  # noqa: F401
import numpy as np
import pytest
import torch

from h3direct import __version__  # noqa: E402
from h3direct.app import bundled, cli, limits  # noqa: E402
from h3direct.app.cli_serve import service_of  # noqa: E402
from h3direct.app.serve import HTTPServer, bind  # noqa: E402

TIMEOUT = 60  # seconds, every socket and wait in this file
SMALL = {"width": 96, "height": 64, "frames": 22, "steps": 2}
TINY = {"width": 32, "height": 32, "frames": 5, "steps": 1}  # a valid request that costs ~0.3 s
BUNDLED = {"dit": "bundled", "video_vae": "bundled", "audio_vae": "bundled", "text_encoder": "bundled"}
VOLATILE = {"output", "timings", "peak_memory_bytes"}  # per-run values


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """An input folder with a real image, a garbage 'image', text embeddings, a garbage embeddings file and two
    symlinks that lead out of it; an output folder with a subfolder and a symlink that leads out."""
    from PIL import Image
    from safetensors.torch import save_file

    base = tmp_path_factory.mktemp("roots")
    inp, out, outside = base / "in", base / "out", base / "outside"
    for d in (inp, out, out / "sub", outside):
        d.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(inp / "ref.png")
    (inp / "garbage.png").write_bytes(b"this is not an image at all" * 10)
    save_file({"text_states": torch.randn(1, 7, 96, generator=torch.Generator().manual_seed(0)),
               "token_tags": torch.ones(7, dtype=torch.long)}, str(inp / "emb.safetensors"))
    save_file({"text_states": torch.randn(1, 7, 33), "token_tags": torch.ones(7, dtype=torch.long)},
              str(inp / "emb_wrong_width.safetensors"))
    (inp / "garbage.safetensors").write_bytes(b"\xff" * 64)
    (outside / "secret.png").write_bytes((inp / "ref.png").read_bytes())
    (inp / "escape.png").symlink_to(outside / "secret.png")
    (inp / "passwd.safetensors").symlink_to("/etc/passwd")
    (out / "escape").symlink_to(outside)
    return {"in": inp, "out": out, "outside": outside}


@pytest.fixture(scope="module")
def service(cache_env, roots):
    """The models, loaded once for the module, exactly as `h3direct serve` loads them."""
    args = cli.build_parser("serve").parse_args(["serve", "--port", "0", "--output-root", str(roots["out"]),
                                                 "--input-root", str(roots["in"]), "--quiet"])
    threads = torch.get_num_threads()
    svc = service_of(args)
    svc.prepare()
    svc.load()
    yield svc
    svc.stop()
    svc.close()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def server(service):
    http_server = HTTPServer(service, bind("127.0.0.1", 0)).start()
    yield http_server
    http_server.shutdown(wait=True)


def _call(srv, method: str, path: str, body=None, *, raw: bytes | None = None, headers=None):
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    try:
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        conn.request(method, path, body=data, headers=headers or ({"Content-Type": "application/json"} if data else {}))
        resp = conn.getresponse()
        blob = resp.read()
        ctype = resp.getheader("Content-Type", "")
        payload = json.loads(blob) if ctype.startswith("application/json") else blob
        return resp.status, dict(resp.getheaders()), payload
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


def _assert_ready(srv) -> dict:
    code, _, r = _call(srv, "GET", "/ready")
    assert code == 200 and r["status"] == "ready" and r["queue"]["running"] is None, r
    return r


def _sha(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _probe(path) -> dict:
    with av.open(str(path)) as c:
        v, a = c.streams.video[0], c.streams.audio[0]
        return {"frames": sum(1 for _ in c.decode(video=0)), "width": v.width, "height": v.height,
                "channels": a.channels, "rate": a.rate}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _wait_for(pred, what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


# ---- readiness and real generations -------------------------------------------------------------

def test_health_and_ready(server, service):
    assert _call(server, "GET", "/health")[:3:2] == (200, {"status": "ready"})
    r = _assert_ready(server)
    assert r["version"] == __version__ and r["device"] == "cpu"
    assert set(r["components"]) == set(BUNDLED)
    for name, comp in r["components"].items():
        assert comp["source"] == "bundled" and comp["device"] == "cpu" and comp["dtype"] == "float32", (name, comp)
        assert comp["quantization"] == "none" and comp["parameters"] > 0 and comp["bytes"] >= 4 * comp["parameters"]
        assert comp["sha256"] == _sha(getattr(bundled.ensure(), name)), name
    assert "sdpa" in r["attention"]["available"] and r["attention"]["default"] == "sdpa"
    assert set(r["attention"]["available"]) | set(r["attention"]["unavailable"]) >= {"sdpa", "sage2", "cudnn_sdpa"}
    assert r["memory"]["rss_bytes"] > 0 and r["memory"]["peak_bytes"] > 0
    # the weights held, computed from the files' headers (app/footprint.py), are what the loaded models hold
    assert r["memory"]["weights"] == {**{k: c["bytes"] for k, c in r["components"].items()},
                                      "total": sum(c["bytes"] for c in r["components"].values())}
    residency = r["text_encoder_residency"]
    assert (residency["policy"], residency["asked"], residency["where"], residency["loads"]) == (
        "resident", "auto", "device", 1)
    assert {k: r["limits"][k] for k in limits.Limits().as_dict()} == limits.Limits().as_dict()
    assert r["queue"]["depth"] == 0 and r["queue"]["size"] == 8 and r["weight_loads"] == 1
    code, _, schema = _call(server, "GET", "/openapi.json")
    assert code == 200 and {"/generate", "/jobs", "/jobs/{job_id}", "/ready"} <= set(schema["paths"])


def test_same_seed_same_clip_and_the_same_as_generate_cli(server, service, tmp_path, capsys):
    req = {**SMALL, "prompt": "waves at dusk", "seed": 5}
    runs = []
    for name, seed in (("a.mp4", 5), ("sub/b.mp4", 5), ("c.mp4", 6)):
        code, _, s = _call(server, "POST", "/generate", {**req, "seed": seed, "output": name})
        assert code == 200, s
        runs.append(s)
    a, b, c = runs
    assert Path(b["output"]) == service.output_root / "sub" / "b.mp4"
    assert _probe(a["output"]) == {"frames": 22, "width": 96, "height": 64, "channels": 2, "rate": 32000}
    assert _sha(a["output"]) == _sha(b["output"])
    assert {k: v for k, v in a.items() if k not in VOLATILE} == {k: v for k, v in b.items() if k not in VOLATILE}
    assert _sha(c["output"]) != _sha(a["output"])  # the seed reaches the sampler

    cli_out = tmp_path / "cli.mp4"
    argv = ["generate", "--prompt", req["prompt"], "--seed", "5", "--output", str(cli_out)]
    argv += [x for k in ("width", "height", "frames", "steps") for x in (f"--{k}", str(req[k]))]
    rc = cli.main(argv)
    stdout, err = capsys.readouterr()
    assert rc == 0, err
    ref = json.loads(stdout)
    assert _sha(cli_out) == _sha(a["output"])  # same pixels, same audio, same provenance tag
    assert set(ref) == set(a)
    assert {k: v for k, v in ref.items() if k not in VOLATILE} == {k: v for k, v in a.items() if k not in VOLATILE}
    stages = {"conditioning", "text_encode", "sample", "decode_video", "decode_audio", "write", "total"}
    assert stages <= set(ref["timings"]) & set(a["timings"])
    assert "queue" in a["timings"]
    assert not [p for p in service.output_root.rglob(".*")]  # no temp file left


def test_provenance_in_summary_and_mp4(server, service, roots):
    body = {**TINY, "prompt": "<Picture 1> a kite", "seed": 11, "ref_images": ["ref.png"], "output": "prov.mp4"}
    code, _, s = _call(server, "POST", "/generate", body)
    assert code == 200, s
    with av.open(s["output"]) as c:
        tag = json.loads(c.metadata["comment"])
    assert tag == s["provenance"]
    b = bundled.ensure()
    want_weights = {k: {"file": getattr(b, k).name, "sha256": _sha(getattr(b, k))}
                    for k in ("dit", "video_vae", "audio_vae", "text_encoder")}
    assert tag["weights"] == want_weights
    assert tag["references"] == [{"field": "ref_images", "name": "ref.png", "sha256": _sha(roots["in"] / "ref.png")}]
    assert (tag["prompt"], tag["seed"], tag["steps"], tag["sampler"], tag["attention"], tag["h3direct"]) == (
        body["prompt"], 11, 1, "euler", "sdpa", __version__)


def _uploads_left(service) -> list:
    return [] if service._uploads is None else _files(service._uploads)


def test_uploaded_reference_is_used_and_removed_after_the_job(server, service, roots):
    png = (roots["in"] / "ref.png").read_bytes()
    up = {"filename": "../../my cat.png", "base64": base64.b64encode(png).decode()}
    code, _, s = _call(server, "POST", "/generate", {**TINY, "prompt": "<Picture 1>", "ref_images": [up]})
    assert code == 200, s
    assert s["task"] == "ref2va"
    ref = s["provenance"]["references"][0]
    assert ref["name"].endswith("my_cat.png") and "/" not in ref["name"]
    assert ref["sha256"] == hashlib.sha256(png).hexdigest()
    assert _uploads_left(service) == []  # deleted with its job


def test_text_embeds_from_the_input_root(server):
    code, _, s = _call(server, "POST", "/generate", {**TINY, "text_embeds": "emb.safetensors"})
    assert code == 200, s
    assert s["provenance"]["references"][0]["name"] == "emb.safetensors"


# ---- bad requests: answered at the door ---------------------------------------------------------

BIG = 16384
BAD = [  # (id, json body or raw bytes, status, words the one-line error must contain)
    ("invalid_json", b'{"prompt": ', 400, "JSON"),
    ("not_utf8", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("nested_deep", b"[" * 100_000, 400, "JSON"),
    ("integer_5000_digits", b'{"seed": ' + b"9" * 5000 + b"}", 400, "JSON"),
    ("empty_body", b"", 422, "body"),
    ("lone_surrogate", b'{"prompt": "\\udcff"}', 422, "prompt"),
    ("not_an_object", b"[1, 2]", 422, "object"),
    ("nan", b'{"cfg": NaN}', 422, "cfg"),
    ("infinity", b'{"cfg": Infinity}', 422, "cfg"),
    ("string_for_int", {"width": "96"}, 422, "width"),
    ("bool_for_int", {"steps": True}, 422, "steps"),
    ("float_for_int", {"frames": 22.0}, 422, "frames"),
    ("string_for_list", {"ref_images": "a.png"}, 422, "ref_images"),
    ("int_in_list", {"ref_images": [1]}, 422, "ref_images[0]"),
    ("unknown_field", {"promt": "x"}, 422, "promt"),
    ("unknown_sampler", {"sampler": "ddim"}, 422, "ddim"),
    ("unknown_attention", {"attention": "flash9000"}, 422, "flash9000"),
    ("bad_choice", {"ref_image_size": "huge"}, 422, "ref_image_size"),
    ("frames_too_few", {"frames": 4}, 400, "frames"),
    ("width_not_multiple_of_32", {"width": 100}, 400, "width"),
    ("height_zero", {"height": 0}, 400, "height"),
    ("steps_zero", {"steps": 0}, 400, "steps"),
    ("seed_negative", {"seed": -1}, 400, "seed"),
    ("seed_huge", {"seed": 2**70}, 400, "seed"),
    ("cfg_zero", {"cfg": 0}, 400, "cfg"),
    ("cache_window_reversed", {"cache_mode": "easycache", "cache_start_percent": 0.9, "cache_end_percent": 0.1},
     400, "cache_*: cache start_percent"),
    # abusive: each would hold the worker for hours or allocate far beyond any device
    ("steps_a_billion", {"steps": 1_000_000_000}, 400, "--max-steps"),
    ("frames_3601", {"frames": 3601}, 400, "frames"),
    ("canvas_huge", {"width": BIG, "height": BIG, "frames": 3600}, 400, "frames"),
    ("pixels_times_frames", {"width": BIG, "height": BIG, "frames": 22}, 400, "--max-pixel-frames"),
    ("prompt_a_megabyte", {"prompt": "x" * 1_000_000}, 400, "--max-prompt-chars"),
    ("references_too_many", {"ref_images": ["ref.png"] * 7, "ref_audios": ["ref.png"] * 3}, 400, "--max-references"),
    # files: only under --input-root; missing and not-allowed answer alike
    ("ref_absolute", {"ref_images": ["/etc/shadow"]}, 400, "no such file under the input folder"),
    ("ref_parent", {"ref_images": ["../outside/secret.png"]}, 400, "no such file under the input folder"),
    ("ref_missing", {"ref_images": ["nope.png"]}, 400, "no such file under the input folder"),
    ("ref_symlink_escape", {"ref_images": ["escape.png"]}, 400, "no such file under the input folder"),
    ("ref_not_an_image", {"ref_images": ["garbage.png"]}, 400, "not a readable image"),
    ("ref_video_not_a_video", {"ref_videos": ["garbage.png"]}, 400, "not a readable video"),
    ("upload_not_base64", {"ref_images": [{"filename": "a.png", "base64": "@@not base64@@"}]}, 400, "base64"),
    ("upload_empty", {"ref_images": [{"filename": "a.png", "base64": ""}]}, 400, "empty"),
    ("upload_not_an_image", {"ref_images": [{"filename": "a.png", "base64": base64.b64encode(b"junk" * 9).decode()}]},
     400, "upload:00-a.png: ref_images: not a readable image"),
    ("upload_garbage_embeds", {"text_embeds": {"base64": base64.b64encode(b"\xff" * 64).decode()}}, 400,
     "safetensors"),
    ("upload_unknown_key", {"ref_images": [{"name": "a.png"}]}, 422, "ref_images[0]"),
    ("first_frame_absolute", {"first_frame": "/etc/passwd"}, 400, "no such file under the input folder"),
    ("embeds_proc", {"text_embeds": "/proc/self/mem"}, 400, "no such file under the input folder"),
    ("embeds_symlink_passwd", {"text_embeds": "passwd.safetensors"}, 400, "no such file under the input folder"),
    ("embeds_garbage", {"text_embeds": "garbage.safetensors"}, 400, "safetensors"),
    ("embeds_image", {"text_embeds": "ref.png"}, 400, "safetensors"),
    ("embeds_wrong_width", {"text_embeds": "emb_wrong_width.safetensors"}, 400, "width 33"),
    # output: a relative .mp4 path inside --output-root
    ("output_parent", {"output": "../escape.mp4"}, 400, "output"),
    ("output_absolute", {"output": "{outside}/escape.mp4"}, 400, "output"),
    ("output_symlink_escape", {"output": "escape/x.mp4"}, 400, "output"),
    ("output_missing_folder", {"output": "nosuch/x.mp4"}, 400, "output"),
    ("output_backslash", {"output": "..\\escape.mp4"}, 400, "output"),
    ("output_dotdot", {"output": ".."}, 400, "output"),
    ("output_hidden", {"output": ".x.mp4"}, 400, "output"),
    ("output_not_mp4", {"output": "clip.avi"}, 400, "output"),
    ("output_a_folder", {"output": "sub"}, 400, "output"),
    ("output_name_too_long", {"output": "a" * 5000 + ".mp4"}, 400, "output"),
    ("output_component_too_long", {"output": "sub/" + "a" * 300 + ".mp4"}, 400, "output"),
    ("ref_name_too_long", {"ref_images": ["a" * 5000]}, 400, "ref_images[0]"),
    # options: per-request ones are fields (checked by their own rules), the ones fixed at load are not
    ("option_bad_value", {"sol_tau": -1.0}, 400, "sol_tau -1.0 must be a positive number"),
    ("option_bad_type", {"fused": "yes"}, 422, "fused"),
    ("option_fixed_at_load", {"fp8_linear": "stream"}, 422, "fp8_linear"),
    ("option_unknown_backend_of_slices", {"attention": "kj_head_sliced", "head_slice_backend": "nope"}, 400,
     "head_slice_backend 'nope' is not a usable inner backend"),
    ("prompt_file_missing", {"prompt_file": "nope.txt"}, 400, "prompt_file 'nope.txt'"),
    ("prompt_and_prompt_file", {"prompt": "x", "prompt_file": "ref.png"}, 400, "prompt/prompt_file"),
]


@pytest.mark.parametrize("body,status,needle", [pytest.param(b, s, n, id=i) for i, b, s, n in BAD])
def test_bad_request_is_4xx_at_once_and_the_server_keeps_serving(server, service, roots, body, status, needle):
    before = {k: _files(roots[k]) for k in ("out", "outside")}
    raw = body if isinstance(body, bytes) else None
    if raw is None:
        body = {k: (v.replace("{outside}", str(roots["outside"])) if isinstance(v, str) else v)
                for k, v in body.items()}
        body = {**TINY, **body}  # valid apart from the one bad field: were it not checked, a clip would be made
    t = time.perf_counter()
    got = _call(server, "POST", "/generate", None if raw else body, raw=raw)
    elapsed = time.perf_counter() - t
    msg = _assert_error(got, status, needle)
    # a request is told its field names, never `h3direct generate`'s flags; only server flags may appear
    assert all(f.startswith("--max-") or f == "--text-encoder" for f in re.findall(r"--[\w*-]+", msg)), msg
    assert elapsed < 1.0, f"{elapsed:.2f} s to refuse"
    assert str(roots["in"]) not in msg  # the server's own folders stay out of its answers
    assert {k: _files(roots[k]) for k in ("out", "outside")} == before  # nothing written anywhere
    assert _uploads_left(service) == []
    _assert_ready(server)


def test_http_statuses(server, service):
    limit = service.max_body_bytes
    _assert_error(_call(server, "GET", "/nope"), 404, "/nope")
    _assert_error(_call(server, "GET", "/generate"), 405)
    _assert_error(_call(server, "DELETE", "/ready"), 405)
    _assert_error(_call(server, "GET", "/jobs/nope"), 404, "nope")
    _assert_error(_call(server, "DELETE", "/jobs/nope"), 404, "nope")
    _assert_error(_call(server, "GET", "/jobs/nope/output"), 404, "nope")
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    for length, status in ((str(limit + 1), 413), ("12x", 400)):
        conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
        conn.putrequest("POST", "/generate")
        conn.putheader("Content-Length", length)
        conn.endheaders()  # no body sent: the server must answer from the headers alone
        resp = conn.getresponse()
        blob = resp.read()
        assert resp.status == status, blob
        if status == 413:  # (a malformed header is refused by the HTTP layer itself, in plain text)
            _assert_error((resp.status, dict(resp.getheaders()), json.loads(blob)), status)
        conn.close()
    # a streamed (chunked) body over the limit
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT)
    conn.request("POST", "/generate", body=iter([b'{"prompt": "', b"x" * limit, b'"}']),
                 headers={"Content-Type": "application/json"}, encode_chunked=True)
    resp = conn.getresponse()
    _assert_error((resp.status, dict(resp.getheaders()), json.loads(resp.read())), 413)
    conn.close()
    _assert_ready(server)


# ---- the interactive docs, offline --------------------------------------------------------------

# what each Swagger UI file the docs page loads must be: its content type, and bytes that only such a file holds
# (the global the page calls, the stylesheet's root class, the PNG signature)
DOCS_ASSETS = {".js": ("javascript", b"SwaggerUIBundle"), ".css": ("text/css", b".swagger-ui"),
               ".png": ("image/png", b"\x89PNG\r\n\x1a\n")}


def _docs_assets(html: bytes) -> list[str]:
    """The URLs of the files a docs page loads (its scripts, stylesheets, icon)."""
    return re.findall(r'(?:src|href)="([^"]+)"', html.decode())


def test_docs_work_offline(server):
    """/docs loads Swagger UI from this server, not from a CDN: the page names no http(s) URL, and each file it
    loads answers 200 with its type and content; ReDoc (CDN-only in FastAPI) is off."""
    code, headers, html = _call(server, "GET", "/docs")
    assert code == 200 and headers["content-type"].startswith("text/html"), html
    assert not re.findall(rb"https?://", html), html
    assets = _docs_assets(html)
    assert sorted(Path(a).suffix for a in assets) == sorted(DOCS_ASSETS), assets
    for url in assets:
        code, headers, blob = _call(server, "GET", url)
        ctype, marker = DOCS_ASSETS[Path(url).suffix]
        assert code == 200 and ctype in headers["content-type"], (url, code, headers)
        assert (blob.startswith(marker) if ctype.startswith("image/") else marker in blob), url
    assert "url: '/openapi.json'" in html.decode() and _call(server, "GET", "/openapi.json")[0] == 200
    _assert_error(_call(server, "GET", "/redoc"), 404, "/redoc")
    _assert_error(_call(server, "GET", "/docs/assets/nope.js"), 404, "nope.js")


# ---- failures, attention, jobs, cancel, queue ----------------------------------------------------

def test_failing_job_answers_its_error_and_the_service_stays_ready(server, service, monkeypatch, capsys):
    from h3direct.errors import H3Error

    def boom(*a, **k):
        raise RuntimeError("kaboom\n  second line of a bug")

    monkeypatch.setattr(service.pipe, "generate", boom)
    msg = _assert_error(_call(server, "POST", "/generate", TINY), 500, "kaboom")
    assert "second line" in msg  # folded into the one line
    assert "Traceback" in capsys.readouterr().err

    def bad_file(*a, **k):
        raise H3Error("cannot decode video (InvalidDataError)", path="x.mp4")

    monkeypatch.setattr(service.pipe, "generate", bad_file)
    _assert_error(_call(server, "POST", "/generate", TINY), 400, "cannot decode video")
    monkeypatch.undo()
    _assert_ready(server)
    code, _, s = _call(server, "POST", "/generate", TINY)
    assert code == 200, s


def test_switching_attention_never_reloads_weights(server, service, monkeypatch):
    from h3direct.dit import loader as dit_loader
    from h3direct.vae import loader as vae_loader

    loads = []
    text_loads = service.pipe.text.loads  # the text encoder's loads (its slot builds it from the file)
    for mod, name in ((dit_loader, "load_dit"), (vae_loader, "load_video_vae"), (vae_loader, "load_audio_vae")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _n=name, **k: (loads.append(_n), _real(*a, **k))[1])
    available = _call(server, "GET", "/ready")[2]["attention"]["available"]
    for backend in [*available, None, *available]:
        body = {**TINY} if backend is None else {**TINY, "attention": backend}
        code, _, s = _call(server, "POST", "/generate", body)
        assert code == 200 and s["attention"] == (backend or "sdpa"), s
    assert loads == [] and _assert_ready(server)["weight_loads"] == 1 and service.pipe.text.loads == text_loads


def _events(srv, job_id: str) -> list[tuple[str, dict]]:
    code, headers, blob = _call(srv, "GET", f"/jobs/{job_id}/events")
    assert code == 200 and headers["content-type"].startswith("text/event-stream")
    out = []
    for block in blob.decode().strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_job_lifecycle_progress_events_and_output(server, service, tmp_path):
    code, headers, job = _call(server, "POST", "/jobs", {**SMALL, "steps": 3, "output": "job.mp4"})
    assert code == 202 and job["state"] in ("queued", "running") and headers["location"] == f"/jobs/{job['id']}"
    events = _events(server, job["id"])
    kinds = [k for k, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) <= {"progress"}, kinds
    progress = [e["progress"] for _, e in events]
    assert progress == sorted(progress) and progress[-1] == 1.0
    code, _, st = _call(server, "GET", f"/jobs/{job['id']}")
    assert code == 200 and st["state"] == "done" and st["step"] == 3 and st["summary"]["steps"] == 3
    assert {"queue", "sample", "write", "total"} <= set(st["timings"])
    listed = _call(server, "GET", "/jobs?limit=5")[2]["jobs"]
    assert listed[0]["id"] == job["id"] and len(listed) <= 5
    _assert_error(_call(server, "GET", "/jobs?limit=many"), 422, "limit")
    code, headers, blob = _call(server, "GET", f"/jobs/{job['id']}/output")
    assert code == 200 and headers["content-type"] == "video/mp4"
    assert blob == (service.output_root / "job.mp4").read_bytes()
    (tmp_path / "got.mp4").write_bytes(blob)
    assert _probe(tmp_path / "got.mp4")["frames"] == 22


class _Held:
    """Wraps pipe.generate: each call waits at `gate` after its first sampler step (so a job is running and
    between steps); counts calls."""

    def __init__(self, real):
        self.real, self.gate, self.entered, self.calls = real, threading.Event(), threading.Event(), 0

    def __call__(self, *a, callback=None, **k):
        self.calls += 1

        def cb(ev):
            callback(ev)
            self.entered.set()
            assert self.gate.wait(TIMEOUT)

        return self.real(*a, callback=cb, **k)


def test_cancel_a_running_job_between_steps(server, service, monkeypatch):
    held = _Held(service.pipe.generate)
    monkeypatch.setattr(service.pipe, "generate", held)
    code, _, job = _call(server, "POST", "/jobs", {**TINY, "steps": 4, "output": "cancelled.mp4"})
    assert code == 202
    assert held.entered.wait(TIMEOUT)
    code, _, st = _call(server, "DELETE", f"/jobs/{job['id']}")
    assert code == 200 and st["cancel_requested"] is True
    held.gate.set()
    _wait_for(lambda: _call(server, "GET", f"/jobs/{job['id']}")[2]["state"] != "running", "the cancel")
    st = _call(server, "GET", f"/jobs/{job['id']}")[2]
    assert st["state"] == "cancelled" and st["step"] == 1 and "cancelled" in st["error"], st
    assert not (service.output_root / "cancelled.mp4").exists()
    assert not [p for p in service.output_root.rglob(".*")]
    _assert_error(_call(server, "GET", f"/jobs/{job['id']}/output"), 409, "cancelled")
    _assert_ready(server)


@pytest.mark.parametrize("size", [0, 2], ids=["no-queue", "queue-of-2"])
def test_full_queue_is_429_and_a_queued_job_can_be_dropped(server, service, monkeypatch, size):
    held = _Held(service.pipe.generate)
    monkeypatch.setattr(service.pipe, "generate", held)
    monkeypatch.setattr(service.queue, "size", size)
    code, _, running = _call(server, "POST", "/jobs", TINY)  # an idle worker takes it, even with no queue
    assert code == 202 and held.entered.wait(TIMEOUT)
    queued = []
    for _ in range(size):
        code, _, job = _call(server, "POST", "/jobs", TINY)
        assert code == 202 and job["state"] == "queued"
        queued.append(job)
    got = _call(server, "POST", "/jobs", TINY)
    _assert_error(got, 429, "queue is full")
    assert int(got[1]["retry-after"]) >= 1
    _assert_error(_call(server, "POST", "/generate", TINY), 429)
    assert _call(server, "GET", "/ready")[2]["queue"]["depth"] == size
    for job in queued:
        assert _call(server, "DELETE", f"/jobs/{job['id']}")[2]["state"] == "cancelled"  # dropped at once
    held.gate.set()
    _wait_for(lambda: _call(server, "GET", f"/jobs/{running['id']}")[2]["state"] == "done", "the running job")
    assert held.calls == 1  # the dropped jobs never reached the pipeline
    _assert_ready(server)


def test_a_client_that_leaves_drops_its_queued_job(server, service, monkeypatch):
    held = _Held(service.pipe.generate)
    monkeypatch.setattr(service.pipe, "generate", held)
    code, _, running = _call(server, "POST", "/jobs", TINY)
    assert code == 202 and held.entered.wait(TIMEOUT)
    before = set(service.queue.jobs)
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({**TINY, "output": "left.mp4"}).encode()
    with socket.create_connection((host, int(port)), timeout=TIMEOUT) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        _wait_for(lambda: service.queue.depth() == 1, "the request to queue")
    left = service.queue.jobs[(set(service.queue.jobs) - before).pop()]
    _wait_for(lambda: left.state == "cancelled", "the dropped job")
    assert "disconnected" in left.error
    held.gate.set()
    _wait_for(lambda: _call(server, "GET", f"/jobs/{running['id']}")[2]["state"] == "done", "the running job")
    assert held.calls == 1 and not (service.output_root / "left.mp4").exists()


def test_job_timeout_is_504_and_the_service_stays_ready(server, service, monkeypatch):
    monkeypatch.setattr(service.queue, "timeout_s", 1e-9)
    _assert_error(_call(server, "POST", "/generate", {**TINY, "output": "late.mp4"}), 504, "--job-timeout")
    assert not (service.output_root / "late.mp4").exists()
    monkeypatch.undo()
    _assert_ready(server)


# ---- outputs: never replaced unasked ------------------------------------------------------------

@pytest.mark.parametrize("field,name", [("output", "kept.mp4"), ("save_latent", "kept.safetensors")])
def test_an_existing_output_is_409_at_the_door_unless_overwrite(server, service, monkeypatch, field, name):
    earlier = b"an earlier result"
    target = service.output_root / name
    target.write_bytes(earlier)
    held = _Held(service.pipe.generate)
    held.gate.set()  # counts the generations, holds none
    monkeypatch.setattr(service.pipe, "generate", held)
    jobs = set(service.queue.jobs)
    for route in ("/generate", "/jobs"):
        msg = _assert_error(_call(server, "POST", route, {**TINY, field: name}), 409, f"{field} {name!r}")
        assert "overwrite" in msg and str(service.output_root) not in msg, msg
    assert held.calls == 0 and set(service.queue.jobs) == jobs  # refused before the queue, before any compute
    assert target.read_bytes() == earlier
    code, _, s = _call(server, "POST", "/generate", {**TINY, field: name, "overwrite": True})
    assert code == 200 and held.calls == 1, s
    assert target.read_bytes() != earlier
    assert not [p for p in service.output_root.rglob(".*")]
    _assert_ready(server)


def test_two_jobs_never_write_one_file(server, service, monkeypatch):
    """A queued or running job's output and latents are its own until it is over (the second request gets 409,
    overwrite or not); once it is done the file exists, and the same name needs overwrite."""
    held = _Held(service.pipe.generate)
    monkeypatch.setattr(service.pipe, "generate", held)
    code, _, running = _call(server, "POST", "/jobs", {**TINY, "output": "one.mp4", "save_latent": "one.safetensors"})
    assert code == 202 and held.entered.wait(TIMEOUT)
    code, _, queued = _call(server, "POST", "/jobs", {**TINY, "output": "two.mp4"})
    assert code == 202 and queued["state"] == "queued", queued
    clashes = [({"output": "one.mp4"}, "output 'one.mp4'", running),
               ({"output": "other.mp4", "save_latent": "one.safetensors"}, "save_latent 'one.safetensors'", running),
               ({"output": "two.mp4"}, "output 'two.mp4'", queued)]
    for clash, needle, owner in clashes:
        for extra in ({}, {"overwrite": True}):
            for route in ("/jobs", "/generate"):
                msg = _assert_error(_call(server, "POST", route, {**TINY, **clash, **extra}), 409, needle)
                assert owner["id"] in msg, msg
    assert _call(server, "GET", "/ready")[2]["queue"]["depth"] == 1  # none of them was queued
    held.gate.set()
    for job in (running, queued):
        _wait_for(lambda job=job: _call(server, "GET", f"/jobs/{job['id']}")[2]["state"] == "done", "the jobs")
    assert held.calls == 2
    _assert_error(_call(server, "POST", "/jobs", {**TINY, "output": "one.mp4"}), 409, "output 'one.mp4'")
    code, _, s = _call(server, "POST", "/generate", {**TINY, "output": "one.mp4", "overwrite": True})
    assert code == 200, s
    _assert_ready(server)


def test_a_failed_job_leaves_nothing_that_blocks_its_retry(server, service, monkeypatch):
    """The mp4 fails after the latents were written: neither file stays under its name, so the same request
    succeeds when tried again."""
    from h3direct.errors import H3Error
    from h3direct.vae import mp4

    def broken(self, audio=None):
        raise H3Error("the mp4 encoder failed: OSError: no space left on device", path=self.path.name)

    monkeypatch.setattr(mp4.Mp4Stream, "finish", broken)
    body = {**TINY, "output": "retry.mp4", "save_latent": "retry.safetensors"}
    _assert_error(_call(server, "POST", "/generate", body), 400, "no space left")
    assert not (service.output_root / "retry.mp4").exists()
    assert not (service.output_root / "retry.safetensors").exists()
    assert not [p for p in service.output_root.rglob(".*")]
    monkeypatch.undo()
    code, _, s = _call(server, "POST", "/generate", body)
    assert code == 200, s
    assert (service.output_root / "retry.mp4").is_file() and (service.output_root / "retry.safetensors").is_file()


# ---- many clients at once -----------------------------------------------------------------------

def test_mixed_requests_from_8_threads(server, service):
    """>= 200 requests, a third valid: no answer >= 500, every invalid one 4xx, every valid one a readable mp4."""
    bad = [b for _, b, _, _ in BAD if not isinstance(b, bytes) and "{outside}" not in str(b)]
    raw = [b for _, b, _, _ in BAD if isinstance(b, bytes)]
    reqs = []
    for i in range(216):
        if i % 3 == 0:
            reqs.append(("valid", {**TINY, "seed": i, "output": f"stress/{i}.mp4"}))
        elif i % 3 == 1:
            reqs.append(("invalid", {**TINY, **bad[i % len(bad)]}))
        else:
            reqs.append(("invalid", raw[i % len(raw)]))
    (service.output_root / "stress").mkdir()

    def one(item):
        kind, body = item
        path = "/jobs" if kind == "invalid" and hash(str(body)) % 2 else "/generate"
        return kind, body, _call(server, "POST", path, None if isinstance(body, bytes) else body,
                                 raw=body if isinstance(body, bytes) else None)

    t = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, reqs))
    elapsed = time.perf_counter() - t
    codes = [r[2][0] for r in results]
    assert max(codes) < 500, [r for r in results if r[2][0] >= 500][:3]
    for kind, body, (code, _, payload) in results:
        if kind == "invalid":
            assert 400 <= code < 500, (body, code, payload)
        else:
            assert code == 200, (body, payload)
            assert _probe(payload["output"])["frames"] == 5
    assert sum(k == "valid" for k, _ in reqs) == 72
    assert not [p for p in service.output_root.rglob(".*")]
    print(f"{len(reqs)} requests in {elapsed:.1f} s")
    _assert_ready(server)


# ---- per-request options and counts -------------------------------------------------------------

def test_ready_lists_the_options_a_request_may_set(server):
    r = _assert_ready(server)
    per_request, fixed = set(r["options"]["per_request"]), set(r["options"]["fixed_at_load"])
    assert {"attention", "sol_tau", "fp8_attn_smooth_v", "head_slice_size", "fused", "mlp_chunks"} <= per_request
    assert fixed == {"nvfp4_dequant", "fp8_linear", "fp8_accum", "fp8_linear_layers", "fp8_linear_format",
                     "fp8_linear_rotate", "fp8_strict"} and not per_request & fixed
    assert r["options"]["defaults"]["attention"] == r["attention"]["default"] == "sdpa"
    assert r["auth"] == "none"
    schema = _call(server, "GET", "/openapi.json")[2]["components"]["schemas"]["GenerateRequest"]["properties"]
    assert per_request <= set(schema) and not fixed & set(schema)
    assert schema["sampler"]["enum"] == ["euler", "heun", "dpmpp_2m"]  # documented; checked by the request


def test_two_jobs_count_their_own_calls(server, service, monkeypatch):
    """Each job's summary counts the attention calls of that job only (the counts belong to the generation, not to
    the process): two jobs of 1 and 3 steps, through one server, over a real socket."""
    from h3direct.counts import count_attention
    from h3direct.dit import attention as A

    def counted(q, k, v):
        count_attention("counted", "kernel")
        return A._sdpa(q, k, v)

    monkeypatch.setitem(A._REGISTRY, "counted", A.Backend("counted", counted, A._always, exact=False))
    c = service.pipe.dit.config
    before = _assert_ready(server)["attention"]["calls"].get("counted", {}).get("kernel", 0)
    jobs = []
    for steps in (1, 3):
        code, _, job = _call(server, "POST", "/jobs", {**TINY, "steps": steps, "attention": "counted"})
        assert code == 202, job
        jobs.append((steps, job["id"]))
    for steps, job_id in jobs:
        _wait_for(lambda job_id=job_id: _call(server, "GET", f"/jobs/{job_id}")[2]["state"] == "done", "the job")
        summary = _call(server, "GET", f"/jobs/{job_id}")[2]["summary"]
        want = c.token_refiner_num_layers + c.num_layers * steps  # one text refine, the blocks of every step
        assert summary["attention_calls"] == {"counted": {"kernel": want}}, (steps, summary["attention_calls"])
    total = _assert_ready(server)["attention"]["calls"]["counted"]["kernel"]
    assert total - before == 2 * c.token_refiner_num_layers + 4 * c.num_layers
    code, _, plain = _call(server, "POST", "/generate", TINY)  # sdpa counts nothing: none reported
    assert code == 200 and "attention_calls" not in plain


def test_per_request_options_are_arguments_of_that_generation(server, service):
    """A request's options change its own clip and nothing of the service: its provenance records them, the next
    request runs the server's defaults again."""
    code, _, a = _call(server, "POST", "/generate", {**TINY, "mlp_chunks": 2, "fused": False,
                                                     "head_slice_size": 2})
    assert code == 200, a
    opts = a["provenance"]["options"]
    assert (opts["mlp_chunks"], opts["fused"], opts["head_slice_size"]) == (2, False, 2)
    code, _, b = _call(server, "POST", "/generate", TINY)
    assert code == 200 and b["provenance"]["options"] == service.options.flat()
    assert b["provenance"]["options"]["mlp_chunks"] == 1


# ---- the command --------------------------------------------------------------------------------

def _start_command(cache_env, cwd, *extra):
    env = {**os.environ, "H3_CACHE_DIR": str(cache_env), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "h3direct", "serve", "--port", "0", "--output-root", "out",
                             "--quiet", "--max-steps", "1000000", *extra], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = json.loads(proc.stdout.readline() or "{}")
    assert set(start) == {"url", "device", "models"} and start["models"] == BUNDLED, proc.stderr.read()

    class Remote:
        url = start["url"]

    return proc, Remote


LONG = {"width": 32, "height": 32, "frames": 5, "steps": 100_000, "output": "never.mp4"}  # hours, if not stopped


def test_command_sigterm_during_a_job_exits_0_quickly(cache_env, tmp_path):
    proc, remote = _start_command(cache_env, tmp_path)
    watchdog = threading.Timer(120, proc.kill)
    watchdog.start()
    try:
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("a", _call(remote, "POST", "/generate", LONG)))
        t.start()
        _wait_for(lambda: (_call(remote, "GET", "/ready")[2]["queue"]["running"] is not None), "the job to run")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:  # while it drains, readiness says so (the socket may also be closed already)
            code, _, r = _call(remote, "GET", "/ready")
            assert (code, r["status"]) == (503, "stopping")
        except (ConnectionError, http.client.HTTPException):
            pass
        t.join(TIMEOUT)
        rc = proc.wait(TIMEOUT)
        took = time.monotonic() - t0
        err = proc.stderr.read()
        assert rc == 0 and took < 10, (rc, took, err)
        assert "SIGTERM" in err and "Traceback" not in err and "terminate called" not in err, err
        _assert_error(results["a"], 503, "shutting down")
        assert _files(tmp_path / "out") == []  # no output, no temp file
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)


def test_command_second_signal_exits_at_once(cache_env, tmp_path, monkeypatch):
    proc, remote = _start_command(cache_env, tmp_path, "--job-timeout", "1000")
    try:
        code, _, job = _call(remote, "POST", "/jobs", LONG)
        assert code == 202
        _wait_for(lambda: _call(remote, "GET", f"/jobs/{job['id']}")[2]["state"] == "running", "the job to run")
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(10)
        err = proc.stderr.read()
        assert rc in (0, 1) and "terminate called" not in err and "Traceback" not in err, (rc, err)
        assert not [p for p in (tmp_path / "out").rglob("*") if p.name.startswith(".")]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)


def test_fp8_linear_is_a_server_flag_reported_by_ready(cache_env, roots, capsys):
    # the FP8 block linears are chosen when the weights load, so they are a server flag (a request field would
    # be a reload): the same flag, choices and bare form as `h3direct generate`, and /ready says which mode runs
    parse = cli.build_parser("serve").parse_args
    base = ["serve", "--port", "0", "--output-root", str(roots["out"]), "--quiet"]
    assert parse(base + ["--fp8-linear"]).fp8_linear == "stream"
    assert parse(base).fp8_linear is None and service_of(parse(base)).options.kernels.fp8_linear == "off"
    assert cli.main(base + ["--fp8-linear", "bogus"]) == 2  # refused before the socket is bound
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--fp8-linear 'bogus'" in err, err
    threads = torch.get_num_threads()
    svc = service_of(parse(base + ["--fp8-linear", "resident"]))
    try:
        svc.prepare()
        svc.load()
        dit = svc.ready()["components"]["dit"]
        assert dit["fp8_linear"]["mode"] == "resident"
        assert svc.pipe.dit.blocks[0].mlp.fc1.__class__.__name__ == "FP8Linear"
    finally:
        svc.stop()
        svc.close()
        torch.set_num_threads(threads)


# ---- beyond this machine: a bearer token -------------------------------------------------------------

def test_binding_beyond_loopback_needs_a_token_or_insecure(tmp_path, capsys):
    out = ["--output-root", str(tmp_path / "out"), "--port", "0"]
    for host in ("0.0.0.0", "::", "192.0.2.7", "h3.example"):
        assert cli.main(["serve", "--host", host, *out]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--auth-token-file" in err and "--insecure" in err, err
    (tmp_path / "short").write_text("abc\n")
    assert cli.main(["serve", "--host", "0.0.0.0", "--auth-token-file", str(tmp_path / "short"), *out]) == 2
    assert "at least 16 characters" in capsys.readouterr().err
    parse = cli.build_parser("serve").parse_args
    assert service_of(parse(["serve", "--host", "0.0.0.0", "--insecure", *out])).token is None
    assert service_of(parse(["serve", "--host", "localhost", *out])).token is None


def test_token_over_a_real_socket(cache_env, tmp_path):
    """With a token every route but /health answers 401 without `Authorization: Bearer <token>` (or with a wrong
    one), and serves with it."""
    token = "s3cret-token-0123456789abcdef"
    (tmp_path / "token").write_text(token + "\n")
    proc, remote = _start_command(cache_env, tmp_path, "--host", "0.0.0.0", "--auth-token-file",
                                  str(tmp_path / "token"))
    remote.url = remote.url.replace("0.0.0.0", "127.0.0.1")
    good = {"Authorization": f"Bearer {token}"}
    try:
        assert _call(remote, "GET", "/health")[:3:2] == (200, {"status": "ready"})  # liveness needs no token
        for path, method, body in (("/ready", "GET", None), ("/jobs", "GET", None), ("/openapi.json", "GET", None),
                                   ("/generate", "POST", TINY), ("/jobs/x", "DELETE", None)):
            for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
                h = {"Content-Type": "application/json", **(headers or {})}
                code, hdrs, payload = _call(remote, method, path, body, headers=h)
                assert code == 401 and hdrs.get("www-authenticate", "").startswith("Bearer"), (path, headers, code)
                _assert_error((code, hdrs, payload), 401, "Bearer")
        code, _, r = _call(remote, "GET", "/ready", headers=good)
        assert code == 200 and r["auth"] == "bearer"
        # the docs page and the Swagger UI files it loads are routes like the others: the token, or 401
        code, _, html = _call(remote, "GET", "/docs", headers=good)
        assert code == 200 and _docs_assets(html), html
        for url in ["/docs", *_docs_assets(html)]:
            _assert_error(_call(remote, "GET", url), 401, "Bearer")
            assert _call(remote, "GET", url, headers=good)[0] == 200, url
        code, _, s = _call(remote, "POST", "/generate", TINY, headers={"Content-Type": "application/json", **good})
        assert code == 200 and s["frames"] == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
