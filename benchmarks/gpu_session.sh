#!/usr/bin/env bash
# One H200 call running several topic scripts (benchmarks/gpu_TOPIC.sh) one after another, each under its own time
# limit, with SageAttention 2 built in the background meanwhile (or reused from an earlier call on the same machine).
#
#   OUT=... CARRY=.whl bash benchmarks/gpu_session.sh [--limit SECONDS] TOPIC[:SECONDS] ...
#
# Each topic writes under $OUT/TOPIC/; after it ends that folder is packed into $OUT/TOPIC.tgz, its files over 8 MB
# moved beside it as $OUT/TOPIC-NAME (what comes back from the machine: at most 8 files of 16 MiB), its summary is kept in $OUT/summary.txt. A topic that fails or runs out of
# time does not stop the next one.
set -u
OUT="${OUT:-/tmp/h3_session}"; mkdir -p "$OUT"; CARRY="${CARRY:-.whl}"
limit=240
[ "${1:-}" = --limit ] && { limit="$2"; shift 2; }
[ $# -gt 0 ] || { echo "usage: $0 [--limit SECONDS] TOPIC[:SECONDS] ..." >&2; exit 2; }
for spec in "$@"; do
  [ -f "benchmarks/gpu_${spec%%:*}.sh" ] || { echo "$0: no benchmarks/gpu_${spec%%:*}.sh" >&2; exit 2; }
done
export OUT CARRY
. benchmarks/_gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader | tee "$OUT/summary.txt"

# SageAttention 2 into $SITE: a wheel left by an earlier call on this machine, else built in the background
# (setsid: it outlives this call, so a later call on the same warm machine finds the wheel)
SAGE_WHL=/tmp/sagewhl
if ! ls $SAGE_WHL/sageattention-*.whl >/dev/null 2>&1 && [ -f "$CARRY/sage-src.tar.xz" ] && [ ! -e /tmp/sage.building ]; then
  touch /tmp/sage.building
  mkdir -p /tmp/sage && tar xJf "$CARRY/sage-src.tar.xz" -C /tmp/sage
  setsid bash -c "bash tools/build_sageattention.sh --arch 9.0a --src /tmp/sage/SageAttention --out $SAGE_WHL \
    > /tmp/sage_build.log 2>&1; rm -f /tmp/sage.building" < /dev/null > /dev/null 2>&1 &
  el "SageAttention 2 build started in the background"
fi
sage_install() {  # install the wheel into $SITE once it exists (no waiting)
  python3 -c "import sageattention" 2>/dev/null && return 0
  ls $SAGE_WHL/sageattention-*.whl >/dev/null 2>&1 || return 1
  python3 -m pip install -q --no-deps --no-index --target "$SITE" $SAGE_WHL/sageattention-*.whl && el "sage2 installed"
}

for spec in "$@"; do
  topic="${spec%%:*}"; t="$limit"; [ "$spec" != "$topic" ] && t="${spec#*:}"
  sage_install
  el "== $topic (limit ${t}s)"
  mkdir -p "$OUT/$topic"
  timeout --kill-after=10 "$t" bash "benchmarks/gpu_$topic.sh" > "$OUT/$topic/driver.log" 2>&1
  rc=$?
  el "== $topic exit $rc"
  { echo "== $topic exit $rc"; tail -40 "$OUT/$topic/driver.log"; } >> "$OUT/summary.txt"
  tail -40 "$OUT/$topic/driver.log"
  # files over 8 MB travel beside the topic's archive (each file back is at most 16 MiB), not inside it
  find "$OUT/$topic" -type f -size +8M -exec sh -c 'mv "$1" "$2/$3-$(basename "$1")"' _ {} "$OUT" "$topic" \;
  (cd "$OUT" && tar czf "$topic.tgz" "$topic" && rm -rf "$topic")
done
sage_install; [ -f /tmp/sage_build.log ] && tail -3 /tmp/sage_build.log >> "$OUT/summary.txt"
el "session done"
