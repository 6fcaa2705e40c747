#!/usr/bin/env bash
# One H200 call (expected ~2.5-3.5 min wall, hard cap 4): ComfyUI's GPU ground truth on a synthetic DiT whose
# attention is local in (t, h, w) (`make-checkpoint --attention-structure local`, see h3direct/checkpoint/synthetic.py),
# then every attention backend's calibration pass of the parity gate on those traces. Results under $OUT/gt2/.
#   1. (~15 s) checkpoints: `small` preset (head_dim 128), curve adaLN, seed 0, --attention-structure local, bf16 and
#      NVFP4; inputs `build_inputs.py --gpu` (Ref2VA, S = 64 and S = 4,496);
#   2. (~40 s) `python -m oracle record --device cuda`: ComfyUI bf16 and its fp32 twin, both checkpoints, both sizes
#      (8 processes at once); meanwhile `record-generate --device cuda` (4 steps, S = 64) and `record-vae --device cuda`
#      (fixtures' video VAE) once each;
#   3. (~90 s) `pytest -m parity --device cuda --attention B --budgets benchmarks/calibration_budgets.toml` on the
#      S = 4,496 traces for B in fa3 cudnn_sdpa sage2 kj_head_sliced sol_attn ck_int8 fa3_fp8 (sage2 only if
#      `import sageattention` works, fa3_fp8 only if h3direct registers it), one process each, side by side; meanwhile
#      benchmarks/attention_structure.py --sol on ComfyUI's bf16 trace (CPU: local-window mass, Sol-Attn reference);
#   4. summary: per backend, teacher worst rel-L2 per layer kind, free-running output rel-L2, the ratio to ComfyUI's
#      own bf16 error vs the fp32 twin (benchmarks/calibration_summary.py), and the sol_attn call counts.
#
#   OUT=/tmp/o CARRY=../.whl bash benchmarks/gpu_gt2.sh
#
# The S = 4,496 traces (~220 MB each) stay on the machine; the S = 64 ones (a few MB) come back in gt2_s64.tgz.
set -u
OUT="${OUT:-/tmp/h3_gt2}"; CARRY="${CARRY:-../.whl}"
. benchmarks/_gpu_env.sh   # el, $SITE (comfy-kitchen, fa3), PYTHONPATH, unpack_comfy
O="$OUT/gt2"; mkdir -p "$O"
IN=/tmp/gt2_in; G="$O/s64"; L=/tmp/gt2_s4k; mkdir -p "$IN" "$G" "$L"
unpack_comfy || { el "gt2: cannot unpack ComfyUI from $CARRY (comfy.tar.xz + wheels): nothing recorded"; exit 0; }
export H3_COMFY_COMMIT=0f1fa67a H3_COMFY_ROOT=/tmp/comfy
python3 -c "import torch, comfy_kitchen as ck, importlib.metadata as md; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'comfy_kitchen', md.version('comfy-kitchen'), 'sol', ck.sol_attn_is_available())" \
  > "$O/env.txt" 2>&1; cat "$O/env.txt"

# 1. checkpoints and inputs
timeout 60 python3 fixtures/build_inputs.py --gpu "$IN" > "$O/build_inputs.log" 2>&1 || el "build_inputs failed: $(tail -1 "$O/build_inputs.log")"
for q in none nvfp4; do
  n=$q; [ $q = none ] && n=bf16
  timeout 60 python3 -m h3direct make-checkpoint --preset small --adaln curve --attention-structure local --quant $q \
    --out "$IN/h3_small_local_$n.safetensors" > "$O/make_$n.log" 2>&1 || el "make-checkpoint $n failed: $(tail -1 "$O/make_$n.log")"
