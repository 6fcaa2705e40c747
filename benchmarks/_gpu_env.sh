# Sourced (never run) by the one-call GPU scripts, gpu_calibrate.sh, gpu_groundtruth.sh and gpu_speed.sh, from the
# repository root with $CARRY set: unbuffered Python, expandable CUDA segments, `el MSG` (seconds since start + MSG),
# fa3-fwd and comfy-kitchen 0.2.40 (fa3.tar.xz, ck0240.tar.xz if present, in $CARRY) unpacked into $SITE, PYTHONPATH = repo + $SITE.
# shellcheck shell=bash
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
SITE=/tmp/h3site; mkdir -p "$SITE"
tar xJf "$CARRY/fa3.tar.xz" -C "$SITE" || exit 3
# comfy-kitchen is optional here (a call that carries the repository's 20 MB of GPU fixtures has no room for its 34 MB):
# without it sol_attn / ck_int8 are unavailable and NVFP4 dequantization / rope take their torch paths, said once
if [ -f "$CARRY/ck0240.tar.xz" ]; then tar xJf "$CARRY/ck0240.tar.xz" -C "$SITE" || exit 3
else echo "_gpu_env.sh: no $CARRY/ck0240.tar.xz: comfy-kitchen not installed for this call"; fi
export PYTHONPATH="$PWD:$SITE"

# ComfyUI (comfy.tar.xz: packed outside the repository, never committed) into /tmp/comfy, and the wheels it imports
# ($CARRY/*.whl) into $SITE
unpack_comfy() {
  mkdir -p /tmp/comfy && tar xJf "$CARRY/comfy.tar.xz" -C /tmp/comfy &&
    python3 -m pip install -q --no-deps --no-index --no-compile --target "$SITE" "$CARRY"/*.whl
}

# pack_results [NAME...]: everything in $OUT into $OUT/results.tgz, then removed, except the NAMEs (globs allowed),
# which stay beside it
pack_results() {
  local ex=(--exclude=results.tgz) keep=(! -name results.tgz) k
  for k in "$@"; do ex+=("--exclude=$k"); keep+=(! -name "$k"); done
  (cd "$OUT" && tar czf results.tgz "${ex[@]}" ./* && find . -mindepth 1 -maxdepth 1 "${keep[@]}" -exec rm -rf {} +)
}
