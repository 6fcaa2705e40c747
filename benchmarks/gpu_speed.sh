#!/usr/bin/env bash
# One H200 call: the exact path's speed options (FA3 attention, compiled adaLN elementwise work), each gated first
# (pytest -m parity --device cuda, committed budgets), then timed (bench_dit, median of 5) and profiled (one step).
set -u
OUT="${OUT:-/tmp/h3_speed}"; mkdir -p "$OUT"; CARRY="${CARRY:-../.whl}"
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
SITE=/tmp/h3site; mkdir -p "$SITE"
tar xJf "$CARRY/ck0240.tar.xz" -C "$SITE" && tar xJf "$CARRY/fa3.tar.xz" -C "$SITE" || exit 3
export PYTHONPATH="$PWD:$SITE"
H3_COMPILE_ELEMENTWISE=1 timeout 200 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py \
  --device cuda --attention fa3 --parity-report "$OUT/gate_fa3_compiled" > "$OUT/gate_fa3_compiled.log" 2>&1
el "gate fa3 + compiled elementwise: $(tail -1 "$OUT/gate_fa3_compiled.log")"
for mode in eager compiled; do
  c=0; [ $mode = compiled ] && c=1
  H3_COMPILE_ELEMENTWISE=$c timeout 170 python3 benchmarks/bench_dit.py --preset full --device cuda --weights nvfp4 \
    --attention fa3 --steps 5 --no-kernels --out "$OUT/bench_fa3_$mode.json" > "$OUT/bench_fa3_$mode.log" 2>&1
  el "bench fa3 $mode: $(grep -m1 'nvfp4/fa3:' "$OUT/bench_fa3_$mode.log")"
  H3_COMPILE_ELEMENTWISE=$c timeout 120 python3 benchmarks/profile_dit.py --attention fa3 --weights nvfp4 --top 15 \
    > "$OUT/profile_fa3_$mode.log" 2>&1
  el "profile fa3 $mode"; tail -14 "$OUT/profile_fa3_$mode.log"
done
el done
cd "$OUT" && tar czf results.tgz --exclude=results.tgz ./* && find . -mindepth 1 -maxdepth 1 ! -name results.tgz -exec rm -rf {} +
