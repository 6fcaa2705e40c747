"""The environment, read once at startup by the command line (`app/cli.py`) and nowhere else.

Each `H3_*` variable that sets an option is the option's flat name in capitals (`H3_SOL_TAU` -> `sol_tau`,
`H3_FUSED` -> `fused`: `dit/options.py`); the settings of the models are `H3_VAE_DTYPE`, `H3_VAE_TILE_SIZE`,
`H3_TOKENIZER` and `H3_TEXT_ENCODER_POLICY`; `H3_TIERS` names the tiers file (`app/tiers.py`). A value is parsed by
its field's type and checked by its field's rule, with one rule for every switch (1/0, true/false, yes/no, on/off);
a bad one is a one-line `ConfigError` naming the variable (exit 2 at startup). A flag given on the command line, or
a request field, wins over the variable.
`H3_CACHE_DIR` (where rebuildable files are kept) is read where that folder is needed (`app/paths.py`);
`H3_COMFY_ROOT` belongs to the oracle and is not read by the runtime.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from h3direct.errors import ConfigError
from h3direct.fields import kind_of, parse_env, spec_of

# variables that once meant something and now have no counterpart: set, they are an error (never silently ignored)
REFUSED = {
    "H3_SOL_INT8_QK": "comfy-kitchen's sol_attn has no precision switch (its QK product is always INT8)",
    "H3_SOL_INT8_PV": "comfy-kitchen's sol_attn has no precision switch for its PV product",
}



def _set(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw


def read_options(env: Mapping[str, str] | None = None) -> dict:
    """{flat option name: value} of every option variable that is set (`dit.options.flat_options`)."""
    from h3direct.dit.options import flat_options

    env = os.environ if env is None else env
    for name, why in REFUSED.items():
        if _set(env, name) is not None:
            raise ConfigError(f"{name}={env[name]!r}: {why}; unset {name}")
    out = {}
    for o in flat_options():
        if o.env is not None and (raw := _set(env, o.env)) is not None:
            out[o.flat] = parse_env(o.env, raw, o.kind, o.spec)
    return out


def read_settings(env: Mapping[str, str] | None = None) -> dict:
    """{field: value} of the `app.models.ModelSpec` fields whose variable is set (H3_VAE_DTYPE, H3_VAE_TILE_SIZE,
    H3_TOKENIZER, H3_TEXT_ENCODER_POLICY)."""
    import dataclasses

    from h3direct.app.models import ModelSpec

    env = os.environ if env is None else env
    out = {}
    for f in dataclasses.fields(ModelSpec):
        spec = spec_of(f)
        name = "H3_" + f.name.upper()
        if spec.env and (raw := _set(env, name)) is not None:
            out[f.name] = parse_env(name, raw, kind_of(f.default, spec), spec)
    return out


def read_tiers(env: Mapping[str, str] | None = None) -> str | None:
    """$H3_TIERS: the tiers file `--tier` reads (`app/tiers.py`), or None."""
    from h3direct.app.tiers import ENV

    return _set(os.environ if env is None else env, ENV)


def variables() -> list[str]:
    """Every H3_* variable the runtime reads at startup (options, model settings, the refused ones)."""
    import dataclasses

    from h3direct.app.models import ModelSpec
    from h3direct.dit.options import flat_options

    names = [o.env for o in flat_options() if o.env is not None]
    names += ["H3_" + f.name.upper() for f in dataclasses.fields(ModelSpec) if spec_of(f).env]
    return sorted({*names, *REFUSED, "H3_TIERS"})
