#!/usr/bin/env bash
# Issue 12, e2e frames entries of the approximate paths: one H200 call, expected ~3 min (hard cap ~4 min: every
# step under `timeout`). From the repository root with $OUT and $CARRY set (sources benchmarks/_gpu_env.sh).
#
#  1. model folders (benchmarks/e2e_frames.py build): "small" DiT (head_dim 128, 2 heads, 2 blocks), bf16 and NVFP4
#     (blocks), with `--attention-structure local` when make-checkpoint knows it (local attention structure; random
#     weights give near-uniform attention, where sparse attention is meaningless), tiny VAEs, seeded text states;
#     512x512, 56 frames, 4 steps: S = 4,509 tokens per attention call (> H3_SOL_MIN_TOKENS, so sol_attn's kernel runs)
#  2. benchmarks/e2e_frames.py compare: the exact reference (fa3) twice (determinism), then every approximate path
#     available here, twice on the bf16 model and once on the NVFP4 one (sage2 needs `import sageattention` to
#     work; fa3_fp8 when registered; fp8_linear when `generate --help` knows --fp8-linear; sol_attn's short calls
#     run H3_SOL_FALLBACK: sage2, or fa3 without it), same seed and inputs, decoded to float frames: PSNR / SSIM
#     mean and min,
#     attention call counts (sol_attn kernel vs fallback), proposed budget entries (2x error margin)
#  3. the pytest gate on the GPU: `pytest -m parity --device cuda --attention NAME --e2e-model DIR` with the
#     calibration table (runs, never fails on numbers) and with budgets.toml (fails "no calibrated budget" until the
#     entries are added)
# Writes $OUT/e2eapx/: e2e_frames.json (every number + proposed entries), *.log; prints a summary at the end.
set -u
OUT="${OUT:-/tmp/h3_gpu}"; CARRY="${CARRY:-../.whl}"
. benchmarks/_gpu_env.sh   # el, $SITE (comfy-kitchen 0.2.40, fa3-fwd), PYTHONPATH
D="$OUT/e2eapx"; mkdir -p "$D"
DEV="${E2E_DEVICE:-cuda}"; read -r -a GEOM <<< "${E2E_GEOM:-}"   # a CPU dry run: E2E_DEVICE=cpu E2E_GEOM="--width 96 --height 64 --frames 22"
el "e2eapx: start"
timeout 60 python3 -c "import torch, comfy_kitchen as ck; print('torch', torch.__version__, torch.cuda.get_device_name(), 'sol', ck.sol_attn_is_available())" 2>&1 | tee "$D/env.txt"

# ---- what can run here
if timeout 60 python3 -c "import sageattention as s, sys; sys.exit(0 if hasattr(s, 'sageattn_qk_int8_pv_fp8_cuda') else 1)" >/dev/null 2>&1; then
  SAGE=1; el "sage2: importable (SageAttention 2)"
else
  SAGE=0; el "sage2: SKIPPED, 'import sageattention' (SageAttention 2) fails here; kj_head_sliced (inner sage2) skipped too"
  export H3_SOL_FALLBACK=fa3   # sol_attn's short calls (the token refiner, 64 tokens) need an available fallback
  el "sol_attn: H3_SOL_FALLBACK=fa3 for its short calls (default sage2 unavailable)"
fi
PATHS="ck_int8,sol_attn"
[ "$SAGE" = 1 ] && PATHS="sage2,$PATHS,kj_head_sliced"
if timeout 60 python3 -c "from h3direct.dit.attention import backends; import sys; sys.exit(0 if 'fa3_fp8' in backends() else 1)" 2>/dev/null; then
  PATHS="$PATHS,fa3_fp8"
else el "fa3_fp8: not registered in this h3direct, skipped"; fi
if timeout 60 python3 -m h3direct generate --help 2>/dev/null | grep -q -- "--fp8-linear"; then
  PATHS="$PATHS,fp8_linear"
else el "fp8_linear: generate has no --fp8-linear here, skipped"; fi
DITARGS=(); STRUCT="random"
if timeout 60 python3 -m h3direct make-checkpoint --help 2>/dev/null | grep -q -- "--attention-structure"; then
  DITARGS=(--dit-arg=--attention-structure --dit-arg=local); STRUCT="local"
fi
el "paths: $PATHS; DiT attention structure: $STRUCT"

# ---- 1. model folders
for w in bf16 nvfp4; do
  timeout 90 python3 benchmarks/e2e_frames.py build --out "$D/m_$w" --weights "$w" "${DITARGS[@]}" "${GEOM[@]}" \
    > "$D/build_$w.log" 2>&1 || el "build $w FAILED: $(tail -2 "$D/build_$w.log")"
  el "$(tail -1 "$D/build_$w.log")"
done
MODELS=(); for w in bf16 nvfp4; do [ -f "$D/m_$w/e2e.json" ] && MODELS+=(--model "$D/m_$w"); done

# ---- 2. the comparison, every approximate path vs fa3
if [ ${#MODELS[@]} -gt 0 ]; then
  timeout 170 python3 benchmarks/e2e_frames.py compare "${MODELS[@]}" --device "$DEV" --paths "$PATHS" --repeats 2,1 \
    --out "$D/e2e_frames.json" > "$D/compare.log" 2>&1
  el "compare exit $?"
fi

# ---- 3. the pytest gate on the GPU (one model; skipped when the time is short)
gate() {  # gate NAME TABLE LABEL
  local extra=(); [ "$2" != "budgets.toml" ] && extra=(--budgets "$2")
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_e2e_frames.py -k vs_exact \
    --device "$DEV" --attention "$1" --e2e-model "$D/m_bf16" --parity-report "$D/report_$3" "${extra[@]}" \
    > "$D/gate_$3.log" 2>&1
  el "pytest gate $1 ($2): $(tail -1 "$D/gate_$3.log") $(grep -m1 -o 'no calibrated budget[^;]*' "$D/gate_$3.log")"
}
if [ -f "$D/m_bf16/e2e.json" ] && [ $(( $(date +%s) - T0 )) -lt 190 ]; then
  gate sol_attn benchmarks/calibration_budgets.toml sol_cal
  gate ck_int8 budgets.toml ck_real
else el "pytest gate: skipped (no model or out of time)"; fi

# ---- summary
echo; echo "===== e2eapx summary (exact reference vs each approximate path, decoded frames) ====="
grep -E "^\[e2e_" "$D/compare.log" 2>/dev/null || { echo "(compare produced no lines)"; tail -20 "$D/compare.log" 2>/dev/null; }
echo; sed -n '/# proposed e2e frames entries/,$p' "$D/compare.log" 2>/dev/null
el "e2eapx: done"
