"""benchmarks/regate.py judges a calibration report under the real budgets table the way the gate keys it: a teacher
"model" site under free/output, --fp8-linear runs only under entries keyed weights fp8_w8a8."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import final_summary  # noqa: E402
import regate  # noqa: E402

from h3direct.traces.budgets import load_budgets  # noqa: E402


def _report(tmp: Path, rows: list[dict], compute: str = "bf16") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    cases = sorted({(r["case"], r["mode"]) for r in rows})
    (tmp / "report.md").write_text("\n".join(f"| {c} | {m} | {compute} | bf16 | x | 1 |" for c, m in cases) + "\n")
    (tmp / "results.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return tmp


def _row(layer: str, kind: str, rel: float, mode: str = "teacher") -> dict:
    return {"case": "c/trace_bf16", "mode": mode, "layer": layer, "kind": kind, "rel_l2": rel, "sqnr_db": 40.0}


def _limit(**key) -> float:
    return load_budgets().lookup(**key).rel_l2


def test_fa3_fp8_attention_limit_bites(tmp_path):
    lim = _limit(mode="teacher", kind="attention", compute="bf16", weights="bf16", attention="fa3_fp8")
    ok = _report(tmp_path / "a", [_row("blocks.0.attn.out", "attention", 0.95 * lim)])
    bad = _report(tmp_path / "b", [_row("blocks.0.attn.out", "attention", 1.05 * lim)])
    assert regate.regate(ok, "fa3_fp8")[0] == []
    assert len(regate.regate(bad, "fa3_fp8")[0]) == 1
    assert regate.main([str(bad), "fa3_fp8"]) == 1 and regate.main([str(ok), "fa3_fp8"]) == 0


def test_a_teacher_model_site_is_judged_as_a_free_output(tmp_path):
    out = _limit(mode="free", kind="output", compute="bf16", weights="bf16", attention="sol_attn")
    star = _limit(mode="teacher", kind="*", compute="bf16", weights="bf16", attention="sol_attn")
    assert star < 0.9 * out
    rep = _report(tmp_path, [_row("dit_inner.out.video", "model", 0.9 * out)])
    fails, used = regate.regate(rep, "sol_attn")
    assert fails == [] and ("bf16", "free", "output") in used


def test_fp8_linear_runs_need_entries_keyed_fp8_w8a8(tmp_path):
    rep = _report(tmp_path, [_row("blocks.0.mlp.fc1.out", "linear", 0.01)])
    assert regate.regate(rep, "fa3", "fp8_w8a8")[0] == []
    assert regate.regate(rep, "sol_attn", "fp8_w8a8")[0] == []  # calibrated on the H200 (gpu_final.sh)
    fails = regate.regate(rep, "sage2", "fp8_w8a8")[0]  # no sage2 + fp8_w8a8 entry
    assert len(fails) == 1 and "no calibrated budget" in fails[0][3]


def test_final_summary_rows(tmp_path, capsys):
    rep = _report(tmp_path / "r", [_row("blocks.0.attn.out", "attention", 0.02)])
    log = tmp_path / "r.log"
    log.write_text("....\n3 passed, 1 skipped in 2.00s\n")
    assert final_summary.main([f"x={rep},{log},fa3_fp8", f"y={tmp_path / 'none'},{log},fa3"]) == 0
    out = capsys.readouterr().out
    assert "3 passed, 1 skipped" in out and "real PASS" in out and "2.00e-02" in out and "(no parity report)" in out
    assert "vs fp32 –  x– ComfyUI" in out and "0.00e+00" not in out  # no fp32 twin recorded: a dash, not a zero
    free = dict(_row("dit_inner.out.video", "model", 0.03, mode="free"), vs_fp32=[0.03, 0.02])
    rep2 = _report(tmp_path / "r2", [free])
    assert final_summary.main([f"z={rep2},{log},fa3"]) == 0
    assert "vs fp32 3.00e-02  x1.50 ComfyUI" in capsys.readouterr().out
    assert final_summary.main(["no-equals-sign"]) == 2


@pytest.mark.parametrize("argv", [[], ["/nonexistent", "fa3"]])
def test_regate_bad_arguments(argv):
    assert regate.main(argv) == 2
