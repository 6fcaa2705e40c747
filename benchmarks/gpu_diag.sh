#!/usr/bin/env bash
# One H200 call (~2.5 min): is the exact step power bound? Sustained vs cool GEMM and attention rates
# (benchmarks/diag_sustained.py) with NVFP4-rounded and plain bf16 weights, fa3 and cuDNN attention, while nvidia-smi
# samples clocks and power. (DIAG_PROFILE=1 also profiles one exact step.)
set -u
OUT="${OUT:-/tmp/h3_diag}/diag"; mkdir -p "$OUT"; CARRY="${CARRY:-.whl}"
BUDGET=${BUDGET:-230}
. benchmarks/_gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 100 > "$OUT/smi_trace.csv" 2>&1 &
SMI=$!
for spec in fa3:nvfp4 fa3:random cudnn_sdpa:nvfp4; do
  step 70 python3 benchmarks/diag_sustained.py --seconds 15 --attention "${spec%%:*}" --weights "${spec#*:}" 2>&1 \
    | tee "$OUT/sustained_${spec/:/_}.log" | tail -9
  el "sustained $spec done"
done
if [ "${DIAG_PROFILE:-0}" = 1 ]; then
  step 100 python3 benchmarks/profile_dit.py --attention fa3 --weights nvfp4 --top 30 > "$OUT/profile_exact.log" 2>&1
  el "profile exact"; sed -n '/by category/,$p' "$OUT/profile_exact.log"
fi
kill $SMI
python3 - "$OUT/smi_trace.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))[1:]
vals = [(float(r[1].split()[0]), float(r[3].split()[0])) for r in rows if len(r) > 3 and r[1].strip()[0].isdigit()]
busy = [v for v in vals if v[1] > 300]
if busy:
    cl = sorted(c for c, _ in busy); pw = sorted(p for _, p in busy)
    print(f"under load ({len(busy)} samples > 300 W): SM clock median {cl[len(cl)//2]:.0f} MHz "
          f"(min {cl[0]:.0f}, max {cl[-1]:.0f}); power median {pw[len(pw)//2]:.0f} W (max {pw[-1]:.0f})")
PY
