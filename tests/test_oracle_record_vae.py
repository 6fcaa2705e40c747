"""`python -m oracle record-vae` against a real ComfyUI: it must reproduce the shared VAE traces (recorded by another
harness on another CPU) key by key, within the fp32 VAE budget of the parity table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from h3direct.traces.format import load_trace
from oracle.compare import diff_traces
from oracle.record_vae import constructor_args
from parity_tests.budgets import load_budgets
from parity_tests.discovery import SHARED_ORACLE as SHARED


def test_constructor_args_drop_notes_and_reject_non_objects():
    cfg = {"constructor_args": {"MiniMaxH3VideoVAE": {"ch": 32, "note": "x"}, "ViT3DDecoder": {"heads": 2}}}
    assert constructor_args(cfg) == {"MiniMaxH3VideoVAE": {"ch": 32}, "ViT3DDecoder": {"heads": 2}}
    assert constructor_args(None) == {}
    from h3direct.errors import H3Error

    with pytest.raises(H3Error, match="MiniMaxH3AudioVAE"):
        constructor_args({"constructor_args": {"MiniMaxH3AudioVAE": [4]}})


@pytest.mark.comfy
@pytest.mark.shared
@pytest.mark.parametrize(("modality", "ops"), [("audio", ("decode", "encode")), ("video", ("decode",))])
def test_record_vae_reproduces_shared_traces(tmp_path: Path, modality: str, ops: tuple[str, ...],
                                             comfy_root: str) -> None:
    out = tmp_path / f"trace_vae_{modality}_{{op}}_fp32.safetensors"
    only = ["--op", ops[0]] if len(ops) == 1 else []
    r = subprocess.run(
        [sys.executable, "-m", "oracle", "record-vae", "--weights", str(SHARED / f"vae_{modality}_tiny.safetensors"),
         "--config", str(SHARED / "vae_config_public.json"), "--inputs", str(SHARED / "vae_inputs_public.safetensors"),
         "--dtype", "fp32", *only, "--comfy-root", comfy_root, "--out", str(out)],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    budget = load_budgets().rules["fp32_limit"]  # the fp32 rule
    for op in ops:
        mine = load_trace(str(out).replace("{op}", op))
        ref = load_trace(SHARED / f"trace_vae_{modality}_{op}_fp32.safetensors")
        d = diff_traces(mine, ref)
        assert not d.only_in_reference and not d.shape_mismatch, (d.only_in_reference, d.shape_mismatch)
        assert d.worst.rel_l2 <= budget, d.worst.line()
        assert mine.manifest["kind"] == f"{modality}_{op}" and mine.manifest["compute_dtype"] == "fp32"
        for case, info in ref.manifest["cases"].items():  # same tiles / chunks / shapes as ComfyUI planned there
            assert {k: mine.manifest["cases"][case].get(k) for k in info} == info, case
