#!/usr/bin/env bash
# One H200 call (~1.5 min): the exact path as merged (Triton NVFP4 dequantization, tuned fused kernels with the
# residual+norm2 kernel, cached step invariants) through the real gate: the CUDA tests of the new kernels, then
# `pytest -m parity --device cuda` for fa3 and cudnn_sdpa on the committed fixtures (fixtures/, fixtures/gpu/) with
# parity_tests/budgets.toml. Results under $OUT/gate3/.
set -u
OUT="${OUT:-/tmp/h3_gate3}/gate3"; mkdir -p "$OUT"; CARRY="${CARRY:-.whl}"
BUDGET=${BUDGET:-150}
. benchmarks/_gpu_env.sh
step 60 python3 -m pytest -q -p no:cacheprovider tests/test_nvfp4_triton.py tests/test_fused_gpu.py -k "cuda or gpu" \
  > "$OUT/cuda_tests.log" 2>&1; el "CUDA kernel tests exit $?"; tail -3 "$OUT/cuda_tests.log"
for b in fa3 cudnn_sdpa; do
  step 60 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py --device cuda \
    --attention "$b" --parity-report "$OUT/gate_$b" > "$OUT/gate_$b.log" 2>&1
  el "gate $b exit $?"; tail -3 "$OUT/gate_$b.log"
done
