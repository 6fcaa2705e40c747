#!/usr/bin/env bash
# Build a SageAttention 2 wheel (thu-ml/SageAttention, Apache-2.0) from source at a pinned revision.
#
#   tools/build_sageattention.sh --arch 9.0a --src DIR --out WHEELDIR     # H200 / H100 (sm_90a)
#   tools/build_sageattention.sh --arch 12.1 --src DIR --out WHEELDIR     # DGX Spark (sm_121a)
#
# --src DIR   a SageAttention source tree at SAGE_REV: a git checkout (HEAD is checked), or an export whose
#             file .h3-source-rev holds the revision. Without --src the tree is cloned into a temporary folder
#             (needs network and git).
# --out DIR   where the wheel goes (created).
# --arch A    one CUDA arch, as TORCH_CUDA_ARCH_LIST writes it; an "a" suffix is accepted (SageAttention's setup.py
#             builds the arch-specific sm_90a / sm_120a / sm_121a targets by itself).
# --jobs N    parallel compile jobs (default: CPU count / 4, at least 1; each nvcc also runs --threads=8).
#
# Needs: nvcc >= 12.3 (sm_90) / >= 12.8 (sm_12x), the torch the wheel will run with, setuptools, wheel, ninja.
# Built this way on an H200 (nvcc 13.0, torch 2.11, 16 cores): ~3.5 min.
set -euo pipefail

SAGE_REPO=https://github.com/thu-ml/SageAttention.git
SAGE_REV=d1a57a546c3d395b1ffcbeecc66d81db76f3b4b5   # SageAttention 2.2.0 line, 2025; the revision we test

arch="" src="" out="" jobs=""
usage() { echo "usage: $0 --arch 9.0a|12.1|... [--src DIR] --out WHEELDIR [--jobs N]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --arch) arch="${2:-}"; shift 2 ;;
    --src) src="${2:-}"; shift 2 ;;
    --out) out="${2:-}"; shift 2 ;;
    --jobs) jobs="${2:-}"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "$0: unknown argument $1" >&2; usage ;;
  esac
done
[ -n "$arch" ] && [ -n "$out" ] || usage
case "$arch" in
  8.0|8.6|8.9|9.0|9.0a|10.0|10.0a|12.0|12.0a|12.1|12.1a) ;;
  *) echo "$0: --arch $arch: SageAttention 2 builds for 8.0, 8.6, 8.9, 9.0(a), 10.0(a), 12.0(a), 12.1(a)" >&2; exit 2 ;;
esac
arch_list="${arch%a}"
command -v nvcc >/dev/null || { echo "$0: nvcc not found (CUDA toolkit needed)" >&2; exit 2; }
PY="${PYTHON:-python3}"

if [ -z "$src" ]; then
  src="$(mktemp -d)/SageAttention"
  git clone --filter=blob:none "$SAGE_REPO" "$src"
  git -C "$src" checkout --detach "$SAGE_REV"
fi
[ -f "$src/setup.py" ] || { echo "$0: --src $src: no setup.py (not a SageAttention tree)" >&2; exit 2; }
if [ -d "$src/.git" ]; then
  rev="$(git -C "$src" rev-parse HEAD)"
elif [ -f "$src/.h3-source-rev" ]; then
  rev="$(tr -d '[:space:]' < "$src/.h3-source-rev")"
else
  echo "$0: --src $src: cannot tell its revision (no .git, no .h3-source-rev); expected $SAGE_REV" >&2; exit 2
fi
[ "$rev" = "$SAGE_REV" ] || { echo "$0: --src $src is at $rev, expected $SAGE_REV" >&2; exit 2; }

ncpu="$(nproc 2>/dev/null || echo 4)"
jobs="${jobs:-$(( ncpu / 4 > 0 ? ncpu / 4 : 1 ))}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
echo "building SageAttention $SAGE_REV for TORCH_CUDA_ARCH_LIST=$arch_list with $jobs jobs ($(nvcc --version | tail -1))"
cd "$src"
TORCH_CUDA_ARCH_LIST="$arch_list" MAX_JOBS="$jobs" EXT_PARALLEL="$jobs" \
  "$PY" -m pip wheel . --no-deps --no-build-isolation --no-cache-dir -w "$out"
ls -l "$out"/sageattention-*.whl
