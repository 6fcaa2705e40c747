"""The end-to-end contract (benchmarks/ref2va-960x544-124f-e2e.json), its runner and `benchmarks.compare` on it, run
as a user runs them (subprocesses; no test imports from benchmarks/).

compare's e2e rules each get a crafted result that breaks one of them (a smoke run, another device, another
workload, other settings on either side, another text length or step count, an incomplete mp4, a figure that is not
a finite number) and must fail it; the targets miss without a same-run ComfyUI. The runner runs the whole
generation on the CPU at tiny sizes (h3direct; ComfyUI's own nodes too with a checkout, marked `comfy`).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from contract_cli import broken, compare, has

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = ROOT / "benchmarks" / "ref2va-960x544-124f-e2e.json"
STAGES = ("text_encode_s", "denoise_s", "video_decode_s", "audio_decode_s", "mp4_write_s", "total_s")


def _compare(result, tmp: Path, contract: Path = CONTRACT) -> subprocess.CompletedProcess:
    return compare(result, contract, tmp)


def _passing() -> dict:
    """A result that ran the contract and meets every target (made-up numbers, run_e2e's shape)."""
    c = json.loads(CONTRACT.read_text())
    w = c["workload"]
    mp4 = {"frames": w["frames"], "width": w["width"], "height": w["height"], "fps": 24.0, "audio_streams": 1}

    def side(name, kind, total):
        spec = c["configs"][name]
        if kind == "h3direct":
            h = c["h3direct"]
            settings = {"attention": h["attention"], "options": {"attention": h["attention"], "sol_tau": 1.3},
                        "fp8_linear": h["fp8_linear"], "vae_dtype": h["vae_dtype"],
                        "nvfp4_mode": spec.get("nvfp4_mode")}
        else:
            settings = dict(c["comfyui"])
        settings.update(dit=spec["dit"], text_encoder=spec["text_encoder"])
        stages = {"text_encode_s": 2.0, "denoise_s": total - 8.0, "video_decode_s": 4.0, "audio_decode_s": 1.0,
                  "mp4_write_s": 1.0, "total_s": total}
        return {"status": "ok", "settings": settings, "text_tokens": w["text_tokens"], "steps": w["steps"],
                "stages": stages, "peak_gpu_gib": 60.0, "mp4": dict(mp4), "mp4_encode_busy_s": 3.5}

    return {"contract": c["contract"], "kind": "e2e", "smoke": False, "device": "NVIDIA H200",
            "env": {"device": "cuda"}, "workload": {**{k: w[k] for k in w if k not in ("note", "references")},
                                                        "warmup_steps": c["warmup_steps"]},
            "weights": dict(c["weights"]), "comfyui": {"version": "0.33.0", "commit": "abc"},
            "configs": {n: {"h3direct": side(n, "h3direct", 28.0), "comfyui": side(n, "comfyui", 45.0)}
                        for n in c["configs"]}}


def test_compare_passes_an_e2e_result_that_ran_the_contract_and_met_it(tmp_path):
    p = _compare(_passing(), tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert has(p.stdout, "4 of 4 targets met") and "FAIL" not in p.stdout
    assert has(p.stdout, "pass nvfp4        total_ratio          0.622 <= 0.7")  # 28 / 45, same run
    assert has(p.stdout, "info nvfp4  h3direct text_encode 2.00, denoise 20.00, video_decode 4.00, audio_decode "
                          "1.00, mp4_write 1.00, total 28.00 s (mp4 encoder busy 3.50 s), peak 60.00 GiB")
    assert has(p.stdout, "info nvfp4  comfyui  text_encode 2.00, denoise 37.00")


@pytest.mark.parametrize("where, value, needle", [
    ("smoke", True, "FAIL rule   not a smoke run"),
    ("device", "NVIDIA A100-SXM4-80GB", "FAIL rule   device: the contract is for 'NVIDIA H200'"),
    ("workload.steps", 4, "FAIL rule   workload: steps 4 (contract 8)"),
    ("workload.warmup_steps", 0, "FAIL rule   workload: warmup_steps 0 (contract 1)"),
    ("workload.prompt", "a cat", "FAIL rule   workload: prompt 'a cat'"),
    ("workload.width", 832, "FAIL rule   workload: width 832 (contract 960)"),
    ("weights.text_encoder", "tiny", "FAIL rule   weights: text_encoder 'tiny' (contract 'qwen3vl_32b')"),
    ("configs.bf16.h3direct.settings.attention", "sdpa",
     "FAIL rule   bf16 h3direct settings: attention 'sdpa' (contract 'fa3')"),
    ("configs.nvfp4.h3direct.settings.text_encoder", "bf16",
     "FAIL rule   nvfp4 h3direct settings: text_encoder 'bf16' (contract 'nvfp4')"),
    ("configs.nvfp4.h3direct.settings.fp8_linear", "stream",
     "FAIL rule   nvfp4 h3direct settings: fp8_linear 'stream' (contract 'off')"),
    ("configs.bf16.h3direct.settings.vae_dtype", "fp32",
     "FAIL rule   bf16 h3direct settings: vae_dtype 'fp32' (contract 'fp16')"),
    ("configs.nvfp4.comfyui.settings.settings", "oracle",
     "FAIL rule   nvfp4 comfyui settings: settings 'oracle' (contract 'user')"),
    ("configs.nvfp4.comfyui.settings.dit", "bf16", "FAIL rule   nvfp4 comfyui settings: dit 'bf16' (contract 'nvfp4')"),
    ("configs.bf16.h3direct.text_tokens", 300, "FAIL rule   bf16 h3direct generation: text_tokens 300 (contract 580)"),
    ("configs.bf16.comfyui.steps", 2, "FAIL rule   bf16 comfyui generation: steps 2 (contract 8)"),
    ("configs.nvfp4.h3direct.mp4.frames", 100, "FAIL rule   nvfp4 h3direct generation: mp4 frames 100 (contract 124)"),
    ("configs.nvfp4.comfyui.mp4.audio_streams", 0,
     "FAIL rule   nvfp4 comfyui generation: mp4 audio streams 0 (contract 1)"),
    ("configs.bf16.h3direct.stages.video_decode_s", float("inf"),
     "FAIL rule   bf16 h3direct figures: not finite numbers: video_decode_s inf"),
    ("configs.bf16.comfyui.stages.audio_decode_s", True,
     "FAIL rule   bf16 comfyui figures: not finite numbers: audio_decode_s True"),
    ("configs.bf16.h3direct.peak_gpu_gib", "60", "FAIL rule   bf16 h3direct figures: not finite numbers: peak_gpu_gib"),
], ids=["smoke", "device", "steps", "warmup", "prompt", "canvas", "weights", "attention", "te-format", "fp8", "vae-dtype",
        "comfy-settings", "comfy-format", "text-tokens", "comfy-steps", "mp4-frames", "mp4-audio", "stage-inf",
        "stage-bool", "peak-string"])
def test_compare_fails_an_e2e_result_that_did_not_run_the_contract(tmp_path, where, value, needle):
    p = _compare(broken(_passing(), where, value), tmp_path)
    assert p.returncode == 1 and has(p.stdout, needle), p.stdout
    assert has(p.stdout, "1 rule(s) broken: the result did not run the contract")


def test_compare_holds_h3direct_to_the_contracts_options(tmp_path):
    """The options the e2e contract names for h3direct (none today) are checked per configuration: a result that ran
    another value fails, the same value passes."""
    c = json.loads(CONTRACT.read_text())
    for want, ok in ((2.0, False), (1.3, True)):  # _passing() ran sol_tau 1.3
        c["h3direct"]["options"] = {"sol_tau": want}
        contract = tmp_path / f"contract-{want}.json"
        contract.write_text(json.dumps(c))
        p = _compare(_passing(), tmp_path, contract)
        if ok:
            assert p.returncode == 0, p.stdout
            continue
        assert p.returncode == 1 and has(p.stdout, "2 rule(s) broken: the result did not run the contract"), p.stdout
        for name in c["configs"]:
            assert has(p.stdout, f"FAIL rule   {name} h3direct settings: options sol_tau 1.3 (contract 2.0)")


def test_compare_fails_an_e2e_result_without_a_configuration(tmp_path):
    r = _passing()
    del r["configs"]["bf16"]
    p = _compare(r, tmp_path)
    assert p.returncode == 1 and has(p.stdout, "FAIL rule   bf16: not in the result")
    assert has(p.stdout, "MISS bf16         total_ratio            n/a <= 0.7  (configuration 'bf16' not in the result)")


@pytest.mark.parametrize("where, value, needle", [
    ("configs.nvfp4.h3direct.stages.total_s", 32.0, "MISS nvfp4        total_ratio          0.711 <= 0.7"),
    ("configs.bf16.h3direct.stages.mp4_write_s", 1.51, "MISS bf16         mp4_write_s          1.510 <= 1.5"),
    ("configs.bf16.comfyui.stages.total_s", float("nan"), "MISS bf16         total_ratio"),
    ("configs.bf16.comfyui.stages.total_s", 0, "MISS bf16         total_ratio"),
    ("configs.bf16.comfyui", {"status": "failed: exit 1: out of memory"},
     "MISS bf16         total_ratio            n/a <= 0.7  (ComfyUI bf16: failed: exit 1: out of memory)"),
    ("configs.nvfp4.h3direct", {"status": "unavailable: fa3 needs sm_90"},
     "MISS nvfp4        mp4_write_s            n/a <= 1.5  (h3direct nvfp4: unavailable: fa3 needs sm_90)"),
], ids=["ratio", "mp4-write", "comfy-nan", "comfy-zero", "comfy-failed", "h3direct-unavailable"])
def test_compare_misses_e2e_targets(tmp_path, where, value, needle):
    p = _compare(broken(_passing(), where, value), tmp_path)
    assert p.returncode == 1 and has(p.stdout, needle), p.stdout


def test_compare_e2e_ratio_needs_the_same_run(tmp_path):
    """No ComfyUI in the result: total_ratio misses with the note, whatever a stored ratio says."""
    r = _passing()
    for entry in r["configs"].values():
        del entry["comfyui"]
        entry["total_ratio"] = 0.1
    r["comfyui"], r["comfyui_note"] = None, "no same-run ComfyUI"
    p = _compare(r, tmp_path)
    assert p.returncode == 1 and has(p.stdout, "MISS bf16         total_ratio            n/a <= 0.7  (no same-run ComfyUI)")
    assert has(p.stdout, "pass bf16         mp4_write_s")


def test_compare_refuses_a_dit_result_for_the_e2e_contract(tmp_path):
    r = {"contract": "ref2va-960x544-124f", "smoke": False}
    p = _compare(r, tmp_path)
    assert p.returncode == 2 and "is for contract 'ref2va-960x544-124f'" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


# ---------------------------------------------------------------- the runner

def _contract(tmp_path: Path) -> Path:
    """The contract with an attention backend the CPU runs (the contract's fa3 is Hopper's)."""
    c = json.loads(CONTRACT.read_text())
    c["h3direct"]["attention"] = "sdpa"
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(c))
    return path


def _run(tmp_path: Path, *extra: str, out: str = "r.json") -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("H3_") or k == "H3_COMFY_COMMIT"}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "benchmarks.run_contract", "--contract", str(_contract(tmp_path)),
                           "--out", str(tmp_path / out), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)


