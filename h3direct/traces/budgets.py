"""Lookup in the one budgets table (`budgets.toml`) and the rule that applies an entry."""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from h3direct.errors import H3Error

# The one tolerance table stays where users edit it: parity_tests/budgets.toml (installed beside this package).
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "parity_tests" / "budgets.toml"
KEYS = ("mode", "kind", "compute", "weights", "attention")


@dataclass(frozen=True)
class Budget:
    match: dict[str, str]
    rel_l2: float | None = None
    k: float | None = None
    floor: float = 0.0
    sqnr_db: float | None = None
    psnr_db: float | None = None
    psnr_min_db: float | None = None
    ssim_mean: float | None = None
    ssim_min: float | None = None
    bitwise: bool = False
    provenance: str = ""
    order: int = 0

    @property
    def specificity(self) -> int:
        return sum(v != "*" for v in self.match.values())

    def describe(self) -> str:
        parts = []
        if self.bitwise:
            parts.append("bitwise")
        if self.k is not None:
            parts.append(f"err ≤ {self.k:g}×comfy_err + {self.floor:g} (vs fp32 twin)")
        if self.rel_l2 is not None:
            parts.append(f"rel_l2 ≤ {self.rel_l2:g}")
        if self.sqnr_db is not None:
            parts.append(f"sqnr ≥ {self.sqnr_db:g} dB")
        if self.psnr_db is not None:
            parts.append(f"psnr ≥ {self.psnr_db:g} dB")
        if self.psnr_min_db is not None:
            parts.append(f"psnr min ≥ {self.psnr_min_db:g} dB")
        if self.ssim_mean is not None:
            parts.append(f"ssim ≥ {self.ssim_mean:g}")
        if self.ssim_min is not None:
            parts.append(f"ssim min ≥ {self.ssim_min:g}")
        return ", ".join(parts) or "no rule"


@dataclass
class BudgetTable:
    entries: list[Budget] = field(default_factory=list)
    path: Path | None = None

    def lookup(self, **key: str) -> Budget:
        best = None
        for b in self.entries:
            if all(b.match.get(k, "*") in ("*", key.get(k)) for k in KEYS):
                if best is None or b.specificity >= best.specificity:
                    best = b
        if best is None:
            what = ", ".join(str(key.get(k, "*")) for k in ("mode", "compute", "weights", "attention"))
            raise H3Error(f"no calibrated budget for ({what}) (kind {key.get('kind', '*')}): add a calibrated entry "
                          f"to the budgets table", path=self.path)
        return best


def load_budgets(path: str | Path | None = None) -> BudgetTable:
    path = Path(path) if path else DEFAULT_PATH
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise H3Error(f"cannot read budgets table: {exc}", path=path) from None
    entries = []
    for i, e in enumerate(data.get("budget", [])):
        unknown = set(e) - set(KEYS) - {"rel_l2", "k", "floor", "sqnr_db", "psnr_db", "psnr_min_db", "ssim_mean",
                                        "ssim_min", "bitwise", "provenance"}
        if unknown:
            raise H3Error(f"budget entry {i}: unknown field(s) {sorted(unknown)}", path=path)
        if not e.get("provenance"):
            raise H3Error(f"budget entry {i} has no provenance", path=path)
        if str(e.get("mode", "*")) in ("*", "teacher", "free", "e2e") and all(
                str(e.get(k, "*")) == "*" for k in ("compute", "weights", "attention")):
            raise H3Error(f"budget entry {i} is a catch-all (compute, weights and attention all '*'): name the "
                          f"combination it was calibrated on", path=path)
        entries.append(Budget(match={k: str(e.get(k, "*")) for k in KEYS}, rel_l2=e.get("rel_l2"), k=e.get("k"),
                              floor=float(e.get("floor", 0.0)), sqnr_db=e.get("sqnr_db"), psnr_db=e.get("psnr_db"),
                              psnr_min_db=e.get("psnr_min_db"), ssim_mean=e.get("ssim_mean"),
                              ssim_min=e.get("ssim_min"), bitwise=bool(e.get("bitwise", False)),
                              provenance=e["provenance"], order=i))
    return BudgetTable(entries, path)


def verdict(b: Budget, *, rel: float, sqnr: float, identical: bool, ours_vs_fp32: float | None = None,
            comfy_vs_fp32: float | None = None) -> tuple[bool, str]:
    """(passed, what was checked) for one comparison under budget `b`."""
    if math.isnan(rel):
        return False, "NaN in the result"
    if b.bitwise and not identical:
        return False, "not bitwise identical"
    if b.k is not None and ours_vs_fp32 is not None and comfy_vs_fp32 is not None:
        limit = b.k * comfy_vs_fp32 + b.floor
        if not ours_vs_fp32 <= limit:
            return False, f"err vs fp32 twin {ours_vs_fp32:.3e} > {b.k:g}×{comfy_vs_fp32:.3e} + {b.floor:g}"
    elif b.rel_l2 is not None and not rel <= b.rel_l2:
        return False, f"rel_l2 {rel:.3e} > {b.rel_l2:g}"
    if b.sqnr_db is not None and not sqnr >= b.sqnr_db:
        return False, f"sqnr {sqnr:.1f} dB < {b.sqnr_db:g} dB"
    return True, b.describe()


def frames_verdict(b: Budget, fm: dict) -> tuple[bool, str]:
    """(passed, what was checked) for decoded frames: `fm` has psnr_mean, psnr_min (dB, peak 1), ssim_mean, ssim_min
    and frames; every floor the entry sets must hold (psnr_db on the mean, psnr_min_db on the worst frame, likewise
    ssim_mean / ssim_min). NaN fails."""
    fails = []
    for value, floor, what, fmt in ((fm["psnr_mean"], b.psnr_db, "PSNR mean", ".2f"),
                                    (fm["psnr_min"], b.psnr_min_db, "PSNR min", ".2f"),
                                    (fm["ssim_mean"], b.ssim_mean, "SSIM mean", ".6f"),
                                    (fm["ssim_min"], b.ssim_min, "SSIM min", ".6f")):
        if floor is not None and not value >= floor:  # NaN compares false: fails
            unit = " dB" if what.startswith("PSNR") else ""
            fails.append(f"{what} {value:{fmt}}{unit} < {floor:g}{unit}")
    summary = (f"{fm.get('frames', '?')} frames: PSNR mean {fm['psnr_mean']:.2f} / min {fm['psnr_min']:.2f} dB, "
               f"SSIM mean {fm['ssim_mean']:.6f} / min {fm['ssim_min']:.6f}")
    return (not fails), ("; ".join(fails) + f" ({summary})" if fails else f"{summary} [{b.describe()}]")
