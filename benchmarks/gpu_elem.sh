#!/usr/bin/env bash
# One H200 call (expected ~2-2.5 min; steps capped at ELEM_BUDGET_S = 180 s in all, each under its own timeout):
# the launch configs of the fused elementwise kernels (h3direct/dit/fused.py: LAUNCH / SWEEP) at the full shape
# (S 20,050, hidden 5376, ffn 14336, 56 heads x 128, bf16).
#   (i)   benchmarks/elem_sweep.py: every config of every kernel timed (ms, GB/s, fraction of the measured copy
#         bandwidth and of 4.8 TB/s), bits compared across configs, the best config per kernel (to paste into
#         fused.LAUNCH), old vs new ms per kernel and the per-step total (x50 / x100 calls); the fused
#         residual + norm2 + modulation kernel bitwise against gated_residual_ then norm_modulate
#   (ii)  pytest tests/test_fused_gpu.py (SwiGLU bitwise vs eager; adaLN / rope kernels within one bf16 rounding of
#         fp64; residual+norm bitwise for every config)
#   (iii) benchmarks/check_fused.py at the full shape (fused vs eager vs fp64, comfy-kitchen's rope beside ours)
# Results under $OUT/elem/; a summary at the end.
#
#   OUT=/tmp/out CARRY=../.whl bash benchmarks/gpu_elem.sh      # from the repository root
set -u
OUT="${OUT:-/tmp/h3_gpu}"; CARRY="${CARRY:-../.whl}"
. benchmarks/_gpu_env.sh   # el, step, $SITE (comfy-kitchen, fa3), PYTHONPATH
R="$OUT/elem"; mkdir -p "$R"
BUDGET="${ELEM_BUDGET_S:-180}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee "$R/env.txt"

# (i) the sweep
step 120 python3 benchmarks/elem_sweep.py --device cuda --out "$R/sweep.json" > "$R/sweep.log" 2>&1
el "elem_sweep exit $?"

# (ii) GPU tests of the kernels
step 45 python3 -m pytest -q -p no:cacheprovider tests/test_fused_gpu.py > "$R/pytest_fused_gpu.log" 2>&1
el "pytest tests/test_fused_gpu.py: $(tail -1 "$R/pytest_fused_gpu.log")"
grep -E "^FAILED|^E  " "$R/pytest_fused_gpu.log" | head -8

# (iii) quality of the defaults vs fp64 / eager
step 45 python3 benchmarks/check_fused.py --device cuda --out "$R/check_fused.json" > "$R/check_fused.log" 2>&1
el "check_fused exit $?"; grep -E "norm_modulate|gated_residual|swiglu|qk_norm_rope|fused kernels" "$R/check_fused.log"

# ---- summary
echo; echo "== elem_sweep (full log: $R/sweep.log)"
grep -E "^device|^== |  best |fp32 sum|before this branch|DIFFERENT|Error|^  (qk_norm_rope|swiglu|norm_modulate|gated_residual|residual_norm_modulate) +old|per step|^residual|paste|^    '|elem_sweep:" \
  "$R/sweep.log" | tee "$R/summary.txt"
el "done"
