#!/usr/bin/env bash
# One H200 call (expected ~6-7 min; PROFILE_APPROX=0 skips the approximate path's profile): the seed's benchmark contract with ComfyUI timed in the same run, before and after
# h3direct (its own loader and sampler, same synthetic weights and workload), `benchmarks.compare` on the result, and one profiled step of the
# exact and of the approximate path (what is left above the floor). Results under $OUT/contract/.
#
#   OUT=... CARRY=.whl bash benchmarks/gpu_contract.sh     # $CARRY: ck0240.tar.xz, fa3.tar.xz, comfy.tar.xz + wheels
set -u
OUT="${OUT:-/tmp/h3_contract}/contract"; mkdir -p "$OUT"; CARRY="${CARRY:-.whl}"
CONTRACT=benchmarks/ref2va-960x544-124f.json
. benchmarks/_gpu_env.sh
comfy=""; if [ -f "$CARRY/comfy.tar.xz" ] && unpack_comfy; then comfy="--comfy-root /tmp/comfy"
else echo "no ComfyUI in $CARRY: the result will say 'no same-run ComfyUI'"; fi
python3 -c "import torch, comfy_kitchen as ck; print('torch', torch.__version__, 'comfy-kitchen', ck.__version__)" \
  2>&1 | tee "$OUT/env.txt"
# shellcheck disable=SC2086
timeout "${CONTRACT_TIMEOUT:-420}" python3 -m benchmarks.run_contract --contract "$CONTRACT" \
  --out "$OUT/contract_result.json" $comfy > "$OUT/contract.log" 2>&1
el "run_contract exit $?"; tail -12 "$OUT/contract.log"
python3 -m benchmarks.compare --contract "$CONTRACT" --result "$OUT/contract_result.json" 2>&1 | tee "$OUT/compare.log"
timeout 90 python3 benchmarks/profile_dit.py --attention fa3 --weights nvfp4 --top 12 > "$OUT/profile_exact.log" 2>&1
el "profile exact"; sed -n '/by category/,$p' "$OUT/profile_exact.log"
[ "${PROFILE_APPROX:-1}" = 0 ] && exit 0
timeout 90 python3 benchmarks/profile_dit.py --attention fa3_fp8 --weights nvfp4 --fp8-linear stream --top 12 \
  > "$OUT/profile_approximate.log" 2>&1
el "profile approximate"; sed -n '/by category/,$p' "$OUT/profile_approximate.log"
