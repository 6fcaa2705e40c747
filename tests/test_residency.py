"""The text encoder's residency policy (`app/residency.py`): what `auto` chooses for a device (injected, never read
from this machine), generations bitwise the same under every policy on the bundled tiny models (the host/device move
emulated on the CPU by a stand-in that copies every tensor, and one that loses bits to show the comparison can fail),
the moves between two requests through the service and `/ready`, and the one-line errors."""

import http.client
import json

import pytest
import torch

from h3direct.app import cli, residency
from h3direct.app.residency import WORKING_MARGIN, Machine, choose
from h3direct.errors import ConfigError

GIB = 1 << 30
TINY = {"width": 32, "height": 32, "frames": 5, "steps": 1}


# ---- what auto chooses ----------------------------------------------------------------------------

@pytest.mark.parametrize("hot, machine, want", [
    pytest.param(100 * GIB, Machine("cpu"), "resident", id="cpu-always-resident"),
    pytest.param(100 * GIB - WORKING_MARGIN, Machine("cuda", 100 * GIB, True), "resident", id="fits-exactly"),
    pytest.param(100 * GIB - WORKING_MARGIN + 1, Machine("cuda", 100 * GIB, True), "unload", id="unified-1-byte-over"),
    pytest.param(100 * GIB - WORKING_MARGIN + 1, Machine("cuda", 100 * GIB, False), "offload",
                 id="discrete-1-byte-over"),
    pytest.param(115 * GIB, Machine("cuda", 128 * 10**9, True), "unload", id="gb10-bf16-full-adaln"),
    pytest.param(31 * GIB, Machine("cuda", 128 * 10**9, True), "resident", id="gb10-nvfp4"),
    pytest.param(91 * GIB, Machine("cuda", 141 * 10**9, False), "resident", id="h200-bf16"),
])
def test_auto_chooses_by_weights_margin_memory_and_unified(hot, machine, want):
    policy, why = choose("auto", hot, machine)
    assert policy == want, why
    if machine.device_type == "cuda":
        assert "GiB" in why and ("unified" in why) == (want == "unload")


@pytest.mark.parametrize("asked", ["resident", "offload", "unload"])
def test_an_asked_policy_is_kept_whatever_the_device(asked):
    for machine in (Machine("cpu"), Machine("cuda", 1, True), Machine("cuda", 10**15, False)):
        assert choose(asked, 10 * GIB, machine) == (asked, "asked")


def test_an_unknown_policy_is_one_line():
    with pytest.raises(ConfigError, match="'sometimes' is not one of auto, resident, offload, unload"):
        choose("sometimes", 0, Machine("cpu"))
    assert residency.machine_of(torch.device("cpu")) == Machine("cpu")


@pytest.mark.parametrize("spare, unified, want", [(0, True, "resident"), (-1, True, "unload"),
                                                   (-1, False, "offload")])
def test_the_pipeline_asks_auto_with_the_footprint_of_its_files(cache_env, monkeypatch, spare, unified, want):
    # a CUDA device of exactly the bundled models' weights as loaded (counted here, tensor by tensor) + the margin
    # (+ spare bytes), injected
    loaded = _pipeline("resident")
    models = (loaded.dit, loaded.video_vae, loaded.audio_vae, loaded.text_encoder.net)
    hot = sum(t.numel() * t.element_size() for m in models
              for t in {id(t): t for t in (*m.parameters(), *m.buffers())}.values())
    monkeypatch.setattr(residency, "machine_of", lambda dev: Machine("cuda", hot + WORKING_MARGIN + spare, unified))
    pipe = _pipeline("auto")
    assert pipe.text.policy == want and pipe.text.asked == "auto", pipe.text.why
    assert sum(pipe.footprint().values()) == hot


# ---- bitwise the same under every policy ----------------------------------------------------------

class Moves:
    """A stand-in for the move between device and host on the CPU: every tensor of the encoder is replaced by a
    copy (as a move between two memories makes), and the target is recorded. `lossy`: the copy goes through bf16."""

    def __init__(self, lossy: bool = False):
        self.lossy, self.targets = lossy, []

    def __call__(self, encoder, device):
        self.targets.append(str(device))
        for t in (*encoder.net.parameters(), *encoder.net.buffers()):
            copy = t.data.to(torch.bfloat16).to(t.dtype) if self.lossy and t.is_floating_point() else t.data.clone()
            t.data = copy


def _pipeline(policy: str, moves: Moves | None = None):
    from h3direct.app.pipeline import H3Pipeline

    pipe = H3Pipeline.bundled(device="cpu", text_encoder_policy=policy)
    if moves is not None:
        pipe.text.host = torch.device("cpu", 0)  # a second device string: the stand-in sees which way it goes
        pipe.text.move = moves
    return pipe


