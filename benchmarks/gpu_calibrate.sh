#!/usr/bin/env bash
# One H200 call: per-backend parity-gate calibration on the committed fixtures, the attention kernels at S = 20,050
# (time, error vs fp32 on structured and random inputs, profiler kernel names), SageAttention 2 built from source
# meanwhile, then the DiT step benchmark (exact: cuDNN vs FA3). Results under $OUT.
#
#   bash benchmarks/gpu_calibrate.sh        # from the repository root; wheels/sources in $CARRY (default ../.whl)
#
# $CARRY holds: ck0240.tar.xz (comfy-kitchen 0.2.40 cp312 wheel contents, hip backend removed), fa3.tar.xz
# (fa3-fwd 0.0.3 wheel contents), sage-src.tar.xz (SageAttention at tools/build_sageattention.sh's revision).
set -u
OUT="${OUT:-/tmp/h3_gpu}"; mkdir -p "$OUT"
CARRY="${CARRY:-../.whl}"
PARTS="${PARTS:-gate kernels sage bench}"   # also: solk (sol_attn kernel at S = 20,050), contract
. benchmarks/_gpu_env.sh   # el, $SITE (comfy-kitchen, fa3), PYTHONPATH, unpack_comfy, pack_results
[ -f "$CARRY/comfy.tar.xz" ] && unpack_comfy  # ComfyUI for the same-run timing
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, comfy_kitchen as ck, fa3_fwd_interface; print('torch', torch.__version__, 'sol', ck.sol_attn_is_available())" 2>&1 | tee -a "$OUT/env.txt"

# SageAttention 2: build in the background while the GPU does the rest
mkdir -p /tmp/sage && tar xJf "$CARRY/sage-src.tar.xz" -C /tmp/sage
setsid bash tools/build_sageattention.sh --arch 9.0a --src /tmp/sage/SageAttention --out /tmp/sagewhl \
  > "$OUT/sage_build.log" 2>&1 < /dev/null &
BUILD=$!

gate() {  # gate BACKEND [LABEL]: calibration pass (all metrics) + the real gate (budgets.toml)
  local b="$1" label="${2:-$1}"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py --device cuda \
    --attention "$b" --budgets benchmarks/calibration_budgets.toml --parity-report "$OUT/cal_$label" \
    > "$OUT/cal_$label.log" 2>&1
  el "calibration $label: $(tail -1 "$OUT/cal_$label.log")"
  [ "${GATE_REAL:-0}" = 1 ] || return 0
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py \
    parity_tests/test_attention_backends.py --device cuda --attention "$b" --parity-report "$OUT/gate_$label" \
    > "$OUT/gate_$label.log" 2>&1
  el "gate $label: $(tail -1 "$OUT/gate_$label.log")"
}

case " $PARTS " in *" gate "*)
  for b in sdpa cudnn_sdpa fa3 ck_int8; do gate "$b"; done
  H3_HEAD_SLICE_BACKEND=cudnn_sdpa gate kj_head_sliced kj_cudnn
  H3_SOL_FALLBACK=cudnn_sdpa gate sol_attn sol_fb_cudnn
  H3_SOL_STRICT=1 timeout 100 python3 -m pytest -q -x -p no:cacheprovider -m parity parity_tests/test_dit_parity.py \
    --device cuda --attention sol_attn -k "teacher" > "$OUT/strict_sol.log" 2>&1
  el "sol_attn strict on the fixtures (head_dim 32 -> must fail): $(grep -m1 -o "H3_SOL_STRICT=1 forbids it" "$OUT/strict_sol.log") $(tail -1 "$OUT/strict_sol.log")"
;; esac
case " $PARTS " in *" solk "*)
  H3_SOL_FALLBACK=cudnn_sdpa timeout 150 python3 benchmarks/attention_kernels.py --device cuda --backends sol_attn \
    --sol-taus 1.0,2.0 --out "$OUT/attn_kernels_sol.json" 2>&1 | tee "$OUT/attn_kernels_sol.log"
;; esac
case " $PARTS " in *" kernels "*)
  timeout 150 python3 benchmarks/attention_kernels.py --device cuda --backends sdpa,cudnn_sdpa,fa3,ck_int8,sol_attn \
    --out "$OUT/attn_kernels.json" 2>&1 | tee "$OUT/attn_kernels.log"
;; esac
case " $PARTS " in *" sage "*)
  el "waiting for the SageAttention build"; wait $BUILD; el "build exit $? ; $(tail -2 "$OUT/sage_build.log")"
  if ls /tmp/sagewhl/sageattention-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --no-index --target "$SITE" /tmp/sagewhl/sageattention-*.whl
    gate sage2
    H3_HEAD_SLICE_BACKEND=sage2 gate kj_head_sliced kj_sage2
    gate sol_attn sol_fb_sage2
    [ "${SAGE_KERNELS:-1}" = 1 ] && timeout 120 python3 benchmarks/attention_kernels.py --device cuda \
      --backends sage2,kj_head_sliced --sol-taus "" --out "$OUT/attn_kernels_sage.json" 2>&1 | tee "$OUT/attn_kernels_sage.log"
  fi
;; esac
case " $PARTS " in *" contract "*)
  comfy=""; [ -d /tmp/comfy/comfy ] && comfy="--comfy-root /tmp/comfy"
  # shellcheck disable=SC2086
  timeout ${CONTRACT_TIMEOUT:-240} python3 -m benchmarks.run_contract --contract benchmarks/ref2va-960x544-124f.json \
    --out "$OUT/contract_result.json" $comfy > "$OUT/contract.log" 2>&1
  el "run_contract exit $?"; tail -6 "$OUT/contract.log"
  python3 -m benchmarks.compare --contract benchmarks/ref2va-960x544-124f.json --result "$OUT/contract_result.json" \
    2>&1 | tee "$OUT/compare.log"
;; esac
case " $PARTS " in *" bench "*)
  timeout ${BENCH_TIMEOUT:-170} python3 benchmarks/bench_dit.py --preset full --device cuda --weights nvfp4 \
    --attention ${BENCH_ATTN:-cudnn_sdpa,fa3} --steps 3 --no-kernels --out "$OUT/bench_dit.json" > "$OUT/bench_dit.log" 2>&1
  el "bench_dit exit $?"; tail -25 "$OUT/bench_dit.log"
;; esac
el "done"
pack_results '*.whl.xz'
