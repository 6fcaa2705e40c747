#!/usr/bin/env bash
# One H200 call (~2.5 min): torch.compile of a DiT block vs the Triton fused kernels vs eager, full-size NVFP4 model,
# fa3 (benchmarks/compile_block.py). Results under $OUT/compile/.
set -u
OUT="${OUT:-/tmp/h3_compile}/compile"; mkdir -p "$OUT"; CARRY="${CARRY:-.whl}"
BUDGET=${BUDGET:-210}
. benchmarks/_gpu_env.sh
step 200 python3 benchmarks/compile_block.py --attention fa3 --steps 3 --modes "${COMPILE_MODES:-default}" > "$OUT/compile.log" 2>&1
el "compile_block exit $?"; tail -8 "$OUT/compile.log"
