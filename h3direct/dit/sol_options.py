"""The options of the `sol_attn` backend (`SolOptions`, registered with it in `attention.py`), mapped onto
comfy-kitchen's `sol_attn` arguments.

comfy-kitchen >= 0.2.40 `sol_attn(q, k, v, tau, scale, sink_blocks, sink_q, key_bias, topk_ratio, tail, block_len,
coarse_gate, token_aug)` over [B, T, H, 128] bf16/fp16 tensors: every 64-token query block attends its routed key
blocks exactly (the diagonal block always, the sink blocks always) and every other key block through one pooled
term, so all keys stay in the softmax denominator. Its arithmetic is fixed (INT8 QK MMA); there is no precision switch.

Each option is a request field `sol_<name>`, a flag `--sol-<name>` and, read once at startup, an environment
variable `H3_SOL_<NAME>` (the flag or field wins):

| option        | default | maps to                                                                            |
|---------------|---------|------------------------------------------------------------------------------------|
| `tau`         | 1.3     | `tau` (routing threshold in sigmas of the proxy row; higher = sparser)             |
| `thresh_type` | diag    | `diag`: tau threshold (diagonal and sinks always exact); `topk`: `topk_ratio`       |
| `topk_ratio`  | 0.1     | `topk_ratio` when `thresh_type` is topk (fraction of key blocks kept, (0, 1))       |
| `sinks`       | prefix  | `sink_blocks`: `prefix` = the key blocks holding the rows before the target video   |
|               |         | (text, references, keyframes, target audio) when the DiT says where they end;       |
|               |         | `none` = no sinks                                                                   |
| `exact_rows`  | on      | the query blocks of the rows before the target video attend every key exactly (the |
|               |         | sparse routing assumes video locality, which text, reference and audio queries     |
|               |         | lack); off = every query block is routed                                           |
| `rows_backend`| sdpa    | what computes those exact query blocks: an exact backend (sdpa, cudnn_sdpa, fa3)   |
|               |         | over every key, written over the kernel's routed rows (sdpa and cudnn_sdpa copy v  |
|               |         | dense, fa3 reads it strided); `kernel` = the kernel's own `sink_q` (INT8 QK; one   |
|               |         | 64-row block per program over all key blocks: slower)                              |
| `tail`        | on      | `tail` (off drops the pooled term of unrouted blocks)                              |
| `token_aug`   | 0       | `token_aug` (0 or a multiple of 64 up to 256)                                      |
| `min_tokens`  | 4096    | below this sequence length the call runs `fallback` (documented fallback)          |
| `fallback`    | sage2   | the backend of those calls (and of calls whose head_dim is not 128)                |
| `strict`      | off     | a call that would fall back raises instead                                         |

`H3_SOL_INT8_QK` / `H3_SOL_INT8_PV` have no counterpart (the kernel's precision is fixed): setting either is an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from h3direct.fields import check, field, positive

SOL_BLOCK = 64  # query/key block size of the kernel
SOL_HEAD_DIM = 128  # the only head size the kernel takes
ROWS_BACKENDS = ("sdpa", "cudnn_sdpa", "fa3", "kernel")  # the exact backends of attention.py, or the kernel itself


@dataclass(frozen=True)
class SolOptions:
    PREFIX = "sol"

    tau: float = field(1.3, "routing threshold in sigmas of the proxy row (higher = sparser)", rule=positive,
                       expect="a positive number", env=True)
    thresh_type: str = field("diag", "diag: the tau threshold; topk: keep topk_ratio of the key blocks",
                             choices=("diag", "topk"), env=True)
    topk_ratio: float = field(0.1, "fraction of key blocks kept when thresh_type is topk",
                              rule=lambda v: 0.0 < v < 1.0, expect="a fraction in (0, 1)", env=True)
    sinks: str = field("prefix", "prefix: the key blocks of the rows before the target video always attend exactly; "
                       "none: no sinks", choices=("prefix", "none"), env=True)
    exact_rows: bool = field(True, "the query rows before the target video attend every key exactly", env=True)
    rows_backend: str = field("sdpa", "what computes those exact rows: an exact attention backend over every key, or "
                              "kernel: the sparse kernel's own exact query blocks (INT8 QK)", choices=ROWS_BACKENDS,
                              env=True)
    tail: bool = field(True, "keep the pooled term of unrouted key blocks", env=True)
    token_aug: int = field(0, "token routing augmentation (0 or a multiple of 64 up to 256)",
                           rule=lambda v: 0 <= v <= 256 and v % 64 == 0, expect="0 or a multiple of 64 up to 256",
                           env=True)
    min_tokens: int = field(4096, "shorter calls run the fallback backend (counted)", rule=lambda v: v >= 0,
                            expect="a non-negative integer", env=True)
    fallback: str = field("sage2", "the backend of calls the kernel cannot take", rule=lambda v: v != "sol_attn",
                          expect="another attention backend", env=True)
    strict: bool = field(False, "a call that would fall back is an error instead", env=True)

    def __post_init__(self):
        check(self, self.PREFIX + "_")

    @property
    def rows_elsewhere(self) -> str | None:
        """The exact backend that computes the exact query rows outside the kernel (None: the kernel does, or there
        are none)."""
        return self.rows_backend if self.exact_rows and self.rows_backend != "kernel" else None

    def exact_query_rows(self, prefix_rows: int | None, rows: int) -> int:
        """How many leading query rows attend every key exactly: the whole 64-row blocks that hold the `prefix_rows`
        rows before the target video (0: none), capped at the sequence's `rows`."""
        return min(rows, _blocks(prefix_rows) * SOL_BLOCK) if self.exact_rows else 0

    def kernel_kwargs(self, prefix_rows: int | None) -> dict:
        """Keyword arguments of `comfy_kitchen.sol_attn` (besides q, k, v) for one call.

        prefix_rows: rows before the target video in the packed sequence (None when unknown). The exact query rows
        go to the kernel as `sink_q` only when it computes them itself (`rows_backend` kernel)."""
        kw = {"tau": self.tau, "tail": self.tail, "token_aug": self.token_aug,
              "topk_ratio": self.topk_ratio if self.thresh_type == "topk" else 0.0}
        if self.sinks == "prefix" and prefix_rows:
            kw["sink_blocks"] = [0, _blocks(prefix_rows)]
        if self.exact_rows and prefix_rows and self.rows_elsewhere is None:
            kw["sink_q"] = [0, _blocks(prefix_rows)]
        return kw


def _blocks(prefix_rows: int | None) -> int:
    """The 64-row blocks that hold the rows before the target video (0 when unknown)."""
    return math.ceil(prefix_rows / SOL_BLOCK) if prefix_rows else 0
