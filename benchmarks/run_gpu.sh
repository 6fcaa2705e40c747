#!/usr/bin/env bash
# h3direct on one CUDA machine: the GPU test lane, the speed benchmarks and the benchmark contract, each part under
# its own hard time limit, logs and JSON under $OUT. Needs the project installed with the
# GPU lane's extras (README "GPU test lane"); runs from anywhere.
#
#   bash benchmarks/run_gpu.sh                    # tests dit vae generate
#   bash benchmarks/run_gpu.sh contract           # the contract (ComfyUI in the same run when COMFY_ROOT is set)
#   E2E_CONFIGS=nvfp4 bash benchmarks/run_gpu.sh e2e   # the end-to-end contract, one weight format
#   bash benchmarks/run_gpu.sh tests dit          # any parts, in the order given
#
# Parts: tests (pytest -m gpu), dit (bench_dit.py), vae (bench_vae.py), generate (bench_generate.py), int8 (int8_gemm.py:
# the block GEMMs in int8, e4m3, bf16), frontier (frontier.py: candidates, tiers), tiers (pytest -m parity --tier for
# each chosen tier on the validation set, twice: the first run records the baselines), spark (a Spark-shaped run on
# this GPU, tools/spark_shape: without fa3 and with the int8 tile shapes that fit 99 KiB, the GPU tests, the frontier
# and its tiers, one generate per tier, under $OUT/spark), contract
# (run_contract.py, then compare.py on its result), e2e (run_contract.py on the end-to-end contract, the
# configurations of E2E_CONFIGS or all, into $OUT/e2e[-CONFIGS].json, then compare.py). Knobs (environment): OUT
# (default /tmp/h3direct_bench), PYTHON, PRESET (full), COMFY_ROOT, QUALITY_DIR (the contract's quality cases: default
# $OUT/validation, recorded there by ComfyUI when COMFY_ROOT is set), DIT_ARGS / VAE_ARGS / GEN_ARGS / CONTRACT_ARGS /
# E2E_ARGS (extra flags), E2E_CONFIGS, <PART>_TIMEOUT (hard limit in seconds, e.g. DIT_TIMEOUT=600). A failing or
# killed part never stops the next one; the exit status is 1 when any part failed.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-${TMPDIR:-/tmp}/h3direct_bench}"
export OUT PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
PRESET="${PRESET:-full}"
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests dit vae generate)
for p in "${PARTS[@]}"; do
  case "$p" in tests|dit|vae|generate|contract|e2e|int8|frontier|tiers|spark) ;; *) echo "run_gpu.sh: unknown part '$p' (tests dit vae generate contract e2e int8 frontier tiers spark)" >&2; exit 2;; esac
done

T0=$(date +%s)
FAILED=0
{
  echo "start $(date -u +%FT%TZ)  parts: ${PARTS[*]}  preset $PRESET  commit $(git rev-parse --short HEAD 2>/dev/null)"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv
  "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
} 2>&1 | tee "$OUT/env.log"

part() {  # part NAME SECONDS CMD...: CMD under a hard limit, its output in $OUT/NAME.log
  local name="$1" limit="$2" t rc
  shift 2
  t=$(date +%s)
  echo; echo "===== $name (hard limit ${limit}s) ====="
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  echo "===== $name: exit $rc after $(( $(date +%s) - t ))s (total $(( $(date +%s) - T0 ))s) ====="
  [ "$rc" = 124 ] && echo "!!! $name was killed at its ${limit}s limit; its JSON holds what finished"
  [ "$rc" = 0 ] || FAILED=1
}

