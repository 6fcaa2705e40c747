"""Live mode of the gate (`pytest -m parity --comfy-root R`): record fresh ComfyUI traces, then gate on those.

For every trace found in the given roots that can be paired with what it needs (DiT traces with their checkpoint and
inputs, VAE traces with weights / config / inputs, generation traces with checkpoint and inputs), the same recording
is made again with the ComfyUI checkout R (`python -m oracle record`, `record-vae`, `record-generate`, each in its own
process), into a temporary folder with one sub-folder per root; the files each trace needs are linked (or copied)
beside it. Nothing beyond what the roots hold is recorded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from h3direct.errors import H3Error


def _place(src: Path, folder: Path) -> Path:
    dst = folder / src.name
    if not dst.exists():
        try:
            os.symlink(src.resolve(), dst)
        except OSError:
            shutil.copy2(src, dst)
    return dst


def _oracle(args: list[str], comfy_root: str, log: Path, comfy_python: str | None = None) -> None:
    env = {**os.environ, "H3_COMFY_ROOT": str(comfy_root)}
    python = ["--comfy-python", comfy_python] if comfy_python else []
    cmd = [sys.executable, "-m", "oracle", *args, "--comfy-root", str(comfy_root), *python]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n{r.stdout}{r.stderr}\n")
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise H3Error(f"live recording failed ({' '.join(args[:1])}): {tail[0]} — full log in {log}")


def _manifest(trace: Path) -> dict:
    try:
        return json.loads(trace.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}


def source_drift(roots: list[Path], comfy_root: str) -> str | None:
    """A warning when the H3 sources of the ComfyUI checkout differ from those the traces of `roots` were recorded
    with (manifest `environment.h3_sources_sha256`), else None."""
    from oracle.comfy_env import resolve_root, source_digest

    ours = source_digest(resolve_root(comfy_root))
    recorded: dict[str, list[str]] = {}
    for root in roots:
        for j in sorted(Path(root).glob("*.json")):
            digest = (_manifest(j.with_suffix(".safetensors")).get("environment") or {}).get("h3_sources_sha256")
            if digest and digest != ours:
                recorded.setdefault(digest, []).append(j.stem)
    if not recorded:
        return None
    names = sorted(n for v in recorded.values() for n in v)
    return (f"live mode: the H3 sources of {comfy_root} (sha256 {ours[:12]}) differ from those {len(names)} "
            f"trace(s) were recorded with (e.g. {names[0]}: {next(iter(recorded))[:12]}); fresh recordings may "
            f"legitimately differ from the committed fixtures")


def record_live(roots: list[Path], comfy_root: str, config=None) -> Path:
    """Re-record every pairable trace of `roots` with ComfyUI at `comfy_root`; returns the folder of new traces."""
    import warnings

    from parity_tests.discovery import find_dit_cases, find_generate_cases, find_vae_cases

    drift = source_drift(roots, comfy_root)
    if drift:
        warnings.warn(drift, stacklevel=2)
        if config is not None:
            config._h3_live_warning = drift

    device = config.getoption("--device") if config is not None else "cpu"
    python = config.getoption("--comfy-python") if config is not None else None
    device = "cuda" if str(device).startswith("cuda") else "cpu"
    out = Path(tempfile.mkdtemp(prefix="h3_live_traces_"))
    log = out / "record.log"
    dit, _ = find_dit_cases(roots)
    vae, _ = find_vae_cases(roots)
    gen, _ = find_generate_cases(roots)
    folders: dict[Path, Path] = {}

    def folder_for(trace: Path) -> Path:
        src = trace.parent.resolve()
        if src not in folders:
            folders[src] = out / f"{len(folders)}_{src.name}"
            folders[src].mkdir()
        return folders[src]

    for c in dit:
        d = folder_for(c.trace)
        ckpt, inputs = _place(c.checkpoint, d), _place(c.inputs, d)
        detail = str(_manifest(c.trace).get("trace_detail", "full"))
        _oracle(["record", "--checkpoint", str(ckpt), "--inputs", str(inputs), "--compute-dtype", c.compute,
                 "--detail", detail, "--device", device, "--no-twin", "--out", str(d / c.trace.name)], comfy_root,
                log, python)
    for c in vae:
        d = folder_for(c.trace)
        weights, cfg, inputs = _place(c.weights, d), _place(c.config, d), _place(c.inputs, d)
        m = _manifest(c.trace)
        calls = ["--calls", m["calls_recorded"]] if m.get("calls_recorded") else []
        _oracle(["record-vae", "--weights", str(weights), "--config", str(cfg), "--inputs", str(inputs),
                 "--dtype", c.dtype, "--op", c.kind.split("_")[1], *calls, "--out", str(d / c.trace.name)],
                comfy_root, log, python)
    for c in gen:
        d = folder_for(c.trace)
        ckpt, inputs = _place(c.checkpoint, d), _place(c.inputs, d)
        m = c.manifest
        shift = m.get("sampling", {})
        _oracle(["record-generate", "--checkpoint", str(ckpt), "--inputs", str(inputs), "--steps", str(m["steps"]),
                 "--sampler", str(m.get("sampler", "euler")), "--scheduler", str(m.get("scheduler", "simple")),
                 "--shift-video", str(shift.get("shift", 12.0)), "--shift-audio", str(shift.get("audio_shift", 3.0)),
                 "--compute-dtype", c.compute, "--out", str(d / c.trace.name)], comfy_root, log, python)
    if not folders:
        raise H3Error(f"live mode: no pairable trace in {', '.join(map(str, roots))} to re-record")
    return out
