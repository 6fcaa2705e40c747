"""Tiers: named sets of options, chosen on the machine they run on and read here as data.

The frontier (`h3direct.app.frontier`) chooses them from measurements made on the GPU at hand (speed at the
benchmark contract's workload beside ComfyUI's, quality on every structured case of the validation set and the
user's own recorded cases against ComfyUI's fp32 twin: `python -m benchmarks.frontier` in a checkout, which needs
ComfyUI) and writes a tiers file: per tier of `TIERS`, the fastest candidate inside the tier's bound with the margin
the choice keeps for data it never saw (`h3direct choose-tiers` chooses again from a frontier's measurements). The
runtime only reads that file (`--tier NAME`; the file: `--tiers FILE`, `$H3_TIERS`, default `<cache>/tiers.json`). A
tier is its options under their flat names (`dit.options`); options given explicitly win over the tier's, and the
provenance records the tier's name and file beside the options the clip ran with.

A tiers file (JSON) holds at least:

    {"schema": "h3-tiers/1",
     "machine": {"device_name": "NVIDIA H100 80GB HBM3", ...},      # the device it was chosen on (torch's name)
     "tiers": {"sage_class": {"options": {"attention": "sol_attn", "sol_tau": 1.3, ...},
                              "rule": "class", "bound": 1.5, "s_per_step": 1.49,
                              "error_x_comfyui_sage": 1.21, ...}, ...}}

`rule` is how the gate judges the tier (`pytest -m parity --tier NAME`): `exact` (the exact rules), `class` (its
outputs within `bound` × ComfyUI --use-sage-attention's error, the ratio rule) or `drift` (its own baselines). Every
other field is the frontier's record (candidates, figures, margins, versions), kept for people, not read here.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from h3direct.errors import ConfigError

SCHEMA = "h3-tiers/1"
RULES = ("exact", "class", "drift")
ENV = "H3_TIERS"
MAKE_IT = ("measure and choose them on this machine: `python -m benchmarks.frontier` in a checkout of the project, "
           "with ComfyUI (README, 'Choosing tiers on your GPU')")


class TierRule(NamedTuple):
    rule: str  # how the gate judges the tier: one of RULES
    bound: float | None  # its outputs' worst error x ComfyUI --use-sage-attention's, against ComfyUI's fp32 twin


# The tiers the frontier chooses, each with its rule and bound: stated here only. The frontier chooses by them, and
# the gate's class rule against ComfyUI+sage (parity_tests/budgets.toml, mode "class") takes the class tier's bound
# as its k.
TIERS = {"exact": TierRule("exact", None),  # an exact attention backend, the checkpoint's own linears
         "sage_class": TierRule("class", 1.5),  # the ratio rule's k against ComfyUI+sage (the exact rule's k)
         "fastest": TierRule("drift", 3.0)}  # gated against its own baselines
CLASS_BOUND = TIERS["sage_class"].bound
# A sparse candidate (`attention.is_sparse`) takes a tier only while its worst case is within this × its median case
# over the cases it is chosen on. Its error follows where each input's attention mass lies, not rounding: a case far
# above the rest marks inputs the set samples thinly, and a margin learnt from the rest would not cover them.
SPARSE_SPREAD = 1.3


@dataclass(frozen=True)
class Tier:
    name: str
    options: dict  # {flat option name: value}
    rule: str  # exact | class | drift
    bound: float | None  # class: the limit as a multiple of ComfyUI+sage's error
    figures: dict = field(default_factory=dict, compare=False)  # what the frontier measured (s/step, errors, ...)

    def provenance(self, tiers: Tiers) -> dict:
        """What a clip made with this tier records beside its options."""
        return {"name": self.name, "file": str(tiers.path.resolve()), "sha256": tiers.sha256, "rule": self.rule,
                "options": dict(self.options)}


@dataclass(frozen=True)
class Tiers:
    path: Path
    sha256: str
    machine: dict
    tiers: dict[str, Tier]
    made: dict = field(default_factory=dict, compare=False)  # the frontier's record of the run that chose them

    def missing(self, name: str) -> str | None:
        """Why `name` is not a tier of this file (None: it is)."""
        return None if name in self.tiers else f"not a tier of {self.path} (its tiers: {', '.join(self.tiers)})"

    def get(self, name: str) -> Tier:
        why = self.missing(name)
        if why is not None:
            raise ConfigError(f"--tier {name}: {why}")
        return self.tiers[name]

    def check_device(self, device_name: str) -> None:
        """One line when the file was chosen on another device than the one at hand."""
        chosen = self.machine.get("device_name")
        if chosen != device_name:
            raise ConfigError(f"{self.path}: its tiers were chosen on {chosen}, this device is {device_name}; speed "
                              f"and quality depend on the machine: {MAKE_IT}")


def default_path() -> Path:
    from h3direct.app.paths import cache_root

    return cache_root() / "tiers.json"


def install(path: str | Path) -> Path:
    """Copy the tiers file at `path` (checked first) to `default_path()`, where `--tier` looks by default."""
    import shutil

    load(path)
    target = default_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, target)
    return target


def load(path: str | Path) -> Tiers:
    """The tiers file at `path`, checked: its schema, each tier's rule and bound, and its options (every name a flat
    option, every value of its type and inside its rule: `dit.options.Options.from_flat`). One line when not."""
    from h3direct.dit.options import Options
    from h3direct.errors import H3Error

    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"no tiers file at {path}: {MAKE_IT}") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the tiers file ({exc.strerror})") from None
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: not a tiers file (not JSON: {exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        got = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{path}: not a tiers file (schema {got!r}, expected {SCHEMA!r}): {MAKE_IT}")
    machine, entries = data.get("machine"), data.get("tiers")
    if not isinstance(machine, dict) or not isinstance(machine.get("device_name"), str):
        raise ConfigError(f"{path}: its `machine` names no device_name")
    if not isinstance(entries, dict) or not entries:
        raise ConfigError(f"{path}: it holds no tiers")
    tiers = {}
    for name, e in entries.items():
        where = f"{path}: tier {name!r}"
        if not isinstance(e, dict) or not isinstance(e.get("options"), dict):
            raise ConfigError(f"{where}: no options")
        if e.get("rule") not in RULES:
            raise ConfigError(f"{where}: rule {e.get('rule')!r} is none of {', '.join(RULES)}")
        bound = e.get("bound")
        if e["rule"] == "class" and (not isinstance(bound, int | float) or isinstance(bound, bool) or bound < 1):
            raise ConfigError(f"{where}: a class tier's bound is a number >= 1 (× ComfyUI+sage's error), got "
                              f"{bound!r}")
        try:
            Options.from_flat(e["options"])
        except H3Error as exc:
            raise ConfigError(f"{where}: {exc}") from None
        tiers[name] = Tier(name, dict(e["options"]), e["rule"], float(bound) if bound is not None else None,
                           {k: v for k, v in e.items() if k not in ("options", "rule", "bound")})
    made = data.get("made")
    return Tiers(path, hashlib.sha256(raw).hexdigest(), machine, tiers, made if isinstance(made, dict) else {})


def device_name(device) -> str:
    """The name a tiers file records its device under: torch's name of the GPU, `cpu` for the CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    return torch.cuda.get_device_name(device)


def load_for(path: str | Path | None, device) -> Tiers:
    """The tiers file at `path` (None: `default_path()`), checked to have been chosen on `device`'s kind of device."""
    tiers = load(path if path is not None else default_path())
    tiers.check_device(device_name(device))
    return tiers


def resolve(name: str, path: str | Path | None, device) -> tuple[Tier, Tiers]:
    """Tier `name` of the tiers file at `path` (None: `default_path()`), chosen on `device`'s kind of device."""
    tiers = load_for(path, device)
    return tiers.get(name), tiers
