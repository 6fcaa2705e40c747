#!/usr/bin/env bash
# One H200 call: ComfyUI's GPU ground truth on the head_dim-128 `small` preset (fixtures/gpu/), then the parity gate
# per attention backend on those GPU traces.
#   1. `python -m oracle record --device cuda`: ComfyUI with its defaults on the GPU (bf16 compute, its pytorch
#      attention) and the fp32-compute twin, for the bf16 and the NVFP4 checkpoint, at S = 64 (inputs_gpu_ref2va:
#      the committed fixtures, into $OUT/gpu) and S = 4,496 (inputs_gpu_ref2va_s4k: above H3_SOL_MIN_TOKENS, so
#      sol_attn runs its kernel; too large to commit, gated here only);
#   2. ComfyUI's GPU run-to-run determinism: the bf16 recordings again, `oracle diff --budget 0` against the first;
#   3. `pytest -m parity --device cuda --attention B` on both trace folders with the committed budgets, for each B
#      in $BACKENDS; sol_attn once more with H3_SOL_STRICT=1 on the large case (teacher mode).
#
#   CARRY=../.whl bash benchmarks/gpu_groundtruth.sh
#
# The checkpoints (`h3direct make-checkpoint --preset small --adaln curve`, seed 0) and both inputs files
# (`fixtures/build_inputs.py --gpu`) are made on the spot in $IN unless already there; their sha256 go to $OUT, and
# they come back in gpu_made.tgz (the committed traces name these files' sha256).
#
# $CARRY holds ck0240.tar.xz, fa3.tar.xz, comfy.tar.xz (ComfyUI 0f1fa67a, packed outside the repo, never committed)
# and the wheels ComfyUI imports (comfy_aimdo, torchsde, trampoline); see benchmarks/gpu_calibrate.sh.
set -u
OUT="${OUT:-/tmp/h3_gt}"; mkdir -p "$OUT"
CARRY="${CARRY:-../.whl}"; IN="${IN:-/tmp/gt_in}"
BACKENDS="${BACKENDS:-sdpa cudnn_sdpa fa3 ck_int8 sol_attn}"
. benchmarks/_gpu_env.sh   # el, $SITE (comfy-kitchen, fa3), PYTHONPATH, unpack_comfy, pack_results
unpack_comfy || exit 3
export H3_COMFY_COMMIT=0f1fa67a H3_COMFY_ROOT=/tmp/comfy
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, comfy_kitchen as ck, importlib.metadata as md; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'comfy_kitchen', md.version('comfy-kitchen'), 'sol', \
ck.sol_attn_is_available())" \
  2>&1 | tee -a "$OUT/env.txt"

mkdir -p "$IN"
[ -f "$IN/inputs_gpu_ref2va_s4k.safetensors" ] || python3 "${BUILD_INPUTS:-fixtures/build_inputs.py}" --gpu "$IN"
for q in none nvfp4; do
  n=$q; [ $q = none ] && n=bf16
  [ -f "$IN/h3_small_curve_$n.safetensors" ] || python3 -m h3direct make-checkpoint --preset small --adaln curve \
    --quant $q --out "$IN/h3_small_curve_$n.safetensors" > /dev/null
done
(cd "$IN" && sha256sum ./*) | tee "$OUT/made_sha256.txt"
G="$OUT/gpu"; L=/tmp/gt_s4k; R=/tmp/gt_rerun; mkdir -p "$G" "$L" "$R"
cp "$IN"/h3_small_curve_*.safetensors "$IN"/inputs_gpu_ref2va.safetensors "$G"/
cp "$IN"/h3_small_curve_*.safetensors "$IN"/inputs_gpu_ref2va_s4k.safetensors "$L"/
rec() {  # rec FOLDER CKPT INPUTS DTYPE OUTDIR
  local name="trace_gpu_small_$2_$3_$4"
  timeout 120 python3 -m oracle record --device cuda --checkpoint "$1/h3_small_curve_$2.safetensors" \
    --inputs "$1/inputs_gpu_$3.safetensors" --compute-dtype "$4" --out "$5/$name.safetensors" \
    > "$OUT/rec_$name$([ "$5" = "$R" ] && echo _rerun).log" 2>&1
  el "record $name -> $5: exit $? $(tail -1 "$OUT/rec_$name$([ "$5" = "$R" ] && echo _rerun).log")"
}
# every recording is its own process (ComfyUI reads its flags once): all at once, the GPU has room for them
export OMP_NUM_THREADS=2
for ck in bf16 nvfp4; do for dt in bf16 fp32; do
  rec "$G" "$ck" ref2va "$dt" "$G" & rec "$L" "$ck" ref2va_s4k "$dt" "$L" &
done; done
rec "$G" bf16 ref2va bf16 "$R" & rec "$L" bf16 ref2va_s4k bf16 "$R" & rec "$L" nvfp4 ref2va_s4k fp32 "$R" &
wait
for n in bf16_ref2va_bf16 bf16_ref2va_s4k_bf16 nvfp4_ref2va_s4k_fp32; do
  d="$G"; case $n in *s4k*) d="$L";; esac
  python3 -m oracle diff "$R/trace_gpu_small_$n.safetensors" "$d/trace_gpu_small_$n.safetensors" --budget 0 --all \
    > "$OUT/determinism_$n.log" 2>&1
  el "determinism $n: $(tail -1 "$OUT/determinism_$n.log")"
done

# the gates side by side (one process per backend, 3 CPU threads each)
export OMP_NUM_THREADS=3
gate() {
  env "$@" timeout 200 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py \
    --device cuda --attention "$b" --trace-dir "$G" --trace-dir "$L" --parity-report "$OUT/gate_$b" \
    > "$OUT/gate_$b.log" 2>&1
  el "gate $b: exit $? $(tail -1 "$OUT/gate_$b.log")"
}
for b in $BACKENDS; do
  if [ "$b" = sol_attn ]; then gate H3_SOL_FALLBACK=cudnn_sdpa & else gate & fi
done
case " $BACKENDS " in *" sol_attn "*)
  ( H3_SOL_STRICT=1 H3_SOL_FALLBACK=cudnn_sdpa timeout 200 python3 -m pytest -q -p no:cacheprovider -m parity \
      parity_tests/test_dit_parity.py --device cuda --attention sol_attn --trace-dir "$L" -k teacher \
      --parity-report "$OUT/strict_sol" > "$OUT/strict_sol.log" 2>&1
    el "sol_attn strict (S = 4,496): exit $? $(grep -m1 -o "H3_SOL_STRICT=1 forbids it" "$OUT/strict_sol.log") \
$(tail -1 "$OUT/strict_sol.log")" ) &
;; esac
wait
el "done"
tar czf "$OUT/gpu_made.tgz" -C "$IN" h3_small_curve_bf16.safetensors h3_small_curve_nvfp4.safetensors \
  inputs_gpu_ref2va.safetensors
(cd "$OUT" && tar czf gpu_traces.tgz gpu/trace_* && rm -rf gpu) && pack_results gpu_traces.tgz gpu_made.tgz