def _two_requests(pipe):
    from h3direct.app.request import GenerateRequest

    requests = [GenerateRequest(**TINY, prompt="a lighthouse at night", seed=3),
                GenerateRequest(**TINY, prompt="rain on a tin roof", negative_prompt="sunshine", cfg=2.0, seed=4)]
    return [pipe.generate(r, decode=False) for r in requests]


def _same(a, b) -> bool:
    return torch.equal(a.video_latent, b.video_latent) and torch.equal(a.audio_latent, b.audio_latent)


@pytest.fixture(scope="module")
def resident(cache_env):
    pipe = _pipeline("resident")
    results = _two_requests(pipe)
    assert pipe.text.where == "device" and pipe.text.loads == 1
    assert not [k for r in results for k in r.timings if k.startswith("text_encoder_")]  # nothing moved
    return results


def _storages(encoder) -> list[int]:
    return [t.data_ptr() for t in (*encoder.net.parameters(), *encoder.net.buffers())]


def test_offload_is_bitwise_resident_and_copies_once_per_request(resident):
    moves = Moves()
    pipe = _pipeline("offload", moves)
    assert pipe.text.where == "host" and pipe.text.loads == 1
    loaded = _storages(pipe.text.encoder)
    results = _two_requests(pipe)
    assert all(_same(r, want) for r, want in zip(results, resident, strict=True))
    assert moves.targets == ["cpu", "cpu"]  # to the device, per request; nothing is copied back
    assert pipe.text.where == "host" and pipe.text.loads == 1 and pipe.text.last_move["move"] == "to_host"
    assert _storages(pipe.text.encoder) == loaded  # between requests: the very tensors it loaded
    for r in results:
        assert {"text_encoder_to_device", "text_encoder_to_host", "text_encoder_load"} & set(r.timings) == {
            "text_encoder_to_device", "text_encoder_to_host"}


def test_unload_is_bitwise_resident_and_reloads_per_request(resident):
    pipe = _pipeline("unload")
    assert pipe.text.where == "unloaded" and pipe.text.loads == 0 and pipe.text_encoder is None
    results = _two_requests(pipe)
    assert all(_same(r, want) for r, want in zip(results, resident, strict=True))
    assert pipe.text.where == "unloaded" and pipe.text.loads == 2 and pipe.text_encoder is None
    for r in results:
        assert {"text_encoder_load", "text_encoder_free"} <= set(r.timings) and r.timings["text_encoder_load"] > 0


def test_a_move_that_loses_bits_is_seen(resident):
    # the comparison above can fail: a move through bf16 changes the encoder's fp32 weights, and so the clip
    results = _two_requests(_pipeline("offload", Moves(lossy=True)))
    assert not any(_same(r, want) for r, want in zip(results, resident, strict=True))


# ---- through the service --------------------------------------------------------------------------

def _call(url: str, method: str, path: str, body=None):
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"} if body is not None else {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.fixture
def serve(cache_env, tmp_path):
    """`serve(policy)`: the service with that text-encoder policy over a real socket; its URL and Service."""
    from h3direct.app.cli_serve import service_of
    from h3direct.app.serve import HTTPServer, bind

    started, threads = [], torch.get_num_threads()

    def start(policy: str):
        args = cli.build_parser("serve").parse_args(["serve", "--port", "0", "--output-root", str(tmp_path),
                                                     "--quiet", "--text-encoder-policy", policy])
        svc = service_of(args)
        svc.prepare()
        svc.load()
        srv = HTTPServer(svc, bind("127.0.0.1", 0)).start()
        started.append((svc, srv))
        return srv.url, svc

    yield start
    for svc, srv in started:
        srv.shutdown(wait=True)
        svc.stop()
        svc.close()
    torch.set_num_threads(threads)


@pytest.mark.parametrize("policy, between, moves", [
    ("unload", "unloaded", ("text_encoder_load", "text_encoder_free")),
    ("offload", "host", ("text_encoder_to_device", "text_encoder_to_host")),
])
def test_two_requests_through_the_service(serve, policy, between, moves):
    url, svc = serve(policy)
    code, ready = _call(url, "GET", "/ready")
    assert code == 200
    state = ready["text_encoder_residency"]
    assert state["policy"] == policy and state["asked"] == policy and state["where"] == between
    assert state["loads"] == (1 if policy == "offload" else 0)
    assert (ready["components"]["text_encoder"]["device"] is None) == (policy == "unload")
    assert ready["components"]["text_encoder"]["sha256"] == svc.weights["text_encoder"]["sha256"]
    assert ready["memory"]["weights"]["text_encoder"] > 0
    for i in range(2):
        code, summary = _call(url, "POST", "/generate", {**TINY, "prompt": f"request {i}", "output": f"{i}.mp4"})
        assert code == 200, summary
        assert set(moves) <= set(summary["timings"]), summary["timings"]
        state = _call(url, "GET", "/ready")[1]["text_encoder_residency"]
        assert state["where"] == between and state["last_move"]["move"] == moves[1].removeprefix("text_encoder_")
        assert state["last_move"]["seconds"] >= 0
    assert state["loads"] == (1 if policy == "offload" else 2)


