#!/usr/bin/env bash
# One H200 call (expected ~2.5 min; steps capped at DEQ2_BUDGET_S = 170 s in all, each under its own timeout):
# the Triton NVFP4 -> dense dequantization (h3direct/checkpoint/quant/nvfp4_triton.py), now the CUDA default of
# nvfp4.dequantize_nvfp4 (H3_NVFP4_DEQUANT=triton|kitchen|torch picks another).
#   (i)   pytest tests/test_nvfp4_triton.py -k cuda: the compiled kernel on random storage, bitwise the CPU torch path
#         (bf16, fp16, fp32)
#   (ii)  benchmarks/check_dequant.py at the four block-linear shapes (qkv 21504x5376, out 5376x7168, fc1 28672x5376,
#         fc2 5376x14336): Triton vs comfy-kitchen vs torch path bitwise (bf16/fp16/fp32, quantized + random
#         storage, `out` also vs the CPU torch path); bf16 ms and GB/s of comfy-kitchen, the torch path, each Triton
#         config and a device copy of the same bytes; best config; per step (x 50 blocks). Target ~12-15 ms/step
#         (comfy-kitchen: ~48 ms)
#   (iii) if >= 75 s are left: bench_dit.py full preset, nvfp4 W4A16, fa3, 3 steps, with the new default (Triton
#         dequantization): s/step (was 2.07-2.11 with comfy-kitchen's kernel)
# Results under $OUT/deq2/; a summary at the end.
#
#   OUT=/tmp/out CARRY=../.whl bash benchmarks/gpu_deq2.sh      # from the repository root
set -u
OUT="${OUT:-/tmp/h3_gpu}"; CARRY="${CARRY:-../.whl}"
. benchmarks/_gpu_env.sh   # el, step, $SITE (comfy-kitchen, fa3), PYTHONPATH
R="$OUT/deq2"; mkdir -p "$R"
BUDGET="${DEQ2_BUDGET_S:-170}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee "$R/env.txt"

# (i) compiled kernel vs the CPU torch path, small shapes
step 40 python3 -m pytest -q -p no:cacheprovider tests/test_nvfp4_triton.py -k cuda -rs > "$R/pytest.log" 2>&1
el "pytest test_nvfp4_triton -k cuda exit $?: $(tail -1 "$R/pytest.log")"
grep -E "^FAILED|Error" "$R/pytest.log" | head -5

# (ii) bitwise + speed at the block shapes
step 120 python3 benchmarks/check_dequant.py --device cuda --iters 20 --out "$R/check_dequant.json" \
  > "$R/check_dequant.log" 2>&1
el "check_dequant exit $? (0: all bitwise equal)"

# (iii) one DiT step time with the new default, if time is left
left=$(( BUDGET - ($(date +%s) - T0) ))
if [ "$left" -ge 75 ]; then
  step 75 python3 benchmarks/bench_dit.py --preset full --device cuda --weights nvfp4 --attention fa3 --steps 3 \
    --no-kernels --out "$R/bench_triton.json" > "$R/bench_triton.log" 2>&1
  el "bench fa3, Triton dequantization, exit $?: $(grep -m1 'nvfp4/fa3: .*s/step' "$R/bench_triton.log")"
else
  el "bench_dit skipped: only ${left}s of the budget left"
fi

# ---- summary
echo; echo "== summary (deq2)"
if grep -q "^== NVFP4" "$R/check_dequant.log" 2>/dev/null; then sed -n '/^== NVFP4/,$p' "$R/check_dequant.log"
else echo "  (no check_dequant table: see $R/check_dequant.log)"; fi
grep -E "MISMATCH|Error|Traceback" "$R/check_dequant.log" | head -8
echo "  pytest (compiled kernel vs CPU torch path): $(tail -1 "$R/pytest.log" 2>/dev/null)"
[ -f "$R/bench_triton.log" ] && echo "  DiT step with Triton dequantization: $(grep -m1 'nvfp4/fa3: .*s/step' "$R/bench_triton.log")"
el "done"
