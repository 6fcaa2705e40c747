"""The gate's one table of limits (`budgets.toml`) and the rules that turn an entry into a limit.

Every entry names one rule, and the loader refuses an entry that is not one of them (`BudgetError`):

- **fp32**: `rel_l2 ≤ [rules].fp32_limit` against ComfyUI's trace. The entry holds no number of its own.
- **ratio** (flash-attention's rule): `err(h3direct, ComfyUI's fp32 twin) ≤ k · err(ComfyUI, twin) + floor`, with
  `k ≤ [rules].ratio_k_max` and the floor fixed at the fp32 limit (no layer is asked to be closer to fp32 than the
  fp32 rule itself). Needs the twin: the same case recorded by ComfyUI in fp32 on the same machine.
- **rounding**: a bound from the arithmetic where no twin exists. `roundings`: the site rounds its result `n` times
  to the produced dtype (unit roundoff `u`) between its recorded inputs and its output (`[roundings]`, per site
  kind), so two correct implementations differ by at most `2·n·u` relative; never below the fp32 limit. A kind with
  no count (a whole block, a free run) has no rounding bound. `gemm`: a quantized product (FP8 e4m3 W8A8 linears)
  whose operands each carry one rounding of relative size ≤ u: the expected rel-L2 of the product is
  `u·sqrt(2/3)·ρ` with `ρ = ‖sqrt((X∘X)(W∘W)ᵀ)‖ / ‖XWᵀ‖` measured on the site's own operands; the limit is k times it.
- **contract**: an approximate mode's declared accuracy — the only rule with a free number, and it must name its
  `source` (a paper's table, a library's docstring or test: a published number, never one this project declares).
  Allowed only for the kernel of an approximate mode (mode "kernel") and the quality of its outputs (mode
  "quality"), and for NVFP4 W4A4 (an approximate arithmetic: activations quantized to FP4). An approximate mode's
  outputs are held instead to ComfyUI's fast mode of their class (mode "class": the ratio rule against ComfyUI
  `--use-sage-attention`'s own error, `ladder.py`) and to their own history (the drift rule).

- **drift**: an approximate mode against its own recorded history (`drift.py`): a quality the mode measured
  (its output error against an fp32 reference, its x0 or decoded frames against the exact path: a rel-L2 `e`)
  may not grow past `sqrt(e_base² + n·(k·r)²)`. `r` is the low-precision rounding scale of that quantity (ComfyUI's
  own bf16 error against its fp32 twin at that output; h3direct's bf16 exact path against its fp32 one for decoded
  frames; never below the fp32 limit) and `n` the number of low-precision paths in the comparison (1 against an
  fp32 reference, 2 against the exact low-precision path). The exact rule lets a merge move every exact path's
  rounding error up to k·r, and independent errors add in quadrature: that much growth a correct merge can cause,
  more it cannot. Baselines are measured on the machine they gate (they sit beside its traces).

Keys: mode, kind, compute, weights, attention (strings; "*" = any). The most specific matching entry wins (most
non-"*" keys), later entries break ties; a comparison no entry matches fails ("no rule for ..."): there is no
catch-all. `attention` is "exact" for every exact backend (sdpa, cudnn_sdpa, fa3, and kj_head_sliced over an exact
one); an approximate backend's name appears only in its kernel contract, its class rule and its quality or drift
entries: everything it does not compute is judged by the exact entries (`gate.py`).
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from h3direct.errors import H3Error
from h3direct.traces.metrics import drift_limit, ratio_limit

DEFAULT_PATH = Path(__file__).resolve().parent / "budgets.toml"
KEYS = ("mode", "kind", "compute", "weights", "attention", "twin")
RULES = ("fp32", "ratio", "rounding", "contract", "drift")
MODES = ("teacher", "free", "vae", "e2e", "kernel", "quality", "class", "drift")
NAMES_BACKEND = ("kernel", "quality", "class", "drift")  # the modes whose entries may name an approximate backend
# significand bits (with the implicit one) of each dtype a rounding rule may name: u = 2^-p (round to nearest even)
SIGNIFICAND_BITS = {"float64": 53, "float32": 24, "bfloat16": 8, "float16": 11, "e4m3": 4, "e2m1": 2,
                    "int64": 64, "int32": 64}  # integers: exact
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# product operands on a uniform grid under per-row scales (absolute rounding error, not relative): the site's rho is
# then the expected relative error itself (`h3direct.traces.kernels.int8_rho`), and the bound is k·rho
UNIFORM_GRIDS = ("int8",)
LIMIT_FIELDS = ("rel_l2", "cosine", "sqnr_db", "psnr_db", "psnr_min_db", "ssim_mean", "ssim_min")
FIELDS = set(KEYS) | set(LIMIT_FIELDS) | {"rule", "k", "reference", "dtype", "source", "provenance"}


class BudgetError(H3Error):
    """The budgets table is not made of rules (one line naming the entry)."""


def unit_roundoff(dtype: str) -> float:
    """u = 2^-p for a dtype name ("bf16", "bfloat16", "e4m3", ...)."""
    name = ALIASES.get(dtype, dtype)
    if name not in SIGNIFICAND_BITS:
        raise BudgetError(f"no unit roundoff known for dtype {dtype!r}")
    return 2.0 ** -SIGNIFICAND_BITS[name]


def product_unit(dtype: str) -> float:
    """The expected relative error of a quantized product per unit of its site's rho: u·sqrt(2/3) for a floating
    dtype (one rounding per operand, uniform in relative terms), 1 for a uniform grid (rho is then the expected
    error itself, `h3direct.traces.kernels.int8_rho`)."""
    return 1.0 if dtype in UNIFORM_GRIDS else unit_roundoff(dtype) * math.sqrt(2.0 / 3.0)


@dataclass(frozen=True)
class Budget:
    match: dict[str, str]
    rule: str
    k: float | None = None
    rel_l2: float | None = None
    cosine: float | None = None
    sqnr_db: float | None = None
    psnr_db: float | None = None
    psnr_min_db: float | None = None
    ssim_mean: float | None = None
    ssim_min: float | None = None
    reference: str | None = None  # kernel contracts: what the kernel is held against (exact | emulation | algorithm)
    dtype: str | None = None  # rounding rule of a quantized product: the operands' dtype
    source: str = ""
    provenance: str = ""
    order: int = 0
    rules: dict = field(default_factory=dict, compare=False, repr=False)  # the table's [rules] and [roundings]

    @property
    def specificity(self) -> int:
        return sum(v != "*" for v in self.match.values())

    @property
    def floor(self) -> float:
        return float(self.rules["fp32_limit"])

    def describe(self) -> str:
        if self.rule == "fp32":
            return f"fp32 rule: rel_l2 ≤ {self.floor:g}"
        if self.rule == "ratio":
            return f"ratio rule: err vs fp32 ≤ {self.k:g}×ComfyUI's + {self.floor:g}"
        if self.rule == "drift":
            return f"drift rule: err ≤ sqrt(baseline² + n·({self.k:g}·r)²)"
        if self.rule == "rounding":
            if self.dtype:
                return f"rounding bound: {self.k:g}× the expected {self.dtype} product error"
            return "rounding bound: 2·n·u of the produced dtype"
        limits = [f"{f} {'≤' if f == 'rel_l2' else '≥'} {getattr(self, f):g}" for f in LIMIT_FIELDS
                  if getattr(self, f) is not None]
        if self.k is not None:
            limits.insert(0, f"err ≤ {self.k:g}× the {self.reference}'s + {self.floor:g}")
        return f"contract ({self.source}): " + ", ".join(limits)


@dataclass(frozen=True)
class Measured:
    """What the gate measured for one comparison, on the scale the rule needs.

    err: rel-L2 of h3direct against the reference the entry names (ComfyUI's trace, the exact kernel, ...);
    twin: (h3direct, ComfyUI) rel-L2 against ComfyUI's fp32 twin, when recorded; produced: the dtype the reference
    was produced in (rounding rule); baseline / scale / paths: the drift rule's recorded err, r and n;
    gemm_rho: ρ of a quantized product site (rounding rule with a dtype);
    frames: {psnr_mean, psnr_min, ssim_mean, ssim_min} of decoded frames; cos: cosine similarity to the reference.
    A contract held against a reference implementation (`Budget.k`) reads `twin` as (h3direct's, the reference
    implementation's) rel-L2 against the exact result."""

    err: float
    identical: bool = False
    twin: tuple[float, float] | None = None
    produced: str | None = None
    gemm_rho: float | None = None
    frames: dict | None = None
    cos: float | None = None
    baseline: float | None = None  # drift: the recorded err of the same quantity
    scale: float | None = None  # drift: r, the quantity's low-precision rounding scale
    paths: int = 1  # drift: low-precision paths in the comparison


@dataclass(frozen=True)
class Verdict:
    passed: bool
    text: str  # what was checked (and why it failed)
    error: float  # the plotted quantity (rel-L2 on the rule's scale)
    limit: float  # its limit (inf: nothing to hold it to)

    @property
    def margin(self) -> float:
        """limit / error (> 1 passes; inf for an exact match)."""
        if self.error == 0:
            return math.inf
        return self.limit / self.error


class BudgetTable:
    def __init__(self, entries: list[Budget], rules: dict, path: Path | None = None):
        self.entries, self.rules, self.path = entries, rules, path

    def lookup(self, **key: str) -> Budget:
        best = None
        for b in self.entries:
            if all(b.match[k] in ("*", key.get(k)) for k in KEYS):
                if best is None or b.specificity >= best.specificity:
                    best = b
        if best is None:
            what = ", ".join(f"{k} {key.get(k, '*')}" for k in KEYS)
            raise H3Error(f"no rule for ({what}) in the budgets table", path=self.path)
        return best

    def find(self, **key: str) -> Budget | None:
        """`lookup`, or None where no entry matches (a mode an approximate backend may not have: its class rule)."""
        try:
            return self.lookup(**key)
        except H3Error:
            return None

    def roundings(self, kind: str) -> int | None:
        n = self.rules.get("roundings", {}).get(kind)
        return int(n) if n is not None else None


def _check(i: int, e: dict, rules: dict, path: Path) -> None:
    def bad(why: str):
        raise BudgetError(f"budget entry {i} ({', '.join(str(e.get(k, '*')) for k in KEYS)}): {why}", path=path)

    unknown = set(e) - FIELDS
    if unknown:
        bad(f"unknown field(s) {sorted(unknown)}")
    if not e.get("provenance"):
        bad("no provenance")
    if len(str(e["provenance"])) > 200 or "\n" in str(e["provenance"]):
        bad("provenance is one line (≤ 200 characters) and a pointer to a results entry")
    if str(e.get("mode", "*")) not in (*MODES, "*"):
        bad(f"unknown mode {e.get('mode')!r}")
    if e.get("mode") not in ("quality", "drift") and all(str(e.get(k, "*")) == "*"
                                                         for k in ("compute", "weights", "attention")):
        bad("a catch-all (compute, weights and attention all '*'): name what it governs")
    rule = e.get("rule")
    if rule not in RULES:
        bad(f"rule {rule!r} is none of {', '.join(RULES)}: every limit is a rule, never a fitted number")
    numbers = [f for f in LIMIT_FIELDS if f in e]
    if rule in ("fp32", "ratio", "drift") and (numbers or "dtype" in e):
        bad(f"a {rule} entry carries no number of its own (got {numbers or ['dtype']})")
    if rule == "ratio":
        k = e.get("k")
        if not isinstance(k, int | float) or isinstance(k, bool) or not 1.0 <= k <= rules["ratio_k_max"]:
            bad(f"ratio rule needs 1 ≤ k ≤ {rules['ratio_k_max']:g}, got {k!r}")
    if rule == "drift":
        k = e.get("k")
        if e.get("mode") != "drift":
            bad("the drift rule governs mode drift only")
        if not isinstance(k, int | float) or isinstance(k, bool) or not 1.0 <= k <= rules["ratio_k_max"]:
            bad(f"the drift rule needs the exact rule's 1 ≤ k ≤ {rules['ratio_k_max']:g}, got {k!r}")
    if e.get("mode") == "drift" and rule != "drift":
        bad("mode drift is judged by the drift rule")
    if rule == "rounding":
        if numbers:
            bad(f"a rounding entry derives its limit from the arithmetic; it carries no {numbers}")
        if "dtype" in e and str(e["dtype"]) not in UNIFORM_GRIDS:
            unit_roundoff(str(e["dtype"]))
            if not isinstance(e.get("k"), int | float) or not 1.0 <= e["k"] <= rules["ratio_k_max"]:
                bad(f"a quantized-product rounding bound needs 1 ≤ k ≤ {rules['ratio_k_max']:g}")
    if rule == "contract":
        if not e.get("source"):
            bad("a contract names its source (a paper's table, a library's docs or test)")
        if not numbers and not (e.get("k") and e.get("reference")):
            bad("a contract states its limit (rel_l2, cosine, sqnr_db, psnr_db, ..., or k against a reference)")
        if e.get("k") is not None and not e.get("reference"):
            bad("a contract with k names the reference implementation it is held against")
        contract_ok = e.get("mode") in ("kernel", "quality") or e.get("weights") == "nvfp4_w4a4"
        if not contract_ok:
            bad("a contract may only govern an approximate mode's kernel (mode kernel), its output quality (mode "
                "quality) or NVFP4 W4A4; every other layer is held to the exact rules")
    attention = str(e.get("attention", "*"))
    if attention not in ("*", "exact") and e.get("mode") not in NAMES_BACKEND:
        bad(f"attention {attention!r}: an approximate backend is named only by its kernel contract, its class rule "
            f"and its quality entries; what it does not compute is judged by the exact entries")
    if e.get("mode") == "class" and (rule != "ratio" or attention in ("*", "exact")):
        bad("a class entry holds one approximate backend to the ratio rule against ComfyUI's fast mode")


def load_budgets(path: str | Path | None = None) -> BudgetTable:
    path = Path(path) if path else DEFAULT_PATH
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise H3Error(f"cannot read budgets table: {exc}", path=path) from None
    return table_of(data.get("budget", []), data.get("rules"), data.get("roundings"), path)


def table_of(entries: list[dict], rules: dict | None = None, roundings: dict | None = None,
             path: Path | None = None) -> BudgetTable:
    """A table from entries as the TOML holds them (each checked); [rules] and [roundings] default to the committed
    table's (tests and tools build small tables this way)."""
    if rules is None or roundings is None:
        committed = tomllib.loads(DEFAULT_PATH.read_text())
        rules = committed.get("rules") if rules is None else rules
        roundings = committed.get("roundings") if roundings is None else roundings
    rules = dict(rules or {})
    for name in ("fp32_limit", "ratio_k_max"):
        if not isinstance(rules.get(name), int | float):
            raise BudgetError(f"[rules] needs {name}", path=path)
    rules["roundings"] = dict(roundings or {})
    out = []
    for i, e in enumerate(entries):
        stated = e
        if e.get("mode") == "class" and e.get("rule") == "ratio":  # k: the class tier's bound, stated in app.tiers
            from h3direct.app.tiers import CLASS_BOUND

            e = {**e, "k": CLASS_BOUND}
        _check(i, e, rules, path)
        if e.get("mode") == "class" and "k" in stated:
            raise BudgetError(f"budget entry {i}: a class entry states no k (its k is the class tier's bound, "
                              f"h3direct.app.tiers.TIERS)", path=path)
        limits = {f: e.get(f) for f in LIMIT_FIELDS}
        out.append(Budget(match={k: str(e.get(k, "*")) for k in KEYS}, rule=e["rule"], k=e.get("k"), **limits,
                          reference=e.get("reference"), dtype=e.get("dtype"), source=e.get("source", ""),
                          provenance=e["provenance"], order=i, rules=rules))
    return BudgetTable(out, rules, path)


def _db_to_rel(db: float) -> float:
    return 10.0 ** (-db / 20.0)


def verdict(b: Budget, m: Measured, *, roundings: int | None = None) -> Verdict:
    """Apply entry `b` to one measurement. `roundings`: the site kind's count (rounding rule without a dtype)."""
    if math.isnan(m.err) or (m.twin is not None and any(math.isnan(x) for x in m.twin)):
        return Verdict(False, "NaN in the result", math.nan, 0.0)
    if b.rule == "fp32":
        ok = m.identical or m.err <= b.floor
        return Verdict(ok, b.describe() if ok else f"rel_l2 {m.err:.3e} > {b.floor:g} (fp32 rule)", m.err, b.floor)
    if b.rule == "ratio":
        if m.twin is None:
            return Verdict(False, "the ratio rule needs ComfyUI's fp32 twin of this case, and none was found",
                           m.err, 0.0)
        ours, comfy = m.twin
        limit = ratio_limit(b.k, comfy, b.floor)
        ok = ours <= limit
        text = (f"err vs fp32 {ours:.3e} ≤ {b.k:g}×ComfyUI's {comfy:.3e} + {b.floor:g}" if ok else
                f"err vs fp32 {ours:.3e} > {b.k:g}×ComfyUI's {comfy:.3e} + {b.floor:g} (ratio rule)")
        return Verdict(ok, text, ours, limit)
    if b.rule == "drift":
        if m.baseline is None:
            return Verdict(False, "the drift rule needs the mode's recorded baseline", m.err, 0.0)
        r = max(m.scale or 0.0, b.floor)
        limit = drift_limit(m.baseline, m.scale, m.paths, b.k, b.floor)
        ok = m.err <= limit
        text = (f"err {m.err:.3e} {'≤' if ok else '>'} sqrt(baseline {m.baseline:.3e}² + {m.paths}·({b.k:g}·r "
                f"{r:.3e})²) = {limit:.3e}" + ("" if ok else " (drift rule)"))
        return Verdict(ok, text, m.err, limit)
    if b.rule == "rounding":
        if b.dtype:
            if m.gemm_rho is None:
                return Verdict(False, "a quantized-product rounding bound needs the site's operands", m.err, 0.0)
            limit = max(b.floor, b.k * product_unit(b.dtype) * m.gemm_rho)
            what = f"{b.k:g}× the expected {b.dtype} product error"
        else:
            if roundings is None:
                return Verdict(False, "no rounding bound for this kind of site (it composes many roundings): "
                                      "record ComfyUI's fp32 twin to gate it", m.err, 0.0)
            limit = max(b.floor, 2.0 * roundings * unit_roundoff(m.produced or "float32"))
            what = f"2·{roundings}·u({m.produced or 'float32'})"
        ok = m.identical or m.err <= limit
        text = f"rel_l2 {m.err:.3e} {'≤' if ok else '>'} {limit:.3e} (rounding bound {what})"
        return Verdict(ok, text, m.err, limit)
    # contract: every stated limit must hold
    fails, limit = [], math.inf
    if b.k is not None:  # against a reference implementation of the same approximation (`reference`)
        if m.twin is None:
            return Verdict(False, f"the contract compares with the {b.reference}, which was not computed", m.err, 0.0)
        ours, ref_err = m.twin
        limit = ratio_limit(b.k, ref_err, b.floor)
        if not ours <= limit:
            fails.append(f"err {ours:.3e} > {b.k:g}×{b.reference}'s {ref_err:.3e} + {b.floor:g}")
    if b.rel_l2 is not None:
        limit = min(limit, b.rel_l2)
        if not m.err <= b.rel_l2:
            fails.append(f"rel_l2 {m.err:.3e} > {b.rel_l2:g}")
    if b.cosine is not None:
        limit = min(limit, math.sqrt(2.0 * (1.0 - b.cosine)))
        if m.cos is None or not m.cos >= b.cosine:
            fails.append(f"cosine {m.cos if m.cos is not None else math.nan:.6f} < {b.cosine:g}")
    if b.sqnr_db is not None:
        limit = min(limit, _db_to_rel(b.sqnr_db))
        sq = math.inf if m.err == 0 else -20.0 * math.log10(m.err)
        if not sq >= b.sqnr_db:
            fails.append(f"SQNR {sq:.1f} dB < {b.sqnr_db:g} dB")
    if m.frames is not None:
        for key, floor, unit in (("psnr_mean", b.psnr_db, " dB"), ("psnr_min", b.psnr_min_db, " dB"),
                                 ("ssim_mean", b.ssim_mean, ""), ("ssim_min", b.ssim_min, "")):
            if floor is not None and not m.frames[key] >= floor:
                fails.append(f"{key} {m.frames[key]:.4g}{unit} < {floor:g}{unit}")
        if b.psnr_db is not None:
            limit = min(limit, _db_to_rel(b.psnr_db))
    error = m.twin[0] if b.k is not None and m.twin is not None else m.err
    text = "; ".join(fails) + f" (contract: {b.source})" if fails else b.describe()
    return Verdict(not fails, text, error, limit)
