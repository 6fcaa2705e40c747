"""Tiers for users (`h3direct/app/tiers.py`): a tiers file read as data, `generate --tier` (the tier's options, flags
over them, the provenance), the service's request field `tier` and `/ready`, `pytest -m parity --tier`; a bad,
foreign or missing file, an unknown tier and a tier that cannot run here are one line each, before any model loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from h3direct.app import cli, cli_generate, tiers
from h3direct.errors import ConfigError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TIERS = {"exact": {"options": {"attention": "sdpa"}, "rule": "exact", "bound": None, "s_per_step": 2.0},
         "chunked": {"options": {"attention": "sdpa", "mlp_chunks": 2}, "rule": "drift", "bound": 3.0,
                     "s_per_step": 1.5, "error_x_comfyui_sage": 1.9},
         "fp8": {"options": {"attention": "sdpa", "fp8_linear": "stream"}, "rule": "drift", "bound": 3.0},
         "gpu": {"options": {"attention": "fa3"}, "rule": "exact", "bound": None}}


def write(folder: Path, device_name: str = "cpu", entries: dict | None = None, **top) -> Path:
    path = folder / "tiers.json"
    path.write_text(json.dumps({"schema": tiers.SCHEMA, "machine": {"device_name": device_name},
                                "tiers": TIERS if entries is None else entries, **top}))
    return path


@pytest.mark.parametrize("content, words", [
    (None, "no tiers file at"),
    ("{not json", "not a tiers file (not JSON"),
    (json.dumps({"schema": "something/2"}), "not a tiers file (schema 'something/2'"),
    (json.dumps({"schema": tiers.SCHEMA, "machine": {}, "tiers": {"a": {}}}), "names no device_name"),
    (json.dumps({"schema": tiers.SCHEMA, "machine": {"device_name": "cpu"}, "tiers": {}}), "holds no tiers"),
    (json.dumps({"schema": tiers.SCHEMA, "machine": {"device_name": "cpu"},
                 "tiers": {"a": {"options": {}, "rule": "fast"}}}), "rule 'fast' is none of exact, class, drift"),
    (json.dumps({"schema": tiers.SCHEMA, "machine": {"device_name": "cpu"},
                 "tiers": {"a": {"options": {}, "rule": "class"}}}), "a class tier's bound is a number >= 1"),
    (json.dumps({"schema": tiers.SCHEMA, "machine": {"device_name": "cpu"},
                 "tiers": {"a": {"options": {"sol_taus": 1}, "rule": "drift"}}}), "tier 'a': sol_taus: not an option"),
    (json.dumps({"schema": tiers.SCHEMA, "machine": {"device_name": "cpu"},
                 "tiers": {"a": {"options": {"sol_tau": -1}, "rule": "drift"}}}), "tier 'a': "),
])
def test_a_bad_tiers_file_is_one_line(tmp_path, content, words):
    path = tmp_path / "tiers.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError) as e:
        tiers.load(path)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_file_chosen_on_another_device_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="chosen on NVIDIA H100 80GB HBM3, this device is cpu"):
        tiers.resolve("exact", write(tmp_path, "NVIDIA H100 80GB HBM3"), "cpu")
    with pytest.raises(ConfigError, match=r"--tier fastest: not a tier of .* \(its tiers: exact, chunked, fp8, gpu\)"):
        tiers.resolve("fastest", write(tmp_path), "cpu")


def _parse(argv, env=None):
    return cli_generate.parse(cli.build_parser("generate").parse_args(["generate", *argv]), env=env or {})


def test_a_tier_is_its_options_and_explicit_ones_win(tmp_path):
    path = write(tmp_path)
    job = _parse(["--tier", "chunked", "--tiers", str(path), "-o", str(tmp_path / "a.mp4")])
    assert job.options.kernels.mlp_chunks == 2 and job.options.attention.backend == "sdpa"
    assert job.options.tier == {"name": "chunked", "file": str(path.resolve()), "sha256": tiers.load(path).sha256,
                                "rule": "drift", "options": {"attention": "sdpa", "mlp_chunks": 2}}
    job = _parse(["--tier", "chunked", "--tiers", str(path), "--mlp-chunks", "3", "-o", str(tmp_path / "a.mp4")])
    assert job.options.kernels.mlp_chunks == 3 and job.options.tier["options"]["mlp_chunks"] == 2
    job = _parse(["--tier", "chunked", "-o", str(tmp_path / "a.mp4")], env={"H3_TIERS": str(path)})
    assert job.options.kernels.mlp_chunks == 2  # the file from $H3_TIERS
    job = _parse(["--tier", "chunked", "-o", str(tmp_path / "a.mp4")], env={"H3_MLP_CHUNKS": "4",
                                                                          "H3_TIERS": str(path)})
    assert job.options.kernels.mlp_chunks == 2  # (not a variable: nothing to override)
    assert _parse(["-o", str(tmp_path / "a.mp4")]).options.tier is None


@pytest.fixture
def no_models(monkeypatch):
    from h3direct.app import models, pipeline
    from h3direct.dit import loader

    def tripwire(*a, **k):
        raise AssertionError("a model was loaded for a bad tier")

    for mod, name in ((models, "load_pipeline"), (loader, "load_dit")):
        monkeypatch.setattr(mod, name, tripwire)
    monkeypatch.setattr(pipeline.H3Pipeline, "from_files", tripwire)


@pytest.mark.parametrize("argv, words", [
    (["--tier", "nope"], "--tier nope: not a tier of"),
    (["--tier", "gpu"], "attention 'fa3' cannot run"),
    (["--tier", "exact", "--tiers", "missing.json"], "no tiers file at missing.json"),
    (["--tiers", "TIERS"], "--tiers FILE: give --tier NAME too"),
])
def test_a_bad_tier_is_one_line_and_exit_2_before_anything_loads(tmp_path, no_models, capsys, monkeypatch, argv,
                                                                  words):
    monkeypatch.chdir(tmp_path)
    path = write(tmp_path)
    argv = [a.replace("TIERS", str(path)) for a in argv]
    if "--tiers" not in argv:
        argv += ["--tiers", str(path)]
    rc = cli.main(["generate", *argv, "-o", "x.mp4"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and words in err, err


def test_the_clip_records_its_tier(cache_env, tmp_path, capsys):
    path = write(tmp_path)
    assert cli.main(["generate", "--tier", "chunked", "--tiers", str(path), "-o", str(tmp_path / "t.mp4"),
                     "--steps", "1", "--frames", "5", "--width", "32", "--height", "32"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    prov = summary["provenance"]
    assert prov["tier"]["name"] == "chunked" and prov["options"]["mlp_chunks"] == 2


# ---- the service -----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(cache_env, tmp_path_factory):
    """`h3direct serve --tiers F` on the bundled models, over a real socket."""
    import torch

    from h3direct.app.cli_serve import service_of
    from h3direct.app.serve import HTTPServer, bind

    base = tmp_path_factory.mktemp("tiers_serve")
    path = write(base)
    args = cli.build_parser("serve").parse_args(["serve", "--port", "0", "--output-root", str(base / "out"),
                                                 "--tiers", str(path), "--quiet"])
    threads = torch.get_num_threads()
    svc = service_of(args)
    svc.prepare()
    svc.load()
    srv = HTTPServer(svc, bind("127.0.0.1", 0)).start()
    yield srv, svc
    srv.shutdown(wait=True)
    svc.stop()
    svc.close()
    torch.set_num_threads(threads)


def _call(srv, method, path, body=None):
    import http.client

    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"} if body is not None else {})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_ready_lists_the_tiers_with_what_they_measured(served):
    srv, _ = served
    code, r = _call(srv, "GET", "/ready")
    assert code == 200
    t = r["tiers"]["tiers"]
    assert set(t) == {"exact", "chunked", "fp8", "gpu"}
    assert t["chunked"]["s_per_step"] == 1.5 and t["chunked"]["error_x_comfyui_sage"] == 1.9
    assert t["chunked"]["servable"] is True and t["fp8"]["servable"] is False and "--fp8-linear stream" in t["fp8"]["why"]


def test_a_request_runs_its_tier_and_records_it(served):
    srv, _ = served
    body = {"width": 32, "height": 32, "frames": 5, "steps": 1, "tier": "chunked"}
    code, r = _call(srv, "POST", "/generate", body)
    assert code == 200, r
    assert r["provenance"]["tier"]["name"] == "chunked" and r["provenance"]["options"]["mlp_chunks"] == 2
    code, r = _call(srv, "POST", "/generate", {**body, "mlp_chunks": 3, "output": "again.mp4"})
    assert code == 200 and r["provenance"]["options"]["mlp_chunks"] == 3  # the request's own options win


@pytest.mark.parametrize("tier, words", [("nope", "tier 'nope': not a tier of"),
                                         ("fp8", "tier 'fp8': it needs the models loaded with --fp8-linear stream")])
def test_a_tier_the_server_cannot_run_is_400_at_the_door(served, tier, words):
    srv, svc = served
    depth = svc.queue.depth()
    code, r = _call(srv, "POST", "/jobs", {"width": 32, "height": 32, "frames": 5, "steps": 1, "tier": tier})
    assert code == 400 and words in r["error"], r
    assert svc.queue.depth() == depth


# ---- the gate ---------------------------------------------------------------------------------------------------------

def test_the_gate_runs_a_tier_under_its_rule(tmp_path):
    from tests.gate.test_gate_options import CASE, REPO, _pytest

    path = write(tmp_path)
    r = _pytest(["-m", "parity", "--trace-dir", str(FIXTURES), "--tier", "chunked", "--tiers", str(path),
                 "--baselines", str(tmp_path / "bl"), "-k", f"test_dit_layers and free and {CASE}",
                 str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:]
    # a flag the tier sets, given explicitly, is a conflict even at its default value (sdpa, e4m3)
    r = _pytest(["-m", "parity", "--attention", "sdpa", "--tier", "chunked", "--tiers", str(path),
                 str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 4 and "--tier chunked: the tier sets the options and the rule; not with --attention" \
        in r.stdout + r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert len((r.stdout + r.stderr).strip().splitlines()) == 1, r.stdout + r.stderr  # one line
    r = _pytest(["-m", "parity", "--tier", "chunked", "--tiers", str(path), "--fp8-linear-format", "e4m3",
                 str(REPO / "parity_tests")], tmp_path)  # an 8-bit companion too: the tier would silently drop it
    assert r.returncode == 4 and "not with --fp8-linear-format" in r.stdout + r.stderr, r.stdout[-2000:]
    (tmp_path / "h100").mkdir()
    r = _pytest(["-m", "parity", "--tier", "exact", "--tiers", str(write(tmp_path / "h100", "NVIDIA H100")),
                 str(REPO / "parity_tests")], tmp_path)
    assert r.returncode == 4 and "chosen on NVIDIA H100, this device is cpu" in r.stdout + r.stderr
