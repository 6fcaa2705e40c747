#!/usr/bin/env bash
# Ulysses sequence parallelism on 2 GPUs of one host: a correctness check on the GPUs (a fixture case traced by
# `h3direct trace` on 1 and 2 ranks, gated against ComfyUI's fp32 trace and against each other), then
# benchmarks/bench_sp.py (S = 20,050 and 38,974, 1 and 2 GPUs). ~4-6 min on two H200s.
#
#   bash benchmarks/run_sp_h200x2.sh          # from the repository root; results under $OUT
#
# Knobs: OUT, PYTHON, FIXTURES (folder of the fixture case; default fixtures), BENCH_ARGS, BENCH_TIMEOUT (hard,
# s), BENCH_BUDGET (soft). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 & co.).
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-${TMPDIR:-/tmp}/h3direct_sp}"
export OUT
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
PY="${PYTHON:-python3}"
FIX="${FIXTURES:-fixtures}"
{
  echo "start $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  nvidia-smi topo -m
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
} 2>&1 | tee "$OUT/env.log"

{
  for n in 1 2; do
    timeout 180 "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" -m h3direct trace --device cuda \
      --checkpoint "$FIX/h3_fx_bf16.safetensors" --inputs "$FIX/inputs_fx_ref2va.safetensors" --compute-dtype fp32 \
      --out "$OUT/trace_x$n.safetensors" || echo "trace x$n failed: $?"
  done
  timeout 120 "$PY" benchmarks/check_sp.py --comfy "$FIX/trace_fx_bf16_ref2va_fp32.safetensors" \
    --ours "$OUT/trace_x2.safetensors" --single "$OUT/trace_x1.safetensors" --out "$OUT/check_sp.json" \
    || echo "check_sp: exit $?"
} 2>&1 | tee "$OUT/check_sp.log"
rm -f "$OUT"/trace_x*.safetensors "$OUT"/trace_x*.json  # keep the returned files few

# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-400}" "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_sp.py \
  --budget-seconds "${BENCH_BUDGET:-330}" --out "$OUT/bench_sp.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_sp.log"
echo "end $(date -u +%FT%TZ)" | tee -a "$OUT/env.log"
