"""`h3direct make-checkpoint`: a deterministic synthetic checkpoint in ComfyUI's exact format.

DiT (`--component dit`): every key, shape and storage dtype of `h3direct.checkpoint.keys.dit_keys`.
Initialisation (the recipe of `../shared/oracle/checkpoint_info*.json`, which gives O(1) activations through
all blocks): one `torch.Generator(device).manual_seed(seed)`, master tensors drawn in sorted key order of the
dense layout, fp32 master values cast to the storage dtype:

- linear weight ~ N(0, (gain / sqrt(fan_in))²), gain 1 except `adaln_proj` (1.5; 0.6 in the curve form) and
  `time_embedder.proj_out` (2.0); bias ~ N(0, 0.02²); RMSNorm weight = 1 + N(0, 0.05²);
- `rope.inv_freq` = 10000^(-arange(L)/L) (no draw);
- `adaln_t_table[:, j]` = a_j·cos(π f_j t + φ_j) + b_j on t = linspace(0, 1, grid), drawn as a ~ N(0,1)[k],
  f ~ U(0.5, 4)[k], φ ~ U(0, 2π)[k], b ~ N(0, 0.25)[k] (std 0.5).

On the CPU with seed 0 this reproduces `h3_tiny_bf16.safetensors` bit for bit (the curve file too, except
`adaln_t_table`, which differs in the last bits: the oracle evaluated the cosine slightly differently). NVFP4
layers are quantized from the bf16-rounded master weight exactly as ComfyUI's `TensorCoreNVFP4Layout.quantize`
does, so `--quant nvfp4` with seed 0 reproduces `h3_tiny_nvfp4.safetensors` too. `--device cuda` draws from a CUDA
generator: deterministic, but different numbers from the CPU.

The file is streamed: the safetensors header is written first (all shapes are known from the layout), then
each tensor is generated and written one at a time, so the full 50-layer model never needs more memory than
its largest tensor (~1.1 GB fp32 master of a full-form `adaln_proj.linear.weight` plus its bf16 copy).

`--attention-structure local` (DiT blocks only; the token refiner stays as above) reshapes three tensor families
after their draws, drawing nothing from the main generator, so every other tensor keeps its value. Why: with
independent random q/k projections a synthetic DiT attends almost uniformly (entropy close to log S), where a
sparse attention method cannot work, while real video DiTs attend locally in (t, h, w). Construction, per block
b, hidden size d, head dim D, with a unit-rms direction u_b ~ N(0, 1)^d from a second generator (seed + 7919):

1. a token-independent part of the attention input: the attention shift of every modality row gets + ρ·u_b in
   `adaln_proj.linear.bias` (feature (g·6 + 0)·d + i), so h_i = n_i + ρ·u_b, where n_i (norm·(1 + scale) + the
   time-dependent shift) has rms ~1: the common part carries ρ²/(1 + ρ²) of h's energy (0.9 at ρ = 3);
2. q and k agree on it: with P = û ûᵀ, the k third of `attn.qkv_proj.weight` becomes W_q·P + W_k·(I − P).
   Pre-rope, q_i = ρ·a + W_q·n_i and k_j = ρ·a + W_k'·n_j with the same a = W_q·u_b, and token parts that are
   independent (the self-match i = j is not favoured beyond what the position gives);
3. a rope-shaped temperature: `q_norm.weight` = `k_norm.weight` = drawn value × γ·ψ_c over the D channels. Rope
   rotates channel pairs (c, c + 3L), c < 3L, pair c on axis a = c // L (t, h, w) at ω_j = inv_freq[j], j = c mod L.
   With q ≈ k ≈ a after the norm, the common part's logit is
       ℓ(i, j) ≈ γ²·√D·ρ²/(1 + ρ²) · Σ_c ψ_c²·|â_c|² cos(ω_j·(p_i − p_j)_a) / D,
   a sum of cosines in the (t, h, w) distance: maximal at Δp = 0 and decaying with it. ψ_c² is the spectrum of a
   Gaussian kernel of width σ_a sampled at rope's log-spaced frequencies (dω = ω·d log ω):
       ψ² ∝ ψ₀² + 16·ω_j·exp(−(ω_j·σ_a)²/2) / Σ_j' ω_j'·exp(−(ω_j'·σ_a)²/2),  mean ψ² = 1 over the D channels,
   with σ_t = 6 rope units (about one latent frame of four pixel frames, 5/3 · 4), σ_h = σ_w = 3 (two tokens of
   the area-normalised grid at S ≈ 4.5 k) and ψ₀ = 0.25 on the unrotated channels and as a floor: γ sets the
   logit range (γ²·√D·ρ²/(1 + ρ²) ≈ 23 nats at the defaults γ = 1.5, ρ = 3).

What it does to the attention (the mass near each query, the entropy, how far sparse attention lands from exact
attention), against the random checkpoint, is measured on the GPU and logged with the benchmark results.

VAEs (`--component video_vae|audio_vae`) come from `h3direct.vae.synthetic.make_state_dict` and are written
by the same writer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from h3direct.errors import ConfigError, H3Error

CURVE_GRID = {"tiny": 33, "small": 33, "full": 1025}  # adaln_t_table rows of the curve form per preset
CURVE_TIME_EMBED_DIM = 8
COMPONENTS = ("dit", "video_vae", "audio_vae")
STRUCTURES = ("random", "local")
LOCAL_STRENGTH, LOCAL_SHIFT = 1.5, 3.0  # γ, ρ of --attention-structure local
LOCAL_SIGMA = (6.0, 3.0, 3.0)  # kernel widths σ_t, σ_h, σ_w in rope position units
LOCAL_FLOOR = 0.25  # ψ₀
STRUCTURE_SEED_OFFSET = 7919  # the direction generator's seed is seed + this

# safetensors dtype codes of the storage dtypes we write
_ST_DTYPE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "uint8": "U8", "int8": "I8",
             "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0", "int64": "I64",
             "int32": "I32"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--component", choices=COMPONENTS, default="dit", help="which model to write (default dit)")
    parser.add_argument("--preset", default="tiny",
                        help="size preset: tiny | small | full, or their -curve forms (default tiny)")
    parser.add_argument("--config", metavar="JSON", help="config as a JSON file or inline JSON object "
                        "(H3Config fields for the DiT, constructor args for a VAE); overrides --preset")
    parser.add_argument("--quant", choices=("none", "nvfp4"), default="none", help="DiT weight format")
    parser.add_argument("--nvfp4-layers", choices=("all", "dit"), default="all",
                        help="NVFP4 on DiT + token-refiner block linears (all, as the shared tiny files) or "
                             "DiT blocks only (dit, 4 x num_layers linears)")
    parser.add_argument("--adaln", choices=("full", "curve"), default=None,
                        help="adaLN form: full (time embedder) or curve (adaln_t_table, the pruned layout)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-structure", choices=STRUCTURES, default="random",
                        help="DiT attention: random (independent q/k, near-uniform attention) or local (q/k share a "
                             "positional part: attention local in t, h, w; see the module docstring)")
    parser.add_argument("--attention-strength", type=float, default=LOCAL_STRENGTH, metavar="GAMMA",
                        help=f"local: rms of the q/k norm weights, the logit temperature (default {LOCAL_STRENGTH})")
    parser.add_argument("--attention-shift", type=float, default=LOCAL_SHIFT, metavar="RHO",
                        help=f"local: size of the shared positional part vs the token part (default {LOCAL_SHIFT})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where tensors are generated")
    parser.add_argument("--output", "-o", "--out", dest="out", required=True, metavar="PATH",
                        help="output .safetensors file (--out is an old spelling)")


# ---------------------------------------------------------------- config

def _load_json_arg(text: str) -> dict:
    src = text
    if not text.lstrip().startswith("{"):
        p = Path(text)
        if not p.is_file():
            raise ConfigError(f"--config {text}: no such file (give a JSON file or an inline JSON object)")
        src = p.read_text()
    try:
        d = json.loads(src)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--config {text}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"--config {text}: expected a JSON object, got {type(d).__name__}")
    return d.get("config", d) if isinstance(d.get("config"), dict) else d


def resolve_config(preset: str = "tiny", config_json: str | None = None, adaln: str | None = None):
    """H3Config from a preset name or a JSON config, switched to the requested adaLN form."""
    from h3direct.config import H3Config

    if config_json is not None:
        d = _load_json_arg(config_json)
        known = {"hidden_size", "num_layers", "token_refiner_num_layers", "num_attention_heads", "attention_head_dim",
                 "ffn_hidden_size", "latents_dim", "audio_latents_dim", "text_dim", "timestep_input_dim",
                 "time_embed_hidden_size", "time_embed_dim", "rope_inv_freq_len", "adaln_curve_grid", "norm_eps",
                 "qk_norm_eps", "final_norm_eps", "sigma_shift_video", "sigma_shift_audio", "patch_size",
                 "image_model", "dtype"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"--config: unknown field(s) {', '.join(unknown)}")
        try:
            cfg = H3Config.from_dict(d)
        except TypeError as exc:
            raise ConfigError(f"--config: {exc}") from None
        grid = cfg.adaln_curve_grid or CURVE_GRID["full"]
    else:
        cfg = H3Config.from_name(preset)
        grid = cfg.adaln_curve_grid or CURVE_GRID.get(preset.removesuffix("-curve"), CURVE_GRID["full"])
    if adaln == "curve" and not cfg.is_curve:
        cfg = cfg.replace(adaln_curve_grid=grid, time_embed_dim=CURVE_TIME_EMBED_DIM)
    elif adaln == "full" and cfg.is_curve:
        # the time-embedder sizes of the matching full-form preset
        base = preset.removesuffix("-curve")
        full = H3Config.from_name(base if config_json is None and base in ("tiny", "small") else "full")
        cfg = cfg.replace(adaln_curve_grid=None, time_embed_dim=full.time_embed_dim,
                          timestep_input_dim=full.timestep_input_dim,
                          time_embed_hidden_size=full.time_embed_hidden_size)
    return cfg


# ---------------------------------------------------------------- initialisation

def _gain(name: str, curve: bool) -> float:
    if ".adaln_proj." in name or name.startswith("adaln_proj."):
        return 0.6 if curve else 1.5
    if name.startswith("time_embedder.proj_out."):
        return 2.0
    return 1.0


def init_master(spec, config, g, device):
    """fp32 master value of one dense-layout tensor, drawn from generator `g` (nothing drawn for rope)."""
    import torch

    shape = spec.logical_shape
    if spec.kind == "rope.inv_freq":
        n = shape[0]
        return 10000 ** (-torch.arange(n, dtype=torch.float32, device=device) / n)
    if spec.kind == "adaln_t_table":
        grid, k = shape
        a = torch.randn(k, generator=g, device=device)
        f = 0.5 + 3.5 * torch.rand(k, generator=g, device=device)
        phi = 2 * math.pi * torch.rand(k, generator=g, device=device)
        b = 0.5 * torch.randn(k, generator=g, device=device)
        t = torch.linspace(0, 1, grid, device=device)[:, None]
        return a * torch.cos(math.pi * f * t + phi) + b
    if spec.kind == "norm.weight":
        return 1 + 0.05 * torch.randn(shape, generator=g, device=device)
    if spec.kind == "linear.bias":
        return 0.02 * torch.randn(shape, generator=g, device=device)
    if spec.kind == "linear.weight":
        w = torch.randn(shape, generator=g, device=device)
        return w.mul_(_gain(spec.name, config.is_curve) / math.sqrt(shape[1]))
    raise AssertionError(f"no init rule for {spec.name} ({spec.kind})")


@dataclass(frozen=True)
class AttentionStructure:
    """How the DiT blocks' attention tensors are shaped (module docstring): random = as drawn."""

    kind: str = "random"
    strength: float = LOCAL_STRENGTH  # γ
    shift: float = LOCAL_SHIFT  # ρ

    def __post_init__(self):
        if self.kind not in STRUCTURES:
            raise ConfigError(f"--attention-structure {self.kind}: expected one of {', '.join(STRUCTURES)}")
        for what, v in (("strength", self.strength), ("shift", self.shift)):
            if not (math.isfinite(v) and v > 0):
                raise ConfigError(f"--attention-{what} {v}: expected a positive number")

    def info(self) -> dict:
        return {"kind": self.kind} if self.kind == "random" else dataclasses.asdict(self)


