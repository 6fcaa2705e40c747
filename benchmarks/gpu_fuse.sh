#!/usr/bin/env bash
# One H200 call (expected ~3.5-4 min; steps capped at FUSE_BUDGET_S = 235 s in all, each under its own timeout):
# the Triton kernels of h3direct/dit/fused.py
# (RMSNorm + adaLN modulation, gated residual, in-place SwiGLU, q/k RMSNorm + rope) and the strided-v / freed-MLP-input memory changes.
#   (i)   benchmarks/check_fused.py at the full shape (S 20,050, hidden 5376, ffn 14336, bf16): fused vs eager vs an
#         fp64 reference, ms per call; SwiGLU bitwise; fc2 on the strided SwiGLU view (bitwise, no hidden copy);
#         fa3 with the strided v (bitwise); q/k norm + rope vs comfy-kitchen's kernel
#   (ii)  pytest -m parity --device cuda --attention fa3 on the committed fixtures (fixtures/, fixtures/gpu/), fused
#         on: a calibration pass (benchmarks/calibration_budgets.toml: every metric recorded) and the real gate
#         (parity_tests/budgets.toml), then the real gate for cudnn_sdpa (its v copy moved into the backend)
#   (iii) benchmarks/bench_dit.py full preset, nvfp4 W4A16, fa3, 5 steps: fused (default) vs H3_FUSED=0
#   (iv)  benchmarks/profile_dit.py one step, fused, top 15
# Results under $OUT/fuse/; a summary table at the end.
#
#   OUT=/tmp/out CARRY=../.whl bash benchmarks/gpu_fuse.sh      # from the repository root
set -u
OUT="${OUT:-/tmp/h3_gpu}"; CARRY="${CARRY:-../.whl}"
. benchmarks/_gpu_env.sh   # el, $SITE (comfy-kitchen, fa3), PYTHONPATH
R="$OUT/fuse"; mkdir -p "$R"
# the whole script stays within FUSE_BUDGET_S (default 235 s from the start): each step's timeout is cut to what is
# left, and a step with less than 15 s left is skipped (said so), never the whole script
BUDGET="${FUSE_BUDGET_S:-235}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee "$R/env.txt"

# (i) kernels at the full shape
step 60 python3 benchmarks/check_fused.py --device cuda --out "$R/check_fused.json" > "$R/check_fused.log" 2>&1
el "check_fused exit $?"; cat "$R/check_fused.log"

# (ii) the gate with the fused path (the default on CUDA)
step 50 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py --device cuda \
  --attention fa3 --budgets benchmarks/calibration_budgets.toml --parity-report "$R/cal_fa3_fused" \
  > "$R/cal_fa3_fused.log" 2>&1
el "calibration fa3 fused: $(tail -1 "$R/cal_fa3_fused.log")"
step 50 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py --device cuda \
  --attention fa3 --parity-report "$R/gate_fa3_fused" > "$R/gate_fa3_fused.log" 2>&1
el "gate fa3 fused (budgets.toml): $(tail -1 "$R/gate_fa3_fused.log")"
grep -E "^FAILED|exceeds|> budget" "$R/gate_fa3_fused.log" | head -5

# (iii) speed and peak memory, fused vs eager (one process each: the env var is read per call, weights rebuilt)
for mode in fused eager; do
  f=1; [ $mode = eager ] && f=0
  step 80 env H3_FUSED=$f python3 benchmarks/bench_dit.py --preset full --device cuda --weights nvfp4 --attention fa3 \
    --steps 5 --no-kernels --out "$R/bench_$mode.json" > "$R/bench_$mode.log" 2>&1
  el "bench fa3 $mode exit $?: $(grep -m1 'nvfp4/fa3:' "$R/bench_$mode.log")"
done

# (iv) one step profiled, fused
step 70 python3 benchmarks/profile_dit.py --attention fa3 --weights nvfp4 --top 15 > "$R/profile_fused.log" 2>&1
el "profile fa3 fused exit $?"; tail -28 "$R/profile_fused.log"