def _finite(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def test_runner_smoke_makes_the_whole_generation_and_compare_refuses_it(tmp_path):
    """--smoke on the CPU: text encoder (tiny, NVFP4), DiT, VAEs built; the generation through `app.generate.clip`
    to an mp4 of every frame with its audio; each stage timed; the result read by compare, which refuses it."""
    p = _run(tmp_path, "--smoke", "--device", "cpu", "--steps", "1", "--configs", "nvfp4")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    h = r["configs"]["nvfp4"]["h3direct"]
    assert h["status"] == "ok", h
    assert all(_finite(h["stages"][k]) and h["stages"][k] >= 0 for k in STAGES)
    assert _finite(h["mp4_encode_busy_s"]) and h["mp4_encode_busy_s"] > 0
    assert h["mp4"] == {**h["mp4"], "frames": 22, "width": 64, "height": 64, "fps": 24.0, "audio_streams": 1}
    # the byte tokenizer (no --tokenizer, no ComfyUI): "<Picture 1>: " + vision start/end around the 64x64
    # reference's (64/32)^2 merged positions + the prompt's UTF-8 bytes
    prompt = json.loads(CONTRACT.read_text())["workload"]["prompt"]
    assert h["text_tokens"] == len("<Picture 1>: ") + 2 + 4 + len(prompt.encode())
    assert h["steps"] == 1 and len(h["step_s"]) == 1
    s = h["settings"]
    assert (s["attention"], s["dit"], s["text_encoder"], s["nvfp4_mode"], s["text_compute_dtype"]) == (
        "sdpa", "nvfp4", "nvfp4", "w4a16", "float32")
    assert set(h["builds"]) == {"text_encoder", "dit", "video_vae", "audio_vae"}
    assert r["smoke"] is True and r["kind"] == "e2e" and r["comfyui"] is None and r["commit"]
    q = _compare(tmp_path / "r.json", tmp_path, contract=tmp_path / "e2e.json")
    assert q.returncode == 1 and has(q.stdout, "FAIL rule   not a smoke run")
    assert has(q.stdout, "MISS nvfp4        total_ratio") and has(q.stdout, "no same-run ComfyUI")


@pytest.mark.parametrize("flags, needle", [
    (["--smoke", "--configs", "fp8"], "--configs: fp8 not a configuration of the contract (bf16, nvfp4)"),
    (["--smoke", "--paths", "exact"], "--paths: a flag of the DiT contract"),
    (["--smoke", "--comfy-rounds", "1"], "--comfy-rounds: a flag of the DiT contract"),
    (["--device", "cpu"], "the text encoder needs the Qwen2 tokenizer"),
    (["--smoke", "--tokenizer", "/"], "--tokenizer: "),
    (["--smoke", "--comfy-root", "/"], "--comfy-root:"),
    (["--smoke", "--steps", "0"], "--steps 0"),
], ids=["config", "dit-flag", "rounds-flag", "no-tokenizer", "bad-tokenizer", "bad-comfy-root", "steps"])
def test_runner_bad_flags_are_one_line_exit_2(tmp_path, flags, needle):
    p = _run(tmp_path, *flags)
    assert p.returncode == 2 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "r.json").exists()


