"""How one generation computes, as typed options passed down by argument (nothing here reads the environment):

- `AttentionOptions`: the attention backend and each backend's own options, registered with it in `attention.py`
  (sol_attn: `SolOptions`; budget_attn: `BudgetOptions`; fa3_fp8: `FP8AttentionOptions`; kj_head_sliced:
  `HeadSliceOptions`);
- `KernelOptions`: the fused Triton kernels, MLP row chunks, and what is fixed when the weights load: the NVFP4
  dequantization path, the FP8 block linears and their strictness;
- `Options`: both, what `H3Pipeline.generate(request, options)` takes and what the provenance records.

Every option has one flat name, the same everywhere: the request field (`sol_tau`), the flag (`--sol-tau`) and,
where one exists, the environment variable read once at startup (`H3_SOL_TAU`): `H3_` + the flat name in capitals.
A backend's options are `<prefix>_<option>` (`sol_`, `budget_`, `fp8_attn_`, `head_slice_`); the backend itself is
`attention`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from h3direct.dit.budget_options import BudgetOptions
from h3direct.dit.sol_options import SolOptions
from h3direct.errors import RequestError
from h3direct.fields import Spec, check, field, kind_of, spec_of

DEFAULT_BACKEND = "sdpa"
# the registered attention backends (attention.py registers them; a test holds the two equal), named here so that
# the command line's help needs no torch
BACKENDS = ("sdpa", "cudnn_sdpa", "fa3", "fa3_fp8", "sage2", "ck_int8", "kj_head_sliced", "sol_attn", "budget_attn")
NVFP4_DEQUANT = ("auto", "triton", "kitchen", "torch")
FP8_LINEAR_MODES = ("off", "stream", "resident")
FP8_ACCUM = ("fast", "fp32")  # the FP8 GEMMs' accumulation (w8a8.linear_w8a8)
FP8_LINEAR_FORMATS = ("e4m3", "int8")  # the number format of --fp8-linear's 8-bit GEMMs (w8a8.format_functions)
# the leaves of a DiT block's linears that --fp8-linear can make FP8: h3direct.checkpoint.keys.BLOCK_LINEARS's, named
# here so that the command line's help needs no torch (a test holds the two equal)
FP8_LINEAR_LEAVES = ("qkv_proj", "out_proj", "fc1", "fc2")


def fp8_layer_set(value: str) -> tuple[str, ...]:
    """"fc1,fc2" -> ("fc1", "fc2") in block order; a name outside FP8_LINEAR_LEAVES, a repeat or nothing: ValueError."""
    names = [n.strip() for n in str(value).split(",") if n.strip()]
    if not names or len(set(names)) != len(names) or any(n not in FP8_LINEAR_LEAVES for n in names):
        raise ValueError(value)
    return tuple(n for n in FP8_LINEAR_LEAVES if n in names)


def _is_layer_set(value: str) -> bool:
    try:
        fp8_layer_set(value)
    except ValueError:
        return False
    return True


def rotate_set(value: str) -> tuple[str, ...]:
    """fp8_linear_rotate's value -> the leaves it rotates: "none" -> (), else `fp8_layer_set`."""
    return () if str(value).strip() == "none" else fp8_layer_set(value)


def _is_rotate_set(value: str) -> bool:
    return str(value).strip() == "none" or _is_layer_set(value)


def fp8_flags_problem(mode: str, layers: str | None, fmt: str, rotate: str) -> str | None:
    """One line when the 8-bit block linears' flags (--fp8-linear and its companions, as the gate and `oracle replay`
    spell them) do not fit together: a companion without --fp8-linear, a rotation of e4m3 linears, a bad layer list;
    None when they fit."""
    if mode == "off":
        given = [flag for flag, on in (("--fp8-linear-layers", layers is not None),
                                        ("--fp8-linear-format", fmt != "e4m3"),
                                        ("--fp8-linear-rotate", rotate != "none")) if on]
        if given:
            return f"{given[0]}: needs --fp8-linear"
    if rotate != "none" and fmt != "int8":
        return "--fp8-linear-rotate: the rotation is of int8 linears (--fp8-linear-format int8)"
    for flag, value, ok in (("--fp8-linear-layers", layers, _is_layer_set), ("--fp8-linear-rotate", rotate,
                                                                            _is_rotate_set)):
        if value is not None and not ok(value):
            return (f"{flag} {value!r}: a comma list of qkv_proj, out_proj, fc1, fc2 (each once)"
                    + (", or none" if flag == "--fp8-linear-rotate" else ""))
    return None


