#!/usr/bin/env bash
# FP8 e4m3 W8A8 block linears (--fp8-linear) on one H200: expected wall time ~4 min (gemm ~50 s, gate ~40 s,
# bench 2 x ~65 s, profile ~50 s; every step has its own timeout). Results under $OUT/fp8lin/.
#
#   OUT=/tmp/o CARRY=../.whl bash benchmarks/gpu_fp8lin.sh     # from the repository root
#
# (i)   per-shape GEMM check at the 4 full block shapes, M = 20,050: ms per call bf16 / fp8 (incl. activation
#       quantization) / NVFP4 w4a16 / fp8 stream, rel-L2 vs an fp32 product, Triton-vs-torch code agreement;
# (ii)  the parity gate with --fp8-linear on fixtures/ and fixtures/gpu, attention fa3 (bf16), through
#       benchmarks/calibration_budgets.toml (records every metric; never fails), summarised by calibration_summary.py,
#       with the FP8 GEMM paths taken (the report's "FP8 linear calls": scaled_mm, or emulated with the reason); then
#       the real table, which must refuse fa3 ("no calibrated budget": its fp8_w8a8 entries are CPU/sdpa only);
# (iii) bench_dit full preset, nvfp4, fa3, 5 steps: without and with --fp8-linear (stream): s/step, peak GiB;
# (iv)  profile of one full step with --fp8-linear.
# PARTS (default "gemm gate bench profile"; also "resident": bench with --fp8-linear=resident) picks steps.
set -u
OUT="${OUT:-/tmp/h3_gpu}"; CARRY="${CARRY:-../.whl}"
D="$OUT/fp8lin"; mkdir -p "$D"
PARTS="${PARTS:-gemm gate bench profile}"
. benchmarks/_gpu_env.sh
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), torch.cuda.get_device_capability())" 2>&1 | tee "$D/env.txt"

case " $PARTS " in *" gemm "*)
  el "gemm check"
  timeout 90 python3 benchmarks/fp8_gemm_check.py --out "$D/fp8_gemm.json" > "$D/fp8_gemm.log" 2>&1
  el "gemm check exit $?"
;; esac

case " $PARTS " in *" gate "*)
  el "gate --fp8-linear (fa3)"
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py \
    --device cuda --attention fa3 --fp8-linear --budgets benchmarks/calibration_budgets.toml \
    --parity-report "$D/cal_fa3_fp8" > "$D/cal_fa3_fp8.log" 2>&1
  el "calibration fa3 fp8: exit $? $(tail -1 "$D/cal_fa3_fp8.log")"
  # every FP8 GEMM must have run torch._scaled_mm: the report lists the calls per case ("emulated (...)" = fallback)
  el "fp8 GEMM paths in the gate: $(grep -ho 'scaled_mm [0-9][0-9]*\|emulated ([^)]*) [0-9][0-9]*' "$D/cal_fa3_fp8/report.md" \
2>/dev/null | sed 's/ [0-9]*$//' | sort | uniq -c | tr '\n' ';')"
  # the real table has fp8_w8a8 entries for sdpa (CPU) only: fa3 must fail with "no calibrated budget" (never pass
  # under the exact fa3 entries)
  timeout 60 python3 -m pytest -q -x -p no:cacheprovider -m parity parity_tests/test_dit_parity.py -k teacher \
    --device cuda --attention fa3 --fp8-linear --parity-report "$D/gate_fa3_fp8" > "$D/gate_fa3_fp8.log" 2>&1
  el "real gate fp8 (expect 'no calibrated budget'): $(grep -m1 -o 'no calibrated budget[^:]*' "$D/gate_fa3_fp8.log") \
$(tail -1 "$D/gate_fa3_fp8.log")"
  timeout 30 python3 benchmarks/calibration_summary.py "$D/cal_fa3_fp8" > "$D/cal_summary.txt" 2>&1
;; esac

bench() {  # bench LABEL [extra args]
  local label="$1"; shift
  timeout "${BENCH_TIMEOUT:-80}" python3 benchmarks/bench_dit.py --preset full --device cuda --weights nvfp4 \
    --attention fa3 --steps 5 --no-kernels --out "$D/bench_$label.json" "$@" > "$D/bench_$label.log" 2>&1
  el "bench $label exit $?"
}
case " $PARTS " in *" bench "*)
  bench exact
  bench fp8_stream --fp8-linear
;; esac
case " $PARTS " in *" resident "*)
  bench fp8_resident --fp8-linear=resident
;; esac

case " $PARTS " in *" profile "*)
  OUT="$D" timeout 90 python3 benchmarks/profile_dit.py --preset full --weights nvfp4 --attention fa3 --fp8-linear \
    --top 20 > "$D/profile_fp8.log" 2>&1
  el "profile exit $?"
;; esac

# ---- summary
echo "================ fp8lin summary"
cat "$D/env.txt"
[ -f "$D/fp8_gemm.log" ] && { echo "-- (i) GEMM at M = 20,050 (ms per call; rel-L2 vs fp32; codes differing Triton vs torch)"; \
  grep -v '^{' "$D/fp8_gemm.log" | tail -8; }
[ -f "$D/cal_summary.txt" ] && { echo "-- (ii) gate fa3 with --fp8-linear (calibration table: every metric recorded)"; \
  tail -1 "$D/cal_fa3_fp8.log"; cat "$D/cal_summary.txt"; \
  grep -A40 "FP8 linear calls" "$D/cal_fa3_fp8/report.md" 2>/dev/null | grep -m3 "emulated"; }
python3 - "$D" <<'EOF'
import json, sys
from pathlib import Path
d = Path(sys.argv[1])
for f in sorted(d.glob("bench_*.json")):
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        print(f"-- (iii) {f.name}: unreadable ({e})"); continue
    for c in data.get("configs", []):
        if c.get("status") == "ok":
            print(f"-- (iii) {f.stem}: {c['weights']}/{c['attention']} fp8_linear={c.get('fp8_linear')}: "
                  f"{c['step_s_median']:.3f} s/step, peak {c['peak_gib']:.2f} GiB, resident {c['resident_gib']:.2f} GiB, "
                  f"finite={c['finite']}, calls {c.get('fp8_linear_calls')}")
        else:
            print(f"-- (iii) {f.stem}: {c.get('status')} {(c.get('reason') or c.get('error') or '')[:200]}")
EOF
for f in "$D"/bench_*.log; do [ -f "$f" ] && ! grep -q '"configs"' "$D/$(basename "$f" .log).json" 2>/dev/null \
  && { echo "-- $(basename "$f") tail:"; tail -5 "$f"; }; done
[ -f "$D/profile_fp8.log" ] && { echo "-- (iv) profile, one full step, nvfp4 fa3 --fp8-linear"; \
  grep -A12 "by category" "$D/profile_fp8.log" || tail -15 "$D/profile_fp8.log"; }
el "fp8lin done"