done
(cd "$IN" && sha256sum ./*) > "$O/made_sha256.txt"
cp "$IN"/h3_small_local_*.safetensors "$IN"/inputs_gpu_ref2va.safetensors "$G"/ 2>/dev/null
cp "$IN"/h3_small_local_*.safetensors "$IN"/inputs_gpu_ref2va_s4k.safetensors "$L"/ 2>/dev/null
el "gt2: inputs and checkpoints made ($(ls "$IN" | wc -l) files)"

# 2. ComfyUI on the GPU: every recording its own process (ComfyUI reads its flags once)
rec() {  # rec FOLDER CKPT INPUTS DTYPE
  local name="trace_gpu_small_local_$2_$3_$4"
  timeout 90 python3 -m oracle record --device cuda --checkpoint "$1/h3_small_local_$2.safetensors" \
    --inputs "$1/inputs_gpu_$3.safetensors" --compute-dtype "$4" --out "$1/$name.safetensors" > "$O/rec_$name.log" 2>&1
  el "record $name: exit $? $(tail -1 "$O/rec_$name.log" | cut -c1-160)"
}
export OMP_NUM_THREADS=1
for ck in bf16 nvfp4; do for dt in bf16 fp32; do
  rec "$G" "$ck" ref2va "$dt" & rec "$L" "$ck" ref2va_s4k "$dt" &
done; done
( timeout 90 python3 -m oracle record-generate --device cuda --checkpoint "$G/h3_small_local_bf16.safetensors" \
    --inputs "$G/inputs_gpu_ref2va.safetensors" --steps 4 --out "$G/trace_gen_gpu_small_local_bf16_ref2va_fp32.safetensors" \
    > "$O/rec_generate.log" 2>&1
  el "record-generate --device cuda (4 steps, S = 64, fp32): exit $? $(tail -1 "$O/rec_generate.log" | cut -c1-160)" ) &
( timeout 90 python3 -m oracle record-vae --device cuda --weights fixtures/vae_video_fx.safetensors \
    --config fixtures/vae_config_fixture.json --inputs fixtures/vae_inputs_fixture.safetensors --op decode --dtype fp32 \
    --out "$G/trace_vae_gpu_video_decode_fp32.safetensors" > "$O/rec_vae.log" 2>&1
  el "record-vae --device cuda (video decode, fp32): exit $? $(tail -1 "$O/rec_vae.log" | cut -c1-160)" ) &
wait

# 3. the calibration passes on the S = 4,496 traces, side by side; the attention-structure check meanwhile
( OMP_NUM_THREADS=4 timeout 110 python3 benchmarks/attention_structure.py --sol --taus 1.0,1.3,2.0 \
    --trace "$L/trace_gpu_small_local_bf16_ref2va_s4k_bf16.safetensors" --out "$O/attention_structure.json" \
    > "$O/attention_structure.log" 2>&1
  el "attention structure of ComfyUI's bf16 trace (S = 4,496): exit $?"; cat "$O/attention_structure.log" ) &
export OMP_NUM_THREADS=2
known=$(timeout 60 python3 -c "from h3direct.dit.attention import backends; print(' '.join(backends()))" 2>/dev/null)
el "h3direct attention backends: $known"
cal() {  # cal BACKEND LABEL [ENV...]
  local b="$1" label="$2"; shift 2
  env "$@" timeout 110 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py \
    --device cuda --attention "$b" --trace-dir "$L" --budgets benchmarks/calibration_budgets.toml \
    --parity-report "$O/cal_$label" > "$O/cal_$label.log" 2>&1
  el "calibration $label: exit $? $(tail -1 "$O/cal_$label.log")"
}
LABELS=""
for b in fa3 cudnn_sdpa sage2 kj_head_sliced sol_attn ck_int8 fa3_fp8; do
  case " $known " in *" $b "*) ;; *) el "skip $b: python -m h3direct does not know it"; continue;; esac
  if [ "$b" = sage2 ] && ! python3 -c "import sageattention" > /dev/null 2>&1; then
    el "skip sage2: 'import sageattention' fails here (no SageAttention2 build in \$SITE)"; continue
  fi
  case $b in
    kj_head_sliced) cal "$b" kj_cudnn H3_HEAD_SLICE_BACKEND=cudnn_sdpa & LABELS="$LABELS kj_cudnn";;
    sol_attn) cal "$b" sol_attn H3_SOL_FALLBACK=cudnn_sdpa & LABELS="$LABELS sol_attn";;
    *) cal "$b" "$b" & LABELS="$LABELS $b";;
  esac
done
wait

# 4. summary
el "gt2 summary (S = 4,496, structured attention; metrics from the calibration pass, nothing gated)"
grep -h "ComfyUI\|record" "$O"/rec_*.log 2>/dev/null | grep -i "error\|Traceback" | head -5
dirs=""; for l in $LABELS; do [ -f "$O/cal_$l/results.jsonl" ] && dirs="$dirs $O/cal_$l"; done
# shellcheck disable=SC2086
[ -n "$dirs" ] && timeout 60 python3 benchmarks/calibration_summary.py $dirs 2>&1 | tee "$O/calibration_summary.txt"
grep -h "sol_attn: " "$O/cal_sol_attn/report.md" 2>/dev/null | head -4  # kernel vs fallback call counts
[ -f "$O/attention_structure.json" ] || el "attention structure: no result (see attention_structure.log)"
ls -la "$L" > "$O/s4k_files.txt" 2>&1
(cd "$O" && tar czf gt2_s64.tgz s64 && rm -rf s64)
el "gt2 done"