@dataclass(frozen=True)
class FP8AttentionOptions:
    PREFIX = "fp8_attn"

    smooth_v: bool = field(True, "subtract V's per-channel token mean before the e4m3 scaling (and add it back)",
                           env=True)
    rotate: bool = field(True, "rotate q and k by one random-sign Hadamard matrix before the e4m3 scaling (q·k "
                         "unchanged; spreads the channels q and k share: FlashAttention-3's incoherent processing)",
                         env=True)
    fallback: str = field("fa3", "the backend of calls whose head_dim FA3's FP8 kernel cannot take",
                          rule=lambda v: v != "fa3_fp8", expect="another attention backend", env=True)
    strict: bool = field(False, "a call that would fall back is an error instead", env=True)

    def __post_init__(self):
        check(self, self.PREFIX + "_")


@dataclass(frozen=True)
class HeadSliceOptions:
    PREFIX = "head_slice"

    backend: str = field("sage2", "the backend each slice of heads runs", rule=lambda v: v != "kj_head_sliced",
                         expect="another attention backend", env=True)
    size: int = field(8, "heads per slice", rule=lambda v: v >= 1, expect="a positive integer", env=True)

    def __post_init__(self):
        check(self, self.PREFIX + "_")


@dataclass(frozen=True)
class AttentionOptions:
    """The attention of one generation: `backend` and the options of every backend that takes some (each used only
    when its backend runs, kj_head_sliced's inner backend included)."""

    backend: str = DEFAULT_BACKEND
    sol_attn: SolOptions = SolOptions()
    fa3_fp8: FP8AttentionOptions = FP8AttentionOptions()
    kj_head_sliced: HeadSliceOptions = HeadSliceOptions()
    budget_attn: BudgetOptions = BudgetOptions()

    def __post_init__(self):
        if not isinstance(self.backend, str) or not self.backend:
            raise RequestError("attention", f" {self.backend!r}: must be the name of an attention backend",
                               kind="choice")

    def using(self, backend: str) -> AttentionOptions:
        return dataclasses.replace(self, backend=backend)


# backend -> the field of AttentionOptions holding its options (attention.py registers each with its backend)
BACKEND_OPTIONS: dict[str, type] = {"sol_attn": SolOptions, "budget_attn": BudgetOptions,
                                    "fa3_fp8": FP8AttentionOptions, "kj_head_sliced": HeadSliceOptions}