def test_dit_contract_refuses_e2e_flags(tmp_path):
    p = subprocess.run([sys.executable, "-m", "benchmarks.run_contract", "--contract",
                        "benchmarks/ref2va-960x544-124f.json", "--out", str(tmp_path / "r.json"), "--configs", "x"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--configs: a flag of the e2e contract" in p.stderr


def test_merge_makes_one_result_of_runs_of_disjoint_configurations(tmp_path):
    r = _passing()
    r.update(commit="c1", command=["run"], date="d")
    a, b = copy.deepcopy(r), copy.deepcopy(r)
    del a["configs"]["nvfp4"], b["configs"]["bf16"]
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    p = _run(tmp_path, "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), out="m.json")
    assert p.returncode == 0, p.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["configs"] == r["configs"] and [x["configs"] for x in m["merged_from"]] == [["bf16"], ["nvfp4"]]
    assert _compare(tmp_path / "m.json", tmp_path).returncode == 0
    b["commit"] = "c2"
    (tmp_path / "b.json").write_text(json.dumps(b))
    p = _run(tmp_path, "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), out="m2.json")
    assert p.returncode == 2 and "commit 'c2' differs" in p.stderr and not (tmp_path / "m2.json").exists()
    p = _run(tmp_path, "--merge", str(tmp_path / "a.json"), str(tmp_path / "a.json"), out="m3.json")
    assert p.returncode == 2 and "configuration 'bf16' is in two runs" in p.stderr


@pytest.mark.comfy
def test_runner_smoke_times_comfyui_nodes_in_the_same_run(tmp_path, comfy_root):
    """With a ComfyUI checkout: its own nodes make the same tiny generation in their own process (same synthetic
    tensors, its Qwen2 tokenizer for both sides: the same text length), each stage timed, the ratio computed."""
    p = _run(tmp_path, "--smoke", "--device", "cpu", "--steps", "1", "--configs", "nvfp4", "--comfy-root", comfy_root)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "r.json").read_text())
    entry = r["configs"]["nvfp4"]
    h, c = entry["h3direct"], entry["comfyui"]
    assert h["status"] == "ok" and c["status"] == "ok", c
    assert h["text_tokens"] == c["text_tokens"] and c["steps"] == 1
    assert c["mp4"]["frames"] == h["mp4"]["frames"] == 22 and c["mp4"]["audio_streams"] == 1
    assert all(_finite(c["stages"][k]) for k in STAGES)
    assert c["settings"]["settings"] == "user" and c["environment"]["deterministic"] is False
    assert entry["total_ratio"] == pytest.approx(h["stages"]["total_s"] / c["stages"]["total_s"])
    assert r["comfyui"]["version"] and r["comfyui"]["comfy_kitchen"]
    q = _compare(tmp_path / "r.json", tmp_path, contract=tmp_path / "e2e.json")
    assert has(q.stdout, "info nvfp4  comfyui  text_encode") and has(q.stdout, "info nvfp4  total_ratio")


def test_committed_h200_result_ran_the_contract_and_compare_passes_it(tmp_path):
    """The committed end-to-end result (benchmarks/results/e2e-h200.json) holds both configurations with both sides'
    stage tables from one run, and compare passes it: rules, then targets."""
    committed = ROOT / "benchmarks" / "results" / "e2e-h200.json"
    r = json.loads(committed.read_text())
    assert set(r["configs"]) == set(json.loads(CONTRACT.read_text())["configs"])
    for name, entry in r["configs"].items():
        for side in ("h3direct", "comfyui"):
            assert set(STAGES) <= set(entry[side]["stages"]), (name, side)
    p = _compare(committed, tmp_path)
    assert p.returncode == 0 and not p.stderr, p.stdout + p.stderr
    assert "FAIL" not in p.stdout and "MISS" not in p.stdout


def test_a_result_records_the_formats_its_models_hold():
    """The e2e result's `dit` / `text_encoder` formats are read from the built models (what ran), so compare's
    settings rule can catch a build that is not the contract's."""
    from benchmarks.run_e2e import weight_format
    from h3direct.dit.loader import load_dit

    fx = ROOT / "fixtures"
    assert weight_format(load_dit(fx / "h3_fx_curve_nvfp4.safetensors")) == "nvfp4"
    assert weight_format(load_dit(fx / "h3_fx_bf16.safetensors")) == "bf16"
