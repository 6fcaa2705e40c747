#!/usr/bin/env bash
# One short H200 call (expected ~100 s): ComfyUI's generation recorded on the GPU (`oracle record-generate --device
# cuda`: 4 Euler steps, S = 64, fp32 compute, the structured-attention small checkpoint) and `record-vae --device cuda`,
# then the e2e and VAE gates on those GPU traces: h3direct on the same GPU, the calibration pass (every metric) and
# the real budgets. Results under $OUT/recgen/.
# Ran once on 2026-12-01: record-vae worked; record-generate needs PyAV (`av`, imported by ComfyUI's H3 nodes), which
# the H200 image lacks and whose wheel does not fit beside the repository in one call.
set -u
OUT="${OUT:-/tmp/h3_recgen}"; CARRY="${CARRY:-.whl}"
. benchmarks/_gpu_env.sh
O="$OUT/recgen"; G=/tmp/recgen; mkdir -p "$O" "$G"
unpack_comfy > "$O/unpack.log" 2>&1 || el "ComfyUI unpack failed"
timeout 40 python3 fixtures/build_inputs.py --gpu "$G" > "$O/build_inputs.log" 2>&1
timeout 40 python3 -m h3direct make-checkpoint --preset small --adaln curve --attention-structure local --quant none \
  --out "$G/h3_small_local_bf16.safetensors" > "$O/make.log" 2>&1
timeout 90 python3 -m oracle record-generate --device cuda --comfy-root /tmp/comfy \
  --checkpoint "$G/h3_small_local_bf16.safetensors" --inputs "$G/inputs_gpu_ref2va.safetensors" --steps 4 \
  --out "$G/trace_gen_gpu_small_local_bf16_ref2va_fp32.safetensors" > "$O/rec_generate.log" 2>&1
el "record-generate --device cuda: exit $? $(tail -1 "$O/rec_generate.log" | cut -c1-200)"
timeout 60 python3 -m oracle record-vae --device cuda --comfy-root /tmp/comfy --weights fixtures/vae_video_fx.safetensors \
  --config fixtures/vae_config_fixture.json --inputs fixtures/vae_inputs_fixture.safetensors --op decode --dtype fp32 \
  --out "$G/trace_vae_gpu_video_decode_fp32.safetensors" > "$O/rec_vae.log" 2>&1
el "record-vae --device cuda: exit $? $(tail -1 "$O/rec_vae.log" | cut -c1-200)"
# the gate pairs a trace with the files beside it (h3direct/traces/discovery.py): the fixtures' VAE weights, config, inputs
cp fixtures/vae_video_fx.safetensors fixtures/vae_config_fixture.json fixtures/vae_inputs_fixture.safetensors "$G"/
for t in cal real; do
  b=(); [ $t = cal ] && b=(--budgets benchmarks/calibration_budgets.toml)
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_e2e_parity.py parity_tests/test_vae_parity.py \
    --device cuda --attention sdpa --trace-dir "$G" "${b[@]}" --parity-report "$O/gate_$t" > "$O/gate_$t.log" 2>&1
  el "gate ($t) on the GPU generation / VAE traces: $(tail -1 "$O/gate_$t.log")"
done
grep -h -E "rel_l2|FAIL|PASS" "$O"/gate_cal/*.md 2>/dev/null | head -30
cp "$G"/*.json "$O"/ 2>/dev/null; ls -la "$G" > "$O/files.txt"