def norm_profile(head_dim: int, inv_freq_len: int, sigma=LOCAL_SIGMA, floor: float = LOCAL_FLOOR):
    """ψ [head_dim] (mean ψ² = 1): per channel, the square root of the Gaussian-kernel spectrum of its rope pair."""
    import torch

    lq = inv_freq_len
    omega = 10000 ** (-torch.arange(lq, dtype=torch.float64) / lq)  # = init_master's rope.inv_freq
    psi2 = torch.full((head_dim,), floor ** 2, dtype=torch.float64)
    for axis, s in enumerate(sigma):
        w = omega * torch.exp(-(omega * s) ** 2 / 2)
        w = w / w.sum() * lq
        for half in (0, 3 * lq):  # the pair's two channels (split-half rope)
            psi2[half + axis * lq: half + (axis + 1) * lq] += w
    return (psi2 / psi2.mean()).sqrt().float()


def shift_directions(config, seed: int, device):
    """u [num_layers, hidden] ~ N(0, 1): block b's shared attention-input direction (own generator)."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed + STRUCTURE_SEED_OFFSET)
    return torch.randn(config.num_layers, config.hidden_size, generator=g, device=device)


def shape_attention(name: str, master, config, structure: AttentionStructure, directions):
    """The `local` transform of one fp32 master tensor (returned as is when it is not one of the shaped ones)."""
    import re

    import torch

    m = re.fullmatch(r"blocks\.(\d+)\.(adaln_proj\.linear\.bias|attn\.qkv_proj\.weight|attn\.[qk]_norm\.weight)", name)
    if structure.kind == "random" or m is None:
        return master
    block, what = int(m.group(1)), m.group(2)
    d = config.hidden_size
    u = directions[block]
    if what.startswith("adaln"):  # features (modality g, expand e, hidden i); the attention shift is e = 0
        out = master.view(-1, 6, d).clone()
        out[:, 0] += structure.shift * u
        return out.reshape(master.shape)
    if what.startswith("attn.qkv"):  # rows q | k | v; k ← W_q·P + W_k·(I − P), P = û ûᵀ (a rank-one update)
        n = master.shape[0] // 3
        uh = u / u.norm()
        out = master.clone()
        out[n:2 * n] += torch.outer(master[:n] @ uh - master[n:2 * n] @ uh, uh)
        return out
    psi = norm_profile(config.attention_head_dim, config.rope_inv_freq_len).to(master.device)
    return master * (structure.strength * psi)


def dit_plan(config, quant: str = "none", nvfp4_refiner: bool = True) -> list:
    """Stored specs in production order: dense keys sorted (the draw order); an NVFP4 layer's weight is
    followed by its block scale, global scale and `comfy_quant` marker."""
    from h3direct.checkpoint.keys import dit_keys

    stored = dit_keys(config, quant, nvfp4_refiner)
    dense = dit_keys(config, "none")
    order = []
    for name in dense:
        order.append(stored[name])
        if stored[name].role == "nvfp4_weight":
            layer = name.rsplit(".", 1)[0]
            order += [stored[f"{layer}.{suffix}"] for suffix in ("weight_scale", "weight_scale_2", "comfy_quant")]
    assert len(order) == len(stored)
    return order


def iter_dit_tensors(config, quant: str = "none", seed: int = 0, device: str = "cpu",
                     nvfp4_refiner: bool = True,
                     structure: AttentionStructure | None = None) -> Iterator[tuple[str, object]]:
    """(key, tensor) in `dit_plan` order, generated one master tensor at a time."""
    import torch

    from h3direct.checkpoint.keys import dit_keys
    from h3direct.checkpoint.quant import NVFP4_MARKER
    from h3direct.checkpoint.quant.nvfp4 import quantize_nvfp4

    stored = dit_keys(config, quant, nvfp4_refiner)
    g = torch.Generator(device=device).manual_seed(seed)
    structure = structure or AttentionStructure()
    directions = shift_directions(config, seed, device) if structure.kind != "random" else None
    for name, spec in dit_keys(config, "none").items():
        master = shape_attention(name, init_master(spec, config, g, device), config, structure, directions)
        out = stored[name]
        if out.role != "nvfp4_weight":
            yield name, master.to(out.torch_dtype)
            continue
        bf16 = master.to(torch.bfloat16)  # ComfyUI quantized the bf16-rounded weights
        del master
        q = quantize_nvfp4(bf16)
        layer = name.rsplit(".", 1)[0]
        yield name, q.packed
        yield f"{layer}.weight_scale", q.block_scale
        yield f"{layer}.weight_scale_2", q.global_scale
        yield f"{layer}.comfy_quant", torch.tensor(list(NVFP4_MARKER), dtype=torch.uint8, device=device)


# ---------------------------------------------------------------- streaming safetensors writer

def _header_bytes(entries: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, nbytes in entries:
        if dtype not in _ST_DTYPE:
            raise H3Error(f"cannot write tensor {name}: dtype {dtype} has no safetensors code")
        header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)  # pad so the data section starts 8-byte aligned


def write_safetensors_stream(path: str | os.PathLike, plan: list[tuple[str, str, tuple[int, ...], int]],
                             tensors: Iterable[tuple[str, object]], metadata: dict[str, str] | None = None) -> int:
    """Write a safetensors file whose header is `plan` ([(name, torch dtype name, shape, nbytes)], in data
    order), then the bytes of `tensors`, which must arrive in the same order with matching dtype and shape.
    Written to `path`.tmp and renamed at the end. Returns the file size."""
    import torch

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    header = _header_bytes(plan, metadata)
    try:
        with open(tmp, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            it = iter(tensors)
            for name, dtype, shape, nbytes in plan:
                got_name, t = next(it)
                if got_name != name or str(t.dtype).removeprefix("torch.") != dtype or tuple(t.shape) != tuple(shape):
                    raise AssertionError(f"writer expected {name} {dtype}{list(shape)}, got {got_name} {t.dtype}"
                                         f"{list(t.shape)}")
                data = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                assert data.numel() == nbytes, name
                f.write(memoryview(data.numpy()))
                del t, data
            if next(it, None) is not None:
                raise AssertionError("writer got more tensors than its plan")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def write_state_dict(path: str | os.PathLike, sd: dict, metadata: dict[str, str] | None = None) -> int:
    """Write an in-memory state dict (sorted keys) with the streaming writer."""
    names = sorted(sd)
    plan = [(k, str(sd[k].dtype).removeprefix("torch."), tuple(sd[k].shape), sd[k].numel() * sd[k].element_size())
            for k in names]
    return write_safetensors_stream(path, plan, ((k, sd[k]) for k in names), metadata)


def write_dit_checkpoint(path: str | os.PathLike, config, quant: str = "none", seed: int = 0, device: str = "cpu",
                         nvfp4_refiner: bool = True, structure: AttentionStructure | None = None) -> int:
    """Generate and stream a synthetic DiT checkpoint to `path`; returns the file size in bytes."""
    structure = structure or AttentionStructure()
    plan = [(s.name, s.dtype, s.shape, s.nbytes) for s in dit_plan(config, quant, nvfp4_refiner)]
    info = {"generator": "h3direct make-checkpoint", "component": "dit", "seed": seed, "quant": quant,
            "nvfp4_refiner": nvfp4_refiner, "device": device,
            "h3_config": {k: v for k, v in dataclasses.asdict(config).items()}}
    if structure.kind != "random":  # the random files keep their metadata byte for byte
        info["attention_structure"] = structure.info()
    # ComfyUI's detection reads a "config" metadata key: never write one
    return write_safetensors_stream(path, plan, iter_dit_tensors(config, quant, seed, device, nvfp4_refiner, structure),
                                    {"h3direct": json.dumps(info, sort_keys=True)})


# ---------------------------------------------------------------- CLI

@dataclass(frozen=True)
class MakeCheckpoint:
    """What `h3direct make-checkpoint` was asked for (its flags, by name)."""

    out: str
    component: str = "dit"
    preset: str = "tiny"
    config: str | None = None
    quant: str = "none"
    nvfp4_layers: str = "all"
    adaln: str | None = None
    seed: int = 0
    attention_structure: str = "random"
    attention_strength: float = LOCAL_STRENGTH
    attention_shift: float = LOCAL_SHIFT
    device: str = "cpu"


def _make_vae(args: MakeCheckpoint) -> int:
    try:
        from h3direct.vae import synthetic
    except ModuleNotFoundError as exc:
        if exc.name not in ("h3direct.vae", "h3direct.vae.synthetic"):
            raise
        raise H3Error(f"--component {args.component}: h3direct.vae.synthetic is not available in this build") from None
    if args.quant != "none" or args.adaln is not None or args.attention_structure != "random":
        raise ConfigError(f"--component {args.component}: --quant/--adaln/--attention-structure apply to the DiT only")
    config = _load_json_arg(args.config) if args.config else args.preset
    sd = synthetic.make_state_dict(args.component, config, seed=args.seed)
    if args.device == "cuda":
        sd = {k: v.to("cuda") for k, v in sd.items()}
    info = {"generator": "h3direct make-checkpoint", "component": args.component, "seed": args.seed,
            "preset": None if args.config else args.preset}
    size = write_state_dict(args.out, sd, {"h3direct": json.dumps(info, sort_keys=True)})
    print(json.dumps({"out": str(args.out), "component": args.component, "tensors": len(sd), "bytes": size}))
    return 0


def run(**flags) -> int:
    import torch

    args = MakeCheckpoint(**flags)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise H3Error("--device cuda: no CUDA device is available (use --device cpu)")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise H3Error(f"--out {out}: directory {out.parent} does not exist")
    if args.component != "dit":
        return _make_vae(args)
    structure = AttentionStructure(args.attention_structure, args.attention_strength, args.attention_shift)
    config = resolve_config(args.preset, args.config, args.adaln)
    size = write_dit_checkpoint(out, config, args.quant, args.seed, args.device, args.nvfp4_layers == "all",
                                structure)
    print(json.dumps({"out": str(out), "component": "dit", "quant": args.quant,
                      "adaln": "curve" if config.is_curve else "full", "seed": args.seed, "bytes": size,
                      "attention_structure": structure.info(), "config": config.comfy_dict()}))
    return 0
