#!/usr/bin/env bash
# One command for the H200: DiT step benchmark, VAE benchmark, one end-to-end generation, then a summary.
# Worst case ~9 min (hard per-part timeouts 290 + 100 + 140 s); typically ~4-5 min.
#
#   bash benchmarks/run_h200.sh                 # from the repository root; results under $OUT (default /tmp/h3direct_bench)
#
# Knobs (environment): PRESET (full), DEVICE (cuda), DIT_ARGS / VAE_ARGS / GEN_ARGS (extra flags per part),
# DIT_TIMEOUT / VAE_TIMEOUT / GEN_TIMEOUT (hard kill, s), DIT_BUDGET / VAE_BUDGET / GEN_BUDGET (soft: remaining
# configurations are skipped once spent). Each part writes <part>.json (incrementally) and <part>.log under $OUT;
# a failing or killed part never stops the next one.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-${TMPDIR:-/tmp}/h3direct_bench}"
export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
PY="${PYTHON:-python3}"
PRESET="${PRESET:-full}"
DEVICE="${DEVICE:-cuda}"
DIT_TIMEOUT="${DIT_TIMEOUT:-290}"; DIT_BUDGET="${DIT_BUDGET:-230}"
VAE_TIMEOUT="${VAE_TIMEOUT:-100}"; VAE_BUDGET="${VAE_BUDGET:-75}"
GEN_TIMEOUT="${GEN_TIMEOUT:-140}"; GEN_BUDGET="${GEN_BUDGET:-115}"

T0=$(date +%s)
{
  echo "start $(date -u +%FT%TZ)  preset=$PRESET device=$DEVICE"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,power.limit --format=csv
  "$PY" -c "import torch,sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.log"

part() {  # part NAME TIMEOUT CMD...
  local name="$1" limit="$2"; shift 2
  local t=$(date +%s)
  echo; echo "===== $name (hard limit ${limit}s) ====="
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "===== $name: exit $rc after $(( $(date +%s) - t ))s (total $(( $(date +%s) - T0 ))s) ====="
  [ "$rc" = 124 ] && echo "!!! $name was killed at its ${limit}s limit; its JSON holds what finished"
}

# shellcheck disable=SC2086
part bench_dit "$DIT_TIMEOUT" "$PY" benchmarks/bench_dit.py --preset "$PRESET" --device "$DEVICE" \
  --budget-seconds "$DIT_BUDGET" ${DIT_ARGS:-}
# shellcheck disable=SC2086
part bench_vae "$VAE_TIMEOUT" "$PY" benchmarks/bench_vae.py --preset "$PRESET" --device "$DEVICE" \
  --budget-seconds "$VAE_BUDGET" ${VAE_ARGS:-}
# shellcheck disable=SC2086
part bench_generate "$GEN_TIMEOUT" "$PY" benchmarks/bench_generate.py --preset "$PRESET" --device "$DEVICE" \
  --budget-seconds "$GEN_BUDGET" ${GEN_ARGS:-}

echo
"$PY" benchmarks/summarize.py "$OUT" 2>&1 | tee "$OUT/summary.log"
echo "total $(( $(date +%s) - T0 ))s; results in $OUT"
