"""Final table of a benchmark run: reads bench_dit.json, bench_vae.json, bench_generate.json from a folder,
prints one compact summary and writes summary.json beside them.

    python3 benchmarks/summarize.py $OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def _load(folder: Path, name: str) -> dict | None:
    p = folder / f"{name}.json"
    if not p.is_file():
        return None
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def summarize(folder: Path) -> dict:
    a = C.ANCHOR
    rows, summary = [], {"anchor": a}
    dit = _load(folder, "bench_dit")
    if dit is None:
        rows.append(["DiT", "-", None, None, None, "no bench_dit.json (killed or not run)"])
    else:
        env = dit.get("env", {})
        summary["gpu"] = env.get("gpu")
        summary["torch"] = env.get("torch")
        summary["seq_len"] = dit.get("workload", {}).get("seq_len")
        mm = [m for m in (dit.get("kernels") or {}).get("matmul", [])]
        if mm:
            summary["bf16_matmul_tflops"] = mm[0]["tflops"]
            rows.append([f"bf16 matmul {mm[0]['m']}^3", "TFLOP/s", mm[0]["tflops"], None, None,
                         f"{mm[0]['ms']:.2f} ms"])
        for att in (dit.get("kernels") or {}).get("attention", []):
            if "ms" in att:
                rows.append([f"attention {att['backend']} (S={att['shape'][2]:,})", "ms", att["ms"], None, None,
                             f"{att['tflops']:.0f} TFLOP/s"])
        summary["dit"] = []
        for c in dit.get("configs", []):
            name = f"DiT step {c['weights']}/{c['attention']}"
            if c.get("status") == "ok":
                note = (f"x{c['vs_comfyui_speedup']:.2f} vs ComfyUI, {c['vs_floor_ratio']:.2f}x floor, "
                        f"{c['tflops']:.0f} TFLOP/s" + ("" if c.get("finite", True) else "; NONFINITE output"))
                rows.append([name, "s/step", c["step_s_median"], c.get("peak_gib"), c.get("resident_gib"), note])
                summary["dit"].append({k: c.get(k) for k in ("weights", "attention", "step_s_median", "peak_gib",
                                                            "resident_gib", "tflops", "vs_comfyui_speedup",
                                                            "vs_floor_ratio", "finite")})
            else:
                rows.append([name, "-", None, None, None, f"{c.get('status')}: "
                             f"{(c.get('reason') or c.get('error') or '')[:60]}"])
    vae = _load(folder, "bench_vae")
    if vae is None:
        rows.append(["VAE", "-", None, None, None, "no bench_vae.json (killed or not run)"])
    else:
        for part in ("video_decode", "video_encode_image", "audio_decode"):
            r = vae.get(part)
            if not r:
                continue
            if r.get("status") == "ok":
                shape = r.get("pixels") if part == "video_encode_image" else r.get("latent")
                rows.append([part.replace("_", " "), "s", r["median_s"], r.get("peak_gib"), r.get("resident_gib"),
                             f"{r.get('dtype')}, input {'x'.join(map(str, shape or []))}"
                             + ("" if r.get("finite", True) else ", NONFINITE")])
                summary[part] = {"s": r["median_s"], "peak_gib": r.get("peak_gib")}
            else:
                rows.append([part.replace("_", " "), "-", None, None, None,
                             f"{r.get('status')}: {(r.get('reason') or r.get('error') or '')[:60]}"])
    gen = _load(folder, "bench_generate")
    if gen is None:
        rows.append(["generate", "-", None, None, None, "no bench_generate.json (killed or not run)"])
    else:
        st = gen.get("stages", {})
        for name in ("ref_encode", "sampling", "video_decode", "audio_decode"):
            if name in st:
                rows.append([f"generate: {name}", "s", st[name]["s"], st[name].get("peak_gib"), None,
                             st[name]["status"]])
        steps = gen.get("step_s", [])
        rows.append(["generate: end to end", "s", gen.get("end_to_end_s"), gen.get("peak_gib"), None,
                     f"driver {gen.get('driver')}; "
                     + ("complete" if gen.get("end_to_end_complete") else "INCOMPLETE")
                     + (f"; steps {', '.join(f'{s:.2f}' for s in steps)} s" if steps else "")])
        summary["generate"] = {"driver": gen.get("driver"), "end_to_end_s": gen.get("end_to_end_s"),
                               "peak_gib": gen.get("peak_gib"),
                               "complete": gen.get("end_to_end_complete"), "step_s": steps,
                               "stages": {k: v.get("s") for k, v in st.items()}}
    C.print_table(f"SUMMARY ({summary.get('gpu') or 'device ?'}, torch {summary.get('torch') or '?'}; ComfyUI "
                  f"{a['comfyui_s_per_step']} s/step, floor {a['floor_s_per_step']} s; targets: the contract)",
                  ["what", "unit", "value", "peak GiB", "resident GiB", "note"], rows)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import os

    folder = Path(argv[0] if argv else os.environ.get("OUT", "."))
    summarize(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