@dataclass(frozen=True)
class KernelOptions:
    fused: bool = field(True, "the fused Triton kernels of the DiT block on CUDA (off: the eager op-by-op path, "
                        "ComfyUI's order and roundings)", env=True)
    mlp_chunks: int = field(1, "run the DiT MLPs in this many row chunks (exact; less peak memory)",
                            rule=lambda v: v >= 1, expect="an integer >= 1")
    nvfp4_dequant: str = field("auto", "NVFP4 weight dequantization on CUDA: auto = triton when importable, else "
                               "kitchen, else torch (the CPU always runs torch)", choices=NVFP4_DEQUANT, env=True,
                               per_request=False)
    fp8_linear: str = field("off", "opt-in, approximate: the DiT block linears as 8-bit W8A8 GEMMs (FP8 e4m3, or int8 "
                            "by --fp8-linear-format); stream = NVFP4 weights stay packed (made 8-bit per call), "
                            "resident = 8-bit weights held",
                            choices=FP8_LINEAR_MODES, per_request=False, bare="stream")
    fp8_accum: str = field("fast", "the FP8 GEMMs' accumulation on CUDA: fast = the tensor cores' own accumulator over "
                           "the whole K (cuBLAS fast accumulation; the default of FBGEMM's rowwise FP8 GEMM), fp32 = "
                           "partial sums promoted to fp32 registers (slower)", choices=FP8_ACCUM, env=True,
                           per_request=False)
    fp8_linear_layers: str = field(",".join(FP8_LINEAR_LEAVES),
                                   "which linears of every DiT block --fp8-linear makes FP8: a comma list of "
                                   "qkv_proj, out_proj, fc1, fc2 (the others keep the checkpoint's own weights)",
                                   rule=_is_layer_set, expect="a comma list of qkv_proj, out_proj, fc1, fc2",
                                   env=True, per_request=False)
    fp8_linear_format: str = field("e4m3", "the number format of --fp8-linear's 8-bit block linears: e4m3 = FP8 "
                                   "(torch._scaled_mm), int8 = a uniform 8-bit grid, same per-token / per-channel "
                                   "scales, exact int32 accumulation (torch._int_mm)", choices=FP8_LINEAR_FORMATS,
                                   env=True, per_request=False)
    fp8_linear_rotate: str = field("none", "which int8 block linears rotate their input and weight by one random-sign "
                                   "block-Hadamard matrix before quantizing (the product unchanged; a token's "
                                   "outlier channels spread over their block): none, or a comma list of qkv_proj, "
                                   "out_proj, fc1, fc2", rule=_is_rotate_set,
                                   expect="none, or a comma list of qkv_proj, out_proj, fc1, fc2", env=True,
                                   per_request=False)
    fp8_strict: bool = field(False, "an FP8 linear that cannot run torch._scaled_mm on CUDA is an error instead of "
                             "an emulation", env=True, per_request=False)

    def __post_init__(self):
        check(self)

    def load_time(self) -> dict:
        """The options fixed when the weights load (`per_request=False`)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not spec_of(f).per_request}


@dataclass(frozen=True)
class FlatOption:
    """One option under its flat name: where it lives (`group`, `name`), its type, default and spec."""

    flat: str
    group: str  # "attention" (AttentionOptions), an AttentionOptions field (a backend's options) or "kernels"
    name: str
    kind: type
    default: Any
    spec: Spec

    @property
    def env(self) -> str | None:
        return "H3_" + self.flat.upper() if self.spec.env else None


BACKEND_SPEC = Spec("attention backend (per call, no reload); unavailable ones are refused naming why")


def flat_options() -> list[FlatOption]:
    """Every option of `Options` under its flat name, in a fixed order."""
    out = [FlatOption("attention", "attention", "backend", str, DEFAULT_BACKEND, BACKEND_SPEC)]
    for group, cls in BACKEND_OPTIONS.items():
        for f in dataclasses.fields(cls):
            out.append(FlatOption(f"{cls.PREFIX}_{f.name}", group, f.name, kind_of(f.default), f.default,
                                  spec_of(f)))
    for f in dataclasses.fields(KernelOptions):
        out.append(FlatOption(f.name, "kernels", f.name, kind_of(f.default), f.default, spec_of(f)))
    return out


@dataclass(frozen=True)
class Options:
    """The options of one generation (what changes its numbers besides the request and the weights)."""

    attention: AttentionOptions = AttentionOptions()
    kernels: KernelOptions = KernelOptions()
    # the tier these options were taken from (`app.tiers.Tier.provenance`): recorded, not an option of its own
    tier: dict | None = dataclasses.field(default=None, compare=False)

    @classmethod
    def with_backend(cls, backend: str) -> Options:
        """Every option at its default, attention through `backend`."""
        return cls(AttentionOptions(backend=backend))

    def flat(self) -> dict:
        """{flat name: value} of every option (the provenance's and the benchmark result's `options`)."""
        out = {}
        for o in flat_options():
            if o.group == "attention":
                out[o.flat] = self.attention.backend
            elif o.group == "kernels":
                out[o.flat] = getattr(self.kernels, o.name)
            else:
                out[o.flat] = getattr(getattr(self.attention, o.group), o.name)
        return out

    @classmethod
    def from_flat(cls, values: dict, base: Options | None = None) -> Options:
        """`base` (default: the defaults) with the given flat options set; an unknown name is a RequestError."""
        base = base or cls()
        known = {o.flat: o for o in flat_options()}
        for name in values:
            if name not in known:
                raise RequestError(name, ": not an option", kind="choice")
        groups: dict[str, dict] = {}
        for name, value in values.items():
            o = known[name]
            groups.setdefault(o.group, {})[o.name] = value
        attn = base.attention
        for group, changes in groups.items():
            if group not in ("attention", "kernels"):
                attn = dataclasses.replace(attn, **{group: dataclasses.replace(getattr(attn, group), **changes)})
        if "attention" in groups:
            attn = attn.using(groups["attention"]["backend"])
        kernels = dataclasses.replace(base.kernels, **groups.get("kernels", {}))
        return cls(attn, kernels)


DEFAULT_OPTIONS = Options()


def options_of(x: str | AttentionOptions | Options) -> Options:
    """A backend name (every option at its default), an AttentionOptions (default kernels) or Options as given."""
    if isinstance(x, Options):
        return x
    if isinstance(x, AttentionOptions):
        return Options(x)
    return Options.with_backend(x)


def parse_assignments(items, *, only: str | None = None) -> dict:
    """`["sol_tau=2.0", "fp8_attn_smooth_v=off"]` -> {flat name: typed value}, each value read by the environment
    variables' rule (`fields.parse_env`); `only="attention"`: the attention backends' own options alone. A bad item is
    one line (ConfigError or RequestError) naming it."""
    from h3direct.errors import ConfigError
    from h3direct.fields import parse_env

    known = {o.flat: o for o in flat_options()}
    out = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"{item!r}: must be NAME=VALUE")
        o = known.get(name)
        if o is None or (only == "attention" and o.group in ("attention", "kernels")):
            what = "a backend's option" if only == "attention" else "an option"
            names = ", ".join(n for n, x in known.items() if only != "attention" or x.group not in ("attention",
                                                                                                 "kernels"))
            raise ConfigError(f"{name}: not {what} (one of: {names})")
        out[name] = parse_env(name, raw, o.kind, o.spec)
    return out


def backends_in_effect(opts: AttentionOptions) -> tuple[str, ...]:
    """The backends a run with these options can call: its backend and those its options hand calls to
    (kj_head_sliced's slices, sol_attn's exact rows and fallback, fa3_fp8's fallback), in the order they are met."""
    seen: list[str] = []
    todo = [opts.backend]
    while todo:
        b = todo.pop(0)
        if b in seen:
            continue
        seen.append(b)
        if b == "sol_attn":
            todo += [r for r in (opts.sol_attn.rows_elsewhere,) if r is not None] + [opts.sol_attn.fallback]
        elif b == "fa3_fp8":
            todo.append(opts.fa3_fp8.fallback)
        elif b == "kj_head_sliced":
            todo.append(opts.kj_head_sliced.backend)
    return tuple(seen)


FP8_LINEAR_COMPANIONS = ("fp8_accum", "fp8_linear_layers", "fp8_linear_format", "fp8_linear_rotate",
                         "fp8_strict")  # they need fp8_linear


def not_in_effect(options: Options, names) -> list[str]:
    """The flat names among `names` whose option these options never use: a backend's option while that backend is
    not in effect, an 8-bit linears' companion while fp8_linear is off."""
    used = backends_in_effect(options.attention)
    owner = {f"{cls.PREFIX}_": backend for backend, cls in BACKEND_OPTIONS.items()}
    out = []
    for name in names:
        backend = next((b for prefix, b in owner.items() if name.startswith(prefix)), None)
        if backend is not None and backend not in used:
            out.append(name)
        elif name in FP8_LINEAR_COMPANIONS and options.kernels.fp8_linear == "off":
            out.append(name)
    return out


def check_in_effect(options: Options, names, spell=lambda n: f"--{n.replace('_', '-')}") -> None:
    """One line (ConfigError) when an option given explicitly (`names`) is one these options never use."""
    from h3direct.errors import ConfigError

    idle = not_in_effect(options, names)
    if not idle:
        return
    name = idle[0]
    if name in FP8_LINEAR_COMPANIONS:
        raise ConfigError(f"{spell(name)}: an option of the 8-bit block linears, which are off (fp8_linear off)")
    used = backends_in_effect(options.attention)
    raise ConfigError(f"{spell(name)}: an option of {_owner(name)}, which attention {options.attention.backend} "
                      f"does not run (it runs {', '.join(used)})")


def _owner(name: str) -> str:
    return next(b for b, cls in BACKEND_OPTIONS.items() if name.startswith(f"{cls.PREFIX}_"))


def changed_options(opts: AttentionOptions) -> dict:
    """{flat name: value} of the options in effect (`backends_in_effect`) that differ from their defaults."""
    flat, default = Options(opts).flat(), Options.with_backend(opts.backend).flat()
    idle = set(not_in_effect(Options(opts), flat))
    return {k: v for k, v in flat.items() if v != default[k] and k != "attention" and k not in idle}


def assignments(values: dict) -> list[str]:
    """The inverse of `parse_assignments`: {flat name: value} -> `["sol_tau=2", "sol_sinks=off"]` (booleans on/off,
    floats in their shortest form), each item read back by `parse_assignments` to the same value."""
    def spell(v) -> str:
        return ("on" if v else "off") if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)

    return [f"{k}={spell(v)}" for k, v in values.items()]


def describe(opts: AttentionOptions) -> str:
    """The backend and, in brackets, its options that differ from their defaults: `sol_attn (sol_tau=2)`."""
    changed = assignments(changed_options(opts))
    return opts.backend + (f" ({', '.join(changed)})" if changed else "")
