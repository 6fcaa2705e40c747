"""Planted failures for the gate's tests, installed in this process (`install`) or, through the environment, in every
Python a test starts (`environment`): the gate's own pytest and each replay command it prints, run as printed.

A plant is `NAME[@CHECKPOINT[:COMPUTE]]` (the DiT plants: only in the models loaded from that checkpoint file stem,
in that compute dtype) or `NAME=ARGUMENT`:

- `glue`: the hidden state handed to block 1 scaled by 1.02 (each block alone still correct: only a run of the whole
  model sees it, a free run or the teacher-forced inner forward);
- `fc1`, `qkv`: block 1's `mlp.fc1` / `attn.qkv_proj` output scaled by 1.01 (a module output);
- `carry`: the carried audio handed to the model scaled by 1.05 (a model input; teacher forcing never meets it);
- `inner`: the inner forward's outputs scaled by 1.01 (the model's outputs);
- `x0`: the step's x0 (the sampler's denoised video) scaled by 1.01;
- `vae`: the output of h3direct's video VAE decoder's first transformer block scaled by 1.01;
- `fp8`: every 8-bit block linear's output scaled by 1.2 (`--fp8-linear`; e4m3's own rounding is a few per cent);
- `stand_in=BACKEND:EPS`: an approximate attention backend replaced by a CPU stand-in of its kind with a seeded
  relative error EPS (no approximate kernel runs on a CPU): exact attention for sage2 and ck_int8 (and kj_head_sliced's
  sage2 slices), h3direct's FP8 emulation for fa3_fp8, comfy-kitchen's eager Sol-Attn for sol_attn, budget_attn's
  selection and its kernel's reference for budget_attn, each plus the error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ENV = "H3_TEST_PLANT"
SCALE = {"glue": 1.02, "fc1": 1.01, "qkv": 1.01, "carry": 1.05, "inner": 1.01, "x0": 1.01, "vae": 1.01, "fp8": 1.2}
MODULE = {"fc1": "blocks.1.mlp.fc1", "qkv": "blocks.1.attn.qkv_proj"}


# ---- attention stand-ins ------------------------------------------------------------------------------------------

def noise(out: torch.Tensor, eps: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(out.numel())
    n = torch.randn(out.shape, generator=g, dtype=torch.float32)
    return (out.float() + eps * n * (out.float().norm() / n.norm())).to(out.dtype)


def stand_in(backend: str, eps: float):
    """[B, H, S, D] -> [B, H, S, D]: what the gate's reference for `backend` computes, plus a relative error eps."""
    from h3direct.dit import attention as A

    def exact(q, k, v):
        return noise(F.scaled_dot_product_attention(q, k, v), eps)

    def fp8(q, k, v):
        from h3direct.dit.fp8_attention import fp8_attention_reference

        return noise(fp8_attention_reference(q, k, v).to(q.dtype), eps)

    def sol(q, k, v, opts):
        from h3direct.traces.kernels import sol_algorithm

        prefix = A._PREFIX_ROWS.get()
        out = sol_algorithm(q, k, v, prefix, opts.sol_attn).reshape(q.shape[0], q.shape[2], q.shape[1], q.shape[3])
        return noise(out.transpose(1, 2).to(q.dtype), eps)

    def budget(q, k, v, opts):
        from h3direct.dit.block_sparse_triton import block_sparse_reference
        from h3direct.dit.budget_attention import select

        keep = select(q, k, A._PREFIX_ROWS.get(), opts.budget_attn).keep
        return noise(block_sparse_reference(q, k, v, keep, tail=opts.budget_attn.tail)[0], eps)

    return {"fa3_fp8": fp8, "sol_attn": sol, "budget_attn": budget}.get(backend, exact)


def stand_in_backend(backend: str, eps: float, half_only: bool = False):
    """The registry entry (`attention.Backend`) of `backend`'s CPU stand-in: available on the CPU in any dtype, or
    (half_only) in bf16/fp16 only, as the real kernels."""
    from h3direct.dit import attention as A

    avail = A._half_only if half_only else A._always
    fn = stand_in(backend, eps)
    if half_only:
        def fn(q, k, v, inner=fn):  # as SageAttention asserts: never handed fp32
            assert q.dtype in (torch.float16, torch.bfloat16), f"{backend} handed {q.dtype}"
            return inner(q, k, v)
    takes_options = backend in ("sol_attn", "budget_attn")  # the stand-in runs with the backend's options
    options = A._REGISTRY[backend].options if takes_options else None
    if options is not None:
        def avail(like, opts, inner=avail):
            return inner(like)
    return A.Backend(backend, fn, avail, exact=False, options=options)


