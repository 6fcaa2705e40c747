#!/usr/bin/env bash
# One H200 call (expected ~1.5-2.5 min, capped at TGEMM_BUDGET_S = 230 s; every step under its own timeout): can a Triton
# GEMM (h3direct/dit/gemm_triton.py) match cuBLAS on the block's four shapes (M 20,050, bf16) while fusing the
# elementwise work after it? benchmarks/tgemm_bench.py, one process per shape (a crash costs one shape only):
#   (i)  compile: the four shapes' sweeps (7 configs, 5 distinct binaries) and fused variants compiled in parallel (--compile-only; fills
#        Triton's cache, so the timing runs measure, not compile); ~40-60 s
#   (ii) per shape, in turn: cuBLAS vs the sweep (ms, TFLOP/s, rel-L2 vs fp64), then the fused epilogue vs
#        cuBLAS + our separate fused kernel: fc1 + SwiGLU, out / fc2 + gated residual, qkv + q/k norm + rope (gather
#        and paired-rows variants); ~20 s each
# Results under $OUT/tgemm/ (a JSON and a log per shape); the summary table at the end.
#
#   OUT=/tmp/out CARRY=../.whl bash benchmarks/gpu_tgemm.sh      # from the repository root
set -u
OUT="${OUT:-/tmp/h3_gpu}"; CARRY="${CARRY:-../.whl}"
. benchmarks/_gpu_env.sh   # el, step, $SITE, PYTHONPATH
R="$OUT/tgemm"; mkdir -p "$R"
BUDGET="${TGEMM_BUDGET_S:-230}"
export TRITON_CACHE_DIR=/tmp/h3_tgemm_triton_cache
DEV="${TGEMM_DEVICE:-cuda}"   # cpu: a dry run of this script in Triton's interpreter (tiny shapes)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee "$R/env.txt"

# (i) compile everything, the four shapes at once (CPU-bound: ptxas per kernel)
for part in qkv out fc1 fc2; do
  step 100 python3 benchmarks/tgemm_bench.py --part $part --device "$DEV" --compile-only --out "$R/compile_$part.json" \
    > "$R/compile_$part.log" 2>&1 &
done
wait
el "compile phase done"
grep -h "ERROR" "$R"/compile_*.log | cut -c1-220

# (ii) time, one shape at a time
for part in fc1 qkv out fc2; do
  step 50 python3 benchmarks/tgemm_bench.py --part $part --device "$DEV" --out "$R/$part.json" > "$R/$part.log" 2>&1
  el "$part exit $?"; tail -3 "$R/$part.log" | cut -c1-220
done

python3 benchmarks/tgemm_bench.py --summary "$R" 2>&1 | tee "$R/summary.txt"
el "done"
