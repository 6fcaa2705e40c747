#!/usr/bin/env bash
# One H200 call: the exact path's speed options (FA3 attention, fused adaLN elementwise kernels vs H3_FUSED=0), each gated first
# (pytest -m parity --device cuda, committed budgets), then timed (bench_dit, median of 5) and profiled (one step).
set -u
OUT="${OUT:-/tmp/h3_speed}"; mkdir -p "$OUT"; CARRY="${CARRY:-../.whl}"
. benchmarks/_gpu_env.sh   # el, $SITE (comfy-kitchen, fa3), PYTHONPATH, pack_results
timeout 200 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py \
  --device cuda --attention fa3 --parity-report "$OUT/gate_fa3_fused" > "$OUT/gate_fa3_fused.log" 2>&1
el "gate fa3 + fused elementwise: $(tail -1 "$OUT/gate_fa3_fused.log")"
for mode in eager fused; do
  c=0; [ $mode = fused ] && c=1
  H3_FUSED=$c timeout 170 python3 benchmarks/bench_dit.py --preset full --device cuda --weights nvfp4 \
    --attention fa3 --steps 5 --no-kernels --out "$OUT/bench_fa3_$mode.json" > "$OUT/bench_fa3_$mode.log" 2>&1
  el "bench fa3 $mode: $(grep -m1 'nvfp4/fa3:' "$OUT/bench_fa3_$mode.log")"
  H3_FUSED=$c timeout 120 python3 benchmarks/profile_dit.py --attention fa3 --weights nvfp4 --top 15 \
    > "$OUT/profile_fa3_$mode.log" 2>&1
  el "profile fa3 $mode"; tail -14 "$OUT/profile_fa3_$mode.log"
done
el done
pack_results