def test_bad_policy_is_one_line_and_exit_2(cache_env, tmp_path, capsys, monkeypatch):
    from h3direct.app.env import read_settings

    base = ["--output-root", str(tmp_path), "--quiet"]
    for argv in (["serve", *base, "--text-encoder-policy", "bogus"], ["generate", "--text-encoder-policy", "x"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "--text-encoder-policy" in err, err
    with pytest.raises(ConfigError, match="H3_TEXT_ENCODER_POLICY='often'"):
        read_settings({"H3_TEXT_ENCODER_POLICY": "often"})
    assert read_settings({"H3_TEXT_ENCODER_POLICY": "unload"}) == {"text_encoder_policy": "unload"}
    monkeypatch.setenv("H3_TEXT_ENCODER_POLICY", "often")
    assert cli.main(["serve", *base]) == 2  # read once at startup, before any model loads or the socket binds
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "H3_TEXT_ENCODER_POLICY" in err, err
    with pytest.raises(ConfigError, match="'often' is not one of"):
        _pipeline("often")


def test_without_a_text_encoder_the_errors_are_one_line(cache_env):
    from h3direct.app.pipeline import H3Pipeline
    from h3direct.app.request import GenerateRequest
    from h3direct.errors import H3Error, RequestError
    from h3direct.text.presentation import TextConditioning

    pipe = H3Pipeline.bundled(device="cpu", text_encoder=False)
    assert not pipe.text.present and pipe.text.acquire() is None and pipe.text.release() is None
    with pytest.raises(H3Error, match="no text encoder is loaded"):
        pipe.generate(GenerateRequest(**TINY, prompt="a prompt, no encoder"), decode=False)
    embeds = TextConditioning(torch.zeros(1, 4, pipe.dit.config.text_dim), torch.ones(4, dtype=torch.long))
    with pytest.raises(RequestError, match="needs a negative prompt, which needs a text encoder"):
        pipe.generate(GenerateRequest(**TINY, text_embeds=embeds, cfg=2.0), decode=False)


def test_unload_checks_the_text_encoder_file_before_the_first_request(cache_env, tmp_path):
    """Under `unload` the encoder is loaded only per request; a file with a missing tensor is still refused when the
    pipeline loads (one-line CheckpointError), not by every request afterwards."""
    from safetensors.torch import load_file, save_file

    from h3direct.app import bundled
    from h3direct.app.pipeline import H3Pipeline
    from h3direct.errors import CheckpointError

    b = bundled.ensure()
    sd = load_file(str(b.text_encoder))
    dropped = next(k for k in sorted(sd) if k.endswith("layers.0.mlp.down_proj.weight"))
    bad = tmp_path / "text_encoder.safetensors"
    save_file({k: v for k, v in sd.items() if k != dropped}, str(bad))
    with pytest.raises(CheckpointError, match="down_proj"):
        H3Pipeline.from_files(b.dit, b.video_vae, b.audio_vae, bad, tokenizer=b.tokenizer,
                              video_vae_config=b.video_vae_config, audio_vae_config=b.audio_vae_config,
                              device="cpu", text_encoder_policy="unload")
    good = H3Pipeline.from_files(b.dit, b.video_vae, b.audio_vae, b.text_encoder, tokenizer=b.tokenizer,
                                 video_vae_config=b.video_vae_config, audio_vae_config=b.audio_vae_config,
                                 device="cpu", text_encoder_policy="unload")
    assert good.text.loads == 0 and good.text_encoder is None


@pytest.mark.gpu
def test_offload_on_a_gpu_is_bitwise_resident_from_a_pinned_host_copy(cache_env):
    """On a GPU: offload keeps the encoder page-locked in host memory, copies it to the device per request, and the
    clips are bitwise those of the resident encoder; between requests the encoder is its loaded host tensors again
    and holds no device memory."""
    from h3direct.app.pipeline import H3Pipeline

    want = _two_requests(H3Pipeline.bundled(device="cuda", text_encoder_policy="resident"))
    pipe = H3Pipeline.bundled(device="cuda", text_encoder_policy="offload")
    tensors = lambda: (*pipe.text.encoder.net.parameters(), *pipe.text.encoder.net.buffers())  # noqa: E731
    assert all(t.device.type == "cpu" and t.is_pinned() for t in tensors())
    loaded = _storages(pipe.text.encoder)
    got = _two_requests(pipe)
    assert all(_same(r, w) for r, w in zip(got, want, strict=True))
    assert _storages(pipe.text.encoder) == loaded and all(t.is_pinned() for t in tensors())
    for r in got:
        assert r.timings["text_encoder_to_device"] > 0 and "text_encoder_to_host" in r.timings
