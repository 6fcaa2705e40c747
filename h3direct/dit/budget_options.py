"""The options of the `budget_attn` backend (`BudgetOptions`, registered with it in `attention.py`; the algorithm:
`budget_attention.py`).

Each option is a request field `budget_<name>`, a flag `--budget-<name>` and, read once at startup, an environment
variable `H3_BUDGET_<NAME>` (the flag or field wins):

| option       | default | what                                                                                 |
|--------------|---------|--------------------------------------------------------------------------------------|
| `mass`       | 0.05    | the budget: the share of each query block's attention mass its dropped key blocks may |
|              |         | hold, for every sampled row of the block (per query block and head)                   |
| `samples`    | 8       | query rows per 64-row block whose attention over every key estimates the block masses |
|              |         | (64: every row, through the fused selection kernel on CUDA, `budget_select_triton`)   |
| `tail`       | on      | dropped key blocks stay in the softmax through one pooled term each (their mean key,  |
|              |         | their mean value, their length); off: dropped                                         |
| `sinks`      | prefix  | `prefix`: the key blocks of the rows before the target video are always kept; `none`: |
|              |         | they compete for the budget like any other                                            |
| `exact_rows` | on      | the query blocks of the rows before the target video keep every key block (the local  |
|              |         | structure the budget works with is the video's)                                       |
| `min_tokens` | 4096    | below this sequence length a call runs `fallback` (documented fallback, counted)      |
| `fallback`   | sdpa    | the backend of those calls                                                            |
| `strict`     | off     | a call that would fall back raises instead                                            |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3direct.fields import check, field

BUDGET_BLOCK = 64  # query and key block size: the selection's and its kernel's (`block_sparse_triton.BLOCK`) tile
BUDGET_SUB = 16  # the key sub-blocks whose mean keys the block masses are estimated with


@dataclass(frozen=True)
class BudgetOptions:
    PREFIX = "budget"

    mass: float = field(0.05, "the attention mass each query block may leave to dropped key blocks (every sampled "
                        "row's; smaller = denser, closer to exact)", rule=lambda v: 0.0 <= v < 1.0,
                        expect="a fraction in [0, 1)", env=True)
    samples: int = field(8, "query rows per 64-row block that estimate the key blocks' masses",
                         rule=lambda v: v in (1, 2, 4, 8, 16, 32, 64), expect="a power of two from 1 to 64", env=True)
    tail: bool = field(True, "dropped key blocks stay in the softmax through one pooled term each", env=True)
    sinks: str = field("prefix", "prefix: the key blocks of the rows before the target video are always kept; none: "
                       "they compete for the budget like any other",
                       choices=("prefix", "none"), env=True)
    exact_rows: bool = field(True, "the query blocks of the rows before the target video keep every key block",
                             env=True)
    min_tokens: int = field(4096, "shorter calls run the fallback backend (counted)", rule=lambda v: v >= 0,
                            expect="a non-negative integer", env=True)
    fallback: str = field("sdpa", "the backend of calls shorter than min_tokens", rule=lambda v: v != "budget_attn",
                          expect="another attention backend", env=True)
    strict: bool = field(False, "a call that would fall back is an error instead", env=True)

    def __post_init__(self):
        check(self, self.PREFIX + "_")

    def prefix_blocks(self, prefix_rows: int | None) -> int:
        """The 64-row blocks that hold the rows before the target video (0 when unknown)."""
        return math.ceil(prefix_rows / BUDGET_BLOCK) if prefix_rows else 0
