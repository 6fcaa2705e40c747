#!/usr/bin/env bash
# One H200 step for the `fa3_fp8` attention backend (FA3's FP8 e4m3 forward, per-head scales, K/V smoothing):
#   1. benchmarks/check_fa3fp8.py: Triton quantizer vs torch (bitwise) on the DiT layout; FA3 FP8 kernel vs the torch
#      emulation at head_dim 32/64/128 (batch 2); at [1, 56, 20,050, 128] rel-L2 vs fp32 of each variant
#      (structured + random), kernel vs emulation, ms per call (fa3 bf16, each variant, kernel alone, quantize alone);
#   2. benchmarks/attention_kernels.py --backends fa3,fa3_fp8 (the table's rows, + H3_FP8_ATTN_SMOOTH_V=0);
#   3. the parity gate on the committed fixtures (head_dim 32 in fixtures/, 128 in fixtures/gpu) with
#      benchmarks/calibration_budgets.toml (every metric recorded; summary by calibration_summary.py), then
#      H3_FP8_ATTN_STRICT=1 on the teacher cases (every call must run the FP8 kernel) and the call counts;
#   4. bench_dit.py --preset full --weights nvfp4 --attention fa3_fp8 --steps 5 (s/step).
# Expected wall time on the H200: ~3.5 min (1: ~50 s, 2: ~40 s, 3: ~70 s, 4: ~70 s); each step has its own timeout.
#
#   OUT=/tmp/o CARRY=../.whl bash benchmarks/gpu_fa3fp8.sh     # from the repository root
#   PARTS="check kernels gate bench" (default: all), BENCH_ATTN=fa3_fp8 (comma list, e.g. fa3,fa3_fp8)
set -u
OUT="${OUT:-/tmp/h3_gpu}"
CARRY="${CARRY:-../.whl}"
PARTS="${PARTS:-check kernels gate bench}"
. benchmarks/_gpu_env.sh   # el, $SITE (comfy-kitchen, fa3), PYTHONPATH
O="$OUT/fa3fp8"; mkdir -p "$O"
python3 -c "import torch, fa3_fwd_interface; print('torch', torch.__version__, 'cap', torch.cuda.get_device_capability())" \
  2>&1 | tee "$O/env.txt"

case " $PARTS " in *" check "*)
  timeout 100 python3 benchmarks/check_fa3fp8.py --iters 5 --out "$O/check.json" > "$O/check.log" 2>&1
  el "check_fa3fp8 exit $?"
;; esac
case " $PARTS " in *" kernels "*)
  timeout 80 python3 benchmarks/attention_kernels.py --device cuda --backends fa3,fa3_fp8 --iters 5 \
    --out "$O/attn_kernels.json" > "$O/attn_kernels.log" 2>&1
  el "attention_kernels exit $?"
;; esac
case " $PARTS " in *" gate "*)
  timeout 110 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py --device cuda \
    --attention fa3_fp8 --budgets benchmarks/calibration_budgets.toml --parity-report "$O/cal_fa3_fp8" \
    > "$O/cal_fa3_fp8.log" 2>&1
  el "calibration fa3_fp8 exit $?: $(tail -1 "$O/cal_fa3_fp8.log")"
  timeout 30 python3 benchmarks/calibration_summary.py "$O/cal_fa3_fp8" > "$O/cal_summary.txt" 2>&1
  H3_FP8_ATTN_STRICT=1 timeout 60 python3 -m pytest -q -x -p no:cacheprovider -m parity \
    parity_tests/test_dit_parity.py --device cuda --attention fa3_fp8 -k teacher \
    --budgets benchmarks/calibration_budgets.toml > "$O/strict.log" 2>&1
  el "strict (H3_FP8_ATTN_STRICT=1, teacher cases) exit $?: $(tail -1 "$O/strict.log")"
;; esac
case " $PARTS " in *" bench "*)
  timeout 130 python3 benchmarks/bench_dit.py --preset full --device cuda --weights nvfp4 \
    --attention "${BENCH_ATTN:-fa3_fp8}" --steps 5 --no-kernels --out "$O/bench_dit.json" > "$O/bench_dit.log" 2>&1
  el "bench_dit exit $?"
;; esac

echo "==================== fa3_fp8 summary ===================="
cat "$O/env.txt"
echo "--- check_fa3fp8 (kernel vs emulation; rel-L2 vs fp32; ms/call at [1, 56, S, 128])"
grep -E "^(quantizer|heads|full)|FAILED" "$O/check.log" 2>/dev/null || tail -5 "$O/check.log" 2>/dev/null
echo "--- attention_kernels (structured + random, ms/call)"
grep -E "^(fa3|fa3_fp8) " "$O/attn_kernels.log" 2>/dev/null || tail -5 "$O/attn_kernels.log" 2>/dev/null
echo "--- parity calibration (fixtures; numbers for the fa3_fp8 entries of parity_tests/budgets.toml)"
tail -1 "$O/cal_fa3_fp8.log" 2>/dev/null
cat "$O/cal_summary.txt" 2>/dev/null | head -40
echo "attention calls (kernel vs fallback), first cases:"; grep -h "fa3_fp8: " "$O"/cal_fa3_fp8/*.md 2>/dev/null | head -6
echo "--- strict: $(tail -1 "$O/strict.log" 2>/dev/null) $(grep -m1 -o "H3_FP8_ATTN_STRICT=1 forbids it[^\"]*" "$O/strict.log" 2>/dev/null)"
echo "--- bench_dit (s/step)"
grep -E "fa3|s/step|error|Error" "$O/bench_dit.log" 2>/dev/null | tail -8
el "fa3fp8 done"