# ---- installing ---------------------------------------------------------------------------------------------------

def _parse(spec: str) -> list[tuple[str, str | None, str | None, str | None]]:
    """'glue@h3_fx_bf16:bf16,vae,stand_in=sage2:0.2' -> [(name, checkpoint stem, compute, argument)]."""
    out = []
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, arg = item.partition("=")
        name, _, target = name.partition("@")
        stem, _, compute = target.partition(":")
        if name not in SCALE and name != "stand_in":
            raise ValueError(f"unknown plant {name!r}")
        out.append((name, stem or None, compute or None, arg or None))
    return out


def install(spec: str) -> None:
    """Install the plants of `spec` in this process (before the gate or a replay loads anything)."""
    from h3direct.dit import attention as A
    from h3direct.dit import denoiser, loader

    plants = _parse(spec)
    for name, _, _, arg in plants:
        if name == "stand_in":
            backend, _, eps = arg.partition(":")
            A._REGISTRY[backend] = stand_in_backend(backend, float(eps))
    dit_plants = [p for p in plants if p[0] not in ("stand_in", "vae", "fp8")]
    load = loader.load_dit

    def load_planted(checkpoint, *a, **k):
        dit = load(checkpoint, *a, **k)
        compute = str(dit.compute_dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")
        dit._h3_plants = {n for n, stem, c, _ in dit_plants
                          if stem in (None, Path(str(checkpoint)).stem) and c in (None, compute)}
        for n in dit._h3_plants & set(MODULE):
            dit.get_submodule(MODULE[n]).register_forward_hook(lambda m, i, out, s=SCALE[n]: out * s)
        if "glue" in dit._h3_plants:
            dit.blocks[1].register_forward_pre_hook(lambda m, args: (args[0] * SCALE["glue"], *args[1:]))
        if "inner" in dit._h3_plants:
            inner = dit.forward_inner
            dit.forward_inner = lambda *a, **k: tuple(t * SCALE["inner"] for t in inner(*a, **k))
        return dit

    loader.load_dit = load_planted
    forward = denoiser.model_forward

    def model_forward(model, video, audio, *a, **k):
        if "carry" in getattr(model, "_h3_plants", ()):
            audio = audio * SCALE["carry"]
        return forward(model, video, audio, *a, **k)

    denoiser.model_forward = model_forward
    call = denoiser.Denoiser.__call__

    def denoise(self, *a, **k):
        x0_v, x0_a = call(self, *a, **k)
        return (x0_v * SCALE["x0"], x0_a) if "x0" in getattr(self.model, "_h3_plants", ()) else (x0_v, x0_a)

    denoiser.Denoiser.__call__ = denoise
    if any(p[0] == "fp8" for p in plants):
        from h3direct.dit.linear import FP8Linear

        fp8_forward = FP8Linear.forward
        FP8Linear.forward = lambda self, x: fp8_forward(self, x) * SCALE["fp8"]
    if any(p[0] == "vae" for p in plants):
        _plant_vae()


def _plant_vae() -> None:
    """h3direct's video VAE, as `trace-vae` loads it, with its decoder's first transformer block scaled."""
    from h3direct.vae import loader
    from h3direct.vae.video import VideoVAE

    load = loader.load_vae

    def load_planted(*a, **k):
        vae = load(*a, **k)
        if isinstance(vae, VideoVAE):
            vae.get_submodule("decoder.transformer_blocks.0").register_forward_hook(
                lambda m, i, out: out * SCALE["vae"])
        return vae

    loader.load_vae = load_planted


def environment(folder: Path, spec: str) -> dict:
    """The environment of a Python that starts with the plants of `spec` installed: a `sitecustomize` in `folder`
    (written here) on PYTHONPATH, with this checkout for `tests.gate.plants`. Only this Python installs them: ComfyUI's
    own environment (`--comfy-python`) runs as it is."""
    repo = Path(__file__).resolve().parents[2]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import os\nimport sys\n"
        f"if os.environ.get({ENV!r}) and sys.prefix == {sys.prefix!r}:\n"
        "    from tests.gate.plants import install\n"
        f"    install(os.environ[{ENV!r}])\n")
    path = os.pathsep.join(p for p in (str(folder), str(repo), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, ENV: spec, "PYTHONPATH": path}
