#!/usr/bin/env bash
# One H200 call (expected ~2-2.5 min; the python step is capped at 180 s, the script at HOST_BUDGET_S = 200 s):
# how much of a full-size DiT step the GPU spends idle waiting for the host, after the step-invariant caches and the
# host-side σ plan (h3direct/dit/model.py StepInvariants, timesteps.host_stream_times, sampling/host_sigma.py).
#   benchmarks/host_step.py, full preset, NVFP4 W4A16, fa3 when importable (else sdpa), on one model built once:
#   - the host mirror of σ -> (t_video, t_audio) against the GPU's own float32 ops (must be 0 mismatches: the
#     Denoiser's step plan, hence its output, is bitwise the uncached path's only if it is);
#   - 4 steps with a torch.cuda.synchronize() around each under torch.profiler: wall, GPU busy (union of kernel /
#     memcpy / memset intervals), idle, the largest gaps (kernels around them, the host op that launched the next
#     one) and the synchronizing runtime calls inside each Denoiser call;
#   - torch.cuda.set_sync_debug_mode("warn") over warm steps (same σ tensor, fresh tagged σ, fresh untagged σ) and
#     the uncached path (old plan), with the h3direct call sites of every synchronizing call;
#   - bitwise x0: warm Denoiser vs uncached path at σ 0.8 and 0.3;
#   - synced and CUDA-event (run_contract's timing, no per-step sync) s/step: Denoiser vs uncached path.
# Results under $OUT/host/ (host_step.json, host_step.log, summary.txt).
#
#   OUT=/tmp/out CARRY=../.whl bash benchmarks/gpu_host.sh      # from the repository root
set -u
OUT="${OUT:-/tmp/h3_gpu}"; CARRY="${CARRY:-../.whl}"
. benchmarks/_gpu_env.sh   # el, step, $SITE (comfy-kitchen, fa3), PYTHONPATH
R="$OUT/host"; mkdir -p "$R"
BUDGET="${HOST_BUDGET_S:-200}"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
  2>&1 | tee "$R/env.txt"
python3 -c "import fa3_fwd_interface" 2>/dev/null && el "fa3 importable" || el "fa3 NOT importable: sdpa"

step 180 python3 benchmarks/host_step.py --preset full --weights nvfp4 --attention auto --steps 4 \
  --out "$R/host_step.json" > "$R/host_step.log" 2>&1
rc=$?
el "host_step exit $rc"
# the summary is the tail of the log (printed by host_step.py at its end); on a failure show the log's end instead
if grep -q "== host/device idle" "$R/host_step.log"; then
  sed -n '/== host\/device idle/,$p' "$R/host_step.log" | tee "$R/summary.txt"
else
  tail -40 "$R/host_step.log" | tee "$R/summary.txt"
fi
