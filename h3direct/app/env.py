"""The environment, read once at startup by the command line (`app/cli.py`) and nowhere else.

Each `H3_*` variable that sets an option is the option's flat name in capitals (`H3_SOL_TAU` -> `sol_tau`,
`H3_FUSED` -> `fused`: `dit/options.py`); the settings of the models are `H3_VAE_DTYPE`, `H3_VAE_TILE_SIZE` and
`H3_TOKENIZER`. A value is parsed by its field's type and checked by its field's rule, with one rule for every switch
(1/0, true/false, yes/no, on/off); a bad one is a one-line `ConfigError` naming the variable (exit 2 at startup).
A flag given on the command line, or a request field, wins over the variable. `H3_CACHE_DIR` (where rebuildable
files are kept) is read where that folder is needed (`app/paths.py`); `H3_COMFY_ROOT` belongs to the oracle and is
not read by the runtime.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from h3direct.errors import ConfigError
from h3direct.fields import Spec, parse_env

# variables that once meant something and now have no counterpart: set, they are an error (never silently ignored)
REFUSED = {
    "H3_SOL_INT8_QK": "comfy-kitchen's sol_attn has no precision switch (its QK product is always INT8)",
    "H3_SOL_INT8_PV": "comfy-kitchen's sol_attn has no precision switch (its QK product is always INT8)",
}

# the model settings' variables: name -> (setting, type, spec)
SETTINGS: dict[str, tuple[str, type, Spec]] = {
    "H3_VAE_DTYPE": ("vae_dtype", str, Spec("", choices=("fp32", "fp16"))),
    "H3_VAE_TILE_SIZE": ("vae_tile_size", int, Spec("", rule=lambda v: v >= 0, expect="an integer >= 0")),
    "H3_TOKENIZER": ("tokenizer", str, Spec("")),
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
    """{setting: value} of the model settings' variables that are set."""
    env = os.environ if env is None else env
    out = {}
    for name, (setting, kind, spec) in SETTINGS.items():
        if (raw := _set(env, name)) is not None:
            out[setting] = parse_env(name, raw, kind, spec)
    return out
