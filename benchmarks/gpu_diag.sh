#!/usr/bin/env bash
# One H200 call (~2.5 min): is the exact step power bound? Sustained vs cool GEMM and attention rates
# (benchmarks/diag_sustained.py, which samples clock and power meanwhile) with NVFP4-rounded and plain bf16 weights,
# fa3 and cuDNN attention. (DIAG_PROFILE=1 also profiles one exact step.)
set -u
OUT="${OUT:-/tmp/h3_diag}/diag"; mkdir -p "$OUT"; CARRY="${CARRY:-.whl}"
BUDGET=${BUDGET:-230}
. benchmarks/_gpu_env.sh
for spec in fa3:nvfp4 fa3:random cudnn_sdpa:nvfp4; do
  step 70 python3 benchmarks/diag_sustained.py --seconds 15 --attention "${spec%%:*}" --weights "${spec#*:}" 2>&1 \
    | tee "$OUT/sustained_${spec/:/_}.log" | tail -9
  el "sustained $spec done"
done
if [ "${DIAG_PROFILE:-0}" = 1 ]; then
  step 100 python3 benchmarks/profile_dit.py --attention fa3 --weights nvfp4 --top 30 > "$OUT/profile_exact.log" 2>&1
  el "profile exact"; sed -n '/by category/,$p' "$OUT/profile_exact.log"
fi