for p in "${PARTS[@]}"; do
  # shellcheck disable=SC2086
  case "$p" in
    tests) part tests "${TESTS_TIMEOUT:-900}" "$PY" -m pytest -q -p no:cacheprovider -m "gpu or gpu2" ;;
    dit) part bench_dit "${DIT_TIMEOUT:-290}" "$PY" -m benchmarks.bench_dit --preset "$PRESET" \
           --budget-seconds $(( ${DIT_TIMEOUT:-290} - 60 )) ${DIT_ARGS:-} ;;
    vae) part bench_vae "${VAE_TIMEOUT:-100}" "$PY" -m benchmarks.bench_vae --preset "$PRESET" \
           --budget-seconds $(( ${VAE_TIMEOUT:-100} - 25 )) ${VAE_ARGS:-} ;;
    generate) part bench_generate "${GEN_TIMEOUT:-140}" "$PY" -m benchmarks.bench_generate --preset "$PRESET" \
           --budget-seconds $(( ${GEN_TIMEOUT:-140} - 25 )) ${GEN_ARGS:-} ;;
    contract)  # the tier paths' options: the frontier part's tiers file when it ran, else $H3_TIERS or the cache's
      tiers=(); [ -f "$OUT/frontier/tiers.json" ] && tiers=(--tiers "$OUT/frontier/tiers.json")
      part contract "${CONTRACT_TIMEOUT:-900}" "$PY" -m benchmarks.run_contract \
        --contract benchmarks/ref2va-960x544-124f.json --out "$OUT/contract.json" "${tiers[@]}" \
        --quality-dir "${QUALITY_DIR:-$OUT/validation}" ${COMFY_ROOT:+--comfy-root "$COMFY_ROOT"} ${CONTRACT_ARGS:-}
      part compare 60 "$PY" -m benchmarks.compare --contract benchmarks/ref2va-960x544-124f.json \
        --result "$OUT/contract.json" ;;
    int8) part int8_gemm "${INT8_TIMEOUT:-240}" "$PY" -m benchmarks.int8_gemm --all-configs --out "$OUT/int8-gemm.json" ;;
    frontier) part frontier "${FRONTIER_TIMEOUT:-600}" "$PY" -m benchmarks.frontier \
        --trace-dir "${QUALITY_DIR:-$OUT/validation}" --out "$OUT/frontier" ${COMFY_ROOT:+--comfy-root "$COMFY_ROOT"} \
        ${FRONTIER_ARGS:-} ;;
    tiers)  # each chosen tier under its rule on the validation set, twice (the first run records the baselines)
      for t in ${TIERS:-sage_class fastest exact}; do
        for round in 1 2; do
          part "gate_${t}_${round}" "${GATE_TIMEOUT:-300}" "$PY" -m pytest -q -p no:cacheprovider -m parity \
            parity_tests/test_dit_parity.py --trace-dir "${QUALITY_DIR:-$OUT/validation}" --device cuda \
            --tier "$t" --tiers "$OUT/frontier/tiers.json" --baselines "$OUT/baselines" ${GATE_ARGS:-}
        done
      done ;;
    spark)  # a Spark-shaped run on this GPU (tools/spark_shape: no fa3, the int8 tile shapes of 99 KiB): the GPU
      # tests (SPARK_TESTS_WORKERS processes), the frontier and its tiers, one generate per tier; results under
      # $OUT/spark. The frontier judges SPARK_CASES, seven structured cases spanning the set's axes (NVFP4 and bf16,
      # curve and full adaLN, 3 and 4 heads, a wider text, sigma early to late, and v17's broad attention, the worst of
      # every sparse candidate on the whole set), recording those QUALITY_DIR lacks (about 3 minutes on one H100,
      # once); SPARK_CASES="" judges the whole set
      SPARK_PY="$(pwd)/tools/spark_shape${PYTHONPATH:+:$PYTHONPATH}"
      SPARK_CASES="${SPARK_CASES-v4_local_nvfp4_s5072 v5_local_bf16_s5584 v9_local_bf16_h4_s6224_late
        v10_local_nvfp4_td192_s6768_mid v11_local_bf16_s8656_early v12_local_nvfp4_h3_s5664_late
        v17_local_bf16_weak_s5724}"
      case_args=(); for c in $SPARK_CASES; do case_args+=(--case "$c"); done
      mkdir -p "$OUT/spark"
      # (deselected: the tests of what this run takes away: fa3 and fa3_fp8, the shared-memory table against the
      # device's own report, and the int8 kernel's autotuned launch, which no Hopper tile shape fits within 99 KiB)
      part spark_tests "${SPARK_TESTS_TIMEOUT:-150}" env PYTHONPATH="$SPARK_PY" "$PY" -m pytest -q -p no:cacheprovider \
        -n "${SPARK_TESTS_WORKERS:-4}" -m gpu -k "not fa3 and not fit_is_the_gpus_own_verdict and not bit_for_bit[None]" \
        ${SPARK_TESTS_ARGS:-}
      part spark_frontier "${SPARK_FRONTIER_TIMEOUT:-330}" env PYTHONPATH="$SPARK_PY" "$PY" -m benchmarks.frontier \
        --trace-dir "${QUALITY_DIR:-$OUT/validation}" --out "$OUT/spark/frontier" --steps 2 "${case_args[@]}" \
        ${COMFY_ROOT:+--comfy-root "$COMFY_ROOT"} ${SPARK_FRONTIER_ARGS:-}
      for t in ${TIERS:-exact sage_class fastest}; do
        part "spark_generate_$t" "${SPARK_GENERATE_TIMEOUT:-40}" env PYTHONPATH="$SPARK_PY" "$PY" -m h3direct generate \
          --device cuda --tier "$t" --tiers "$OUT/spark/frontier/tiers.json" --width 480 --height 272 --frames 33 \
          --steps 4 --output "$OUT/spark/$t.mp4" ${SPARK_GENERATE_ARGS:-}
      done ;;
    e2e)
      E2E_OUT="$OUT/e2e${E2E_CONFIGS:+-${E2E_CONFIGS//,/-}}.json"
      part e2e "${E2E_TIMEOUT:-540}" "$PY" -m benchmarks.run_contract \
        --contract benchmarks/ref2va-960x544-124f-e2e.json --out "$E2E_OUT" \
        ${COMFY_ROOT:+--comfy-root "$COMFY_ROOT"} ${E2E_CONFIGS:+--configs "$E2E_CONFIGS"} ${E2E_ARGS:-}
      part compare_e2e 60 "$PY" -m benchmarks.compare --contract benchmarks/ref2va-960x544-124f-e2e.json \
        --result "$E2E_OUT" ;;
  esac
done

echo "total $(( $(date +%s) - T0 ))s; results in $OUT"
exit "$FAILED"
