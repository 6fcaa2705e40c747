# Sourced (never run) by the one-call GPU scripts (benchmarks/gpu_*.sh), from the
# repository root with $CARRY set: unbuffered Python, expandable CUDA segments, `el MSG` (seconds since start + MSG), `step SECONDS CMD` (a timeout within $BUDGET),
# fa3-fwd and comfy-kitchen 0.2.40 (fa3.tar.xz, ck0240.tar.xz if present, in $CARRY) unpacked into $SITE, PYTHONPATH = repo + $SITE.
# shellcheck shell=bash
export PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

# step SECONDS CMD...: run CMD under `timeout min(SECONDS, time left of $BUDGET seconds since T0)`; with under 15 s
# left the step is skipped (said so) and returns 125. A script sets BUDGET (its whole-run cap) before its first step.
step() {
  local want=$1 left; shift
  left=$(( ${BUDGET:-600} - ($(date +%s) - T0) ))
  [ "$left" -lt "$want" ] && want=$left
  if [ "$want" -lt 15 ]; then el "skipped, time budget spent: ${*:1:6}"; return 125; fi
  timeout "$want" "$@"
}
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