# (ii, continued) cudnn_sdpa's gate with the fused path, if time is left
step 45 python3 -m pytest -q -p no:cacheprovider -m parity parity_tests/test_dit_parity.py --device cuda \
  --attention cudnn_sdpa --parity-report "$R/gate_cudnn_fused" > "$R/gate_cudnn_fused.log" 2>&1
el "gate cudnn_sdpa fused (budgets.toml): $(tail -1 "$R/gate_cudnn_fused.log")"

# ---- summary
python3 - "$R" <<'EOF' 2>&1 | tee "$R/summary.txt"
import json, sys
from pathlib import Path
r = Path(sys.argv[1])
def load(name):
    try:
        return json.loads((r / name).read_text())
    except Exception as exc:
        return {"missing": f"{name}: {type(exc).__name__}"}
print("\n== fused kernels at S = 20,050 (check_fused.py)")
c = load("check_fused.json")
for k in ("norm_modulate", "gated_residual"):
    v = c.get(k, {})
    print(f"  {k:15s} fused {v.get('fused_ms', float('nan')):6.3f} ms  eager {v.get('eager_ms', float('nan')):6.3f} ms"
          f"  rel-L2 vs fp64: fused {v.get('fused_vs_fp64', float('nan')):.3e}  eager "
          f"{v.get('eager_vs_fp64', float('nan')):.3e}  one rounding {v.get('one_rounding', float('nan')):.3e}"
          f"  {'ok' if v.get('ok') else 'FAIL'}")
v = c.get("swiglu", {})
print(f"  {'swiglu_':15s} fused {v.get('fused_ms', float('nan')):6.3f} ms  eager {v.get('eager_ms', float('nan')):6.3f} ms"
      f"  bitwise bf16 {v.get('bfloat16', {}).get('bitwise')} fp32 {v.get('float32', {}).get('bitwise')}")
v = c.get("qk_norm_rope", {})
print(f"  {'qk_norm_rope_':15s} fused {v.get('fused_ms', float('nan')):6.3f} ms  comfy-kitchen "
      f"{v.get('kitchen_ms', float('nan')):6.3f} ms  rel-L2 vs fp64: fused {v.get('fused_vs_fp64', float('nan')):.3e}"
      f"  kitchen {v.get('kitchen_vs_fp64', float('nan')):.3e}  eager {v.get('eager_vs_fp64', float('nan')):.3e}"
      f"  {'ok' if v.get('ok') else 'FAIL'}")
print(f"  fc2 strided input: {c.get('fc2_strided_input')}")
print(f"  fa3 strided v:     {c.get('fa3_strided_v')}")
print("\n== DiT step, full preset, nvfp4 W4A16, fa3, median of 5 (bench_dit.py)")
print(f"  {'mode':6s} {'s/step':>8s} {'peak GiB':>9s} {'warm-up s':>9s}")
res = {}
for mode in ("fused", "eager"):
    b = load(f"bench_{mode}.json")
    cfg = next((x for x in b.get("configs", []) if x.get("attention") == "fa3"), None) if isinstance(b, dict) else None
    if cfg is None:
        print(f"  {mode:6s} (no result: {b.get('missing', 'no fa3 config') if isinstance(b, dict) else b})")
        continue
    res[mode] = cfg
    num = {k: cfg.get(k) if isinstance(cfg.get(k), (int, float)) else float("nan")
           for k in ("step_s_median", "peak_gib", "warmup_s")}
    print(f"  {mode:6s} {num['step_s_median']:8.3f} {num['peak_gib']:9.2f} {num['warmup_s']:9.2f}"
          f"   x0 video rms {cfg.get('x0_video_rms')}, finite {cfg.get('finite')}")
if len(res) == 2 and all(isinstance(res[m].get("peak_gib"), float) for m in res):
    d = res["eager"]["step_s_median"] - res["fused"]["step_s_median"]
    print(f"  fused saves {1e3 * d:.0f} ms/step; peak {res['fused']['peak_gib'] - res['eager']['peak_gib']:+.2f} GiB")
EOF
python3 benchmarks/calibration_summary.py "$R/cal_fa3_fused" 2>&1 | tee -a "$R/summary.txt"
el "done"
