"""`H3_SOL_*` environment options of the `sol_attn` backend, mapped onto comfy-kitchen's `sol_attn` arguments.

comfy-kitchen >= 0.2.40 `sol_attn(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len,
coarse_gate, token_aug)` over [B, T, H, 128] bf16/fp16 tensors: every 64-token query block attends its routed key
blocks exactly (the diagonal block always, the sink blocks always) and every other key block through one pooled
term, so all keys stay in the softmax denominator. Its arithmetic is fixed (INT8 QK MMA); there is no precision switch.

| variable              | default | maps to                                                                          |
|-----------------------|---------|----------------------------------------------------------------------------------|
| `H3_SOL_TAU`          | 1.3     | `tau` (routing threshold in sigmas of the proxy row; higher = sparser)           |
| `H3_SOL_THRESH_TYPE`  | diag    | `diag`: tau threshold (diagonal and sinks always exact); `topk`: `topk_ratio`     |
| `H3_SOL_TOPK_RATIO`   | 0.1     | `topk_ratio` when `H3_SOL_THRESH_TYPE=topk` (fraction of key blocks kept, (0, 1)) |
| `H3_SOL_SINKS`        | prefix  | `sink_blocks`: `prefix` = the key blocks holding the rows before the target video |
|                       |         | (text, references, keyframes, target audio) when the DiT says where they end;     |
|                       |         | `none` = no sinks                                                                 |
| `H3_SOL_EXACT_ROWS`   | 1       | `sink_q`: 1 = the query blocks of the rows before the target video attend every   |
|                       |         | key exactly (the sparse routing assumes video locality, which text, reference and |
|                       |         | audio queries lack); 0 = every query block is routed                             |
| `H3_SOL_TAIL`         | 1       | `tail` (0 drops the pooled term of unrouted blocks)                              |
| `H3_SOL_TOKEN_AUG`    | 0       | `token_aug` (0 or a multiple of 64 up to 256)                                    |
| `H3_SOL_MIN_TOKENS`   | 4096    | below this sequence length the call runs `H3_SOL_FALLBACK` (documented fallback) |
| `H3_SOL_FALLBACK`     | sage2   | the backend of those calls (and of calls whose head_dim is not 128)              |
| `H3_SOL_STRICT`       | 0       | 1: a call that would fall back raises instead                                    |
| `H3_SOL_INT8_QK`,     |         | no counterpart: the kernel's precision is fixed; setting either is an error       |
| `H3_SOL_INT8_PV`      |         |                                                                                  |
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from h3direct.errors import ConfigError

SOL_BLOCK = 64  # query/key block size of the kernel
SOL_HEAD_DIM = 128  # the only head size the kernel takes


@dataclass(frozen=True)
class SolOptions:
    tau: float = 1.3
    thresh_type: str = "diag"
    topk_ratio: float = 0.1
    sinks: str = "prefix"
    exact_rows: bool = True
    tail: bool = True
    token_aug: int = 0
    min_tokens: int = 4096
    fallback: str = "sage2"
    strict: bool = False

    def kernel_kwargs(self, prefix_rows: int | None) -> dict:
        """Keyword arguments of `comfy_kitchen.sol_attn` (besides q, k, v) for one call.

        prefix_rows: rows before the target video in the packed sequence (None when unknown)."""
        kw = {"tau": self.tau, "tail": self.tail, "token_aug": self.token_aug,
              "topk_ratio": self.topk_ratio if self.thresh_type == "topk" else 0.0}
        if self.sinks == "prefix" and prefix_rows:
            kw["sink_blocks"] = [0, math.ceil(prefix_rows / SOL_BLOCK)]
        if self.exact_rows and prefix_rows:
            kw["sink_q"] = [0, math.ceil(prefix_rows / SOL_BLOCK)]
        return kw


def _get(env, name, default, conv, check, expect):
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = conv(raw)
    except ValueError:
        value = None
    if value is None or not check(value):
        raise ConfigError(f"{name}={raw!r}: expected {expect}")
    return value


def _bool(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(raw)
    return raw == "1"


def sol_options(env=None) -> SolOptions:
    """Parse `H3_SOL_*` from `env` (default os.environ); a bad value is one ConfigError line."""
    env = os.environ if env is None else env
    for name in ("H3_SOL_INT8_QK", "H3_SOL_INT8_PV"):
        if env.get(name):
            raise ConfigError(f"{name}={env[name]!r}: comfy-kitchen's sol_attn has no precision switch (its QK "
                              f"product is always INT8); unset {name}")
    d = SolOptions()
    return SolOptions(
        tau=_get(env, "H3_SOL_TAU", d.tau, float, lambda v: math.isfinite(v) and v > 0, "a positive number"),
        thresh_type=_get(env, "H3_SOL_THRESH_TYPE", d.thresh_type, str, lambda v: v in ("diag", "topk"),
                         "diag or topk"),
        topk_ratio=_get(env, "H3_SOL_TOPK_RATIO", d.topk_ratio, float, lambda v: 0.0 < v < 1.0,
                        "a fraction in (0, 1)"),
        sinks=_get(env, "H3_SOL_SINKS", d.sinks, str, lambda v: v in ("prefix", "none"), "prefix or none"),
        exact_rows=_get(env, "H3_SOL_EXACT_ROWS", d.exact_rows, _bool, lambda v: True, "0 or 1"),
        tail=_get(env, "H3_SOL_TAIL", d.tail, _bool, lambda v: True, "0 or 1"),
        token_aug=_get(env, "H3_SOL_TOKEN_AUG", d.token_aug, int, lambda v: 0 <= v <= 256 and v % 64 == 0,
                       "0 or a multiple of 64 up to 256"),
        min_tokens=_get(env, "H3_SOL_MIN_TOKENS", d.min_tokens, int, lambda v: v >= 0, "a non-negative integer"),
        fallback=_get(env, "H3_SOL_FALLBACK", d.fallback, str, lambda v: v != "sol_attn",
                      "another attention backend"),
        strict=_get(env, "H3_SOL_STRICT", d.strict, _bool, lambda v: True, "0 or 1"),
    )
