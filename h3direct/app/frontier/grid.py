"""The frontier's candidates: the attention axis times the 8-bit block linears axis, less the pairs not measured,
expanded here for the machine at hand.

A candidate is a path as the benchmark contract writes one: `{"attention", "fp8_linear", "options"}` with its
options under their flat names (`dit.options`). Two roles resolve on the machine (`expand`'s `reason`, the seam a test
injects): `EXACT` (the exact rows and fallback of the sparse backend, and the attention of the 8-bit linears alone)
is the fastest exact backend that runs here, `EXACT_ORDER`; `QUANTIZED` (the 8-bit attention the 8-bit linears are
combined with) the fastest of `QUANTIZED_ORDER` that runs here. So a machine without fa3 (a GB10) keeps the
combinations an H100 has with fa3: the 8-bit linears with sage2 and with the sparse backend, their exact rows and
fallback on cuDNN's SDPA (else PyTorch's). Every exact backend is also a candidate of its own (the exact tier's).
What cannot run as itself here is left out with one line (`left_out_reason`).
"""

from __future__ import annotations

from collections.abc import Callable

EXACT, QUANTIZED = "{exact}", "{quantized}"
EXACT_ORDER = ("fa3", "cudnn_sdpa", "sdpa")  # the exact backends, fastest first
QUANTIZED_ORDER = ("fa3_fp8", "sage2")  # the 8-bit attention combined with 8-bit linears, fastest first

SOL_TAUS = (1.0, 1.3, 1.8, 2.5)
BUDGET_MASSES = (0.03, 0.05, 0.1)  # budget_attn's budgets: the attention mass each query block may leave dropped
# the attention axis: name -> the attention part of a path
ATTENTION = {"exact": {"attention": EXACT}, "sage2": {"attention": "sage2"}, "ck_int8": {"attention": "ck_int8"},
             "fa3_fp8": {"attention": "fa3_fp8"},
             **{f"sol_{t}": {"attention": "sol_attn",
                             "options": {"sol_tau": t, "sol_rows_backend": EXACT, "sol_fallback": EXACT}}
                for t in SOL_TAUS},
             **{f"budget_{m}": {"attention": "budget_attn", "options": {"budget_mass": m, "budget_fallback": EXACT}}
                for m in BUDGET_MASSES}}
MLP, ALL = "fc1,fc2", "qkv_proj,out_proj,fc1,fc2"
INT8, E4M3 = {"fp8_linear_format": "int8"}, {"fp8_accum": "fast"}
# the block linears axis: name -> the options of the 8-bit block linears (streamed), {} for the checkpoint's own
LINEARS = {"none": None, "int8_mlp": {**INT8, "fp8_linear_layers": MLP}, "int8_all": INT8,
           "e4m3_mlp": {"fp8_linear_layers": MLP, **E4M3}, "e4m3_all": E4M3,
           "int8_mlp_rot": {**INT8, "fp8_linear_layers": MLP, "fp8_linear_rotate": MLP},
           "int8_all_rot": {**INT8, "fp8_linear_rotate": ALL}}
# Exclusions: an approximate attention with 8-bit linears is measured only for these (linears, attention) pairs (the
# rest of the product lies between measured points: on an H100 the rotated int8 linears lead the class, and the
# sparse taus and budgets each format can afford); every exact attention x linears pair and every attention alone is
# measured.
COMBINED = (("int8_mlp_rot", "sol_1.0"), ("int8_mlp_rot", "sol_1.3"), ("int8_all_rot", "sol_1.3"),
            ("int8_all_rot", "sol_1.8"), ("e4m3_mlp", "sol_1.3"), ("e4m3_all", "sol_2.5"),
            ("int8_mlp_rot", "quantized"), ("int8_mlp_rot", "budget_0.05"), ("int8_mlp_rot", "budget_0.1"))


def excluded(linears: str, attention: str) -> bool:
    """Whether the (linears, attention) pair of the product is left out of the grid (`COMBINED`; a pair with the
    8-bit attention role, "quantized", is added by its role, not by a backend of the axis)."""
    return linears != "none" and attention != "exact" and (linears, attention) not in COMBINED


def grid() -> dict[str, dict]:
    """{name: path} of the product less the exclusions, roles unresolved: the exact rows by backend, then each
    attention alone, each 8-bit linears set on the exact backend, and the combinations (`COMBINED`)."""
    out = {f"exact_{b}": {"attention": b} for b in EXACT_ORDER}
    for att, a in ATTENTION.items():
        for lin, options in LINEARS.items():
            if (att, lin) == ("exact", "none") or (att != "exact" and excluded(lin, att)):
                continue
            out[_name(lin, att)] = _path(a, options)
    for lin, att in COMBINED:
        if att == "quantized":
            out[_name(lin, att)] = _path({"attention": QUANTIZED}, LINEARS[lin])
    return out


def _name(linears: str, attention: str) -> str:
    if linears == "none":
        return attention
    return linears if attention == "exact" else f"{linears}+{attention}"


def _path(attention: dict, linears: dict | None) -> dict:
    path = {"attention": attention["attention"]}
    options = dict(attention.get("options", {}))
    if linears is not None:
        path["fp8_linear"] = "stream"
        options.update(linears)
    return {**path, "options": options} if options else path


def expand(reason: Callable[[str], str | None]) -> dict[str, dict]:
    """{name: path} of `grid()` with its roles resolved by `reason` (an attention backend's name -> why it cannot run
    here, None: it runs): `EXACT` the first of `EXACT_ORDER` that runs (sdpa where none does), `QUANTIZED` the first of
    `QUANTIZED_ORDER` (the first of them where none does: it is then left out, with its reason). A combination is named
    after the 8-bit attention it takes (`int8_mlp_rot+fa3_fp8`, or `+sage2` without fa3)."""
    exact = next((b for b in EXACT_ORDER if reason(b) is None), EXACT_ORDER[-1])
    quantized = next((b for b in QUANTIZED_ORDER if reason(b) is None), QUANTIZED_ORDER[0])
    out = {}
    for name, path in grid().items():
        resolved = _resolve(path, exact, quantized)
        out[name.replace("quantized", quantized)] = resolved
    return out


def _resolve(path: dict, exact: str, quantized: str) -> dict:
    def one(v):
        return {EXACT: exact, QUANTIZED: quantized}.get(v, v) if isinstance(v, str) else v

    out = {k: one(v) for k, v in path.items() if k != "options"}
    if "options" in path:
        out["options"] = {k: one(v) for k, v in path["options"].items()}
    return out


def options_of(path: dict):
    """A path's typed options (`dit.options.Options`): its attention backend, its 8-bit linears and its "options"
    under their flat names (`sol_tau`, `fused`, ...); a name that is not an option is an error."""
    from h3direct.dit.options import Options

    return Options.from_flat({"attention": path["attention"], "fp8_linear": path.get("fp8_linear", "off"),
                              **path.get("options", {})})


def is_exact(path: dict) -> bool:
    """An exact attention backend with the checkpoint's own linears."""
    from h3direct.dit.attention import is_exact as exact_attention

    return path.get("fp8_linear", "off") == "off" and exact_attention(options_of(path).attention)


def available_on(device) -> Callable[[str], str | None]:
    """`expand`'s `reason` on `device`: why an attention backend cannot run there (None: it runs)."""
    import torch

    from h3direct.dit.attention import unavailable_reason

    like = torch.empty(0, device=device, dtype=torch.bfloat16)
    return lambda backend: unavailable_reason(backend, like)


def left_out_reason(path: dict, device) -> str | None:
    """Why a candidate cannot run as itself on `device` (None: it can): an attention backend it calls that is
    unavailable, or an 8-bit GEMM that would be emulated."""
    import torch

    from h3direct.checkpoint.quant.w8a8 import gemm_reason
    from h3direct.dit.attention import unavailable_reason
    from h3direct.dit.options import backends_in_effect

    options = options_of(path)
    like = torch.empty(0, device=device, dtype=torch.bfloat16)
    for backend in backends_in_effect(options.attention):
        why = unavailable_reason(options.attention.using(backend), like)
        if why is not None:
            return f"{backend}: {why}"
    if options.kernels.fp8_linear != "off" and torch.device(device).type == "cuda":
        why = gemm_reason(options.kernels.fp8_linear_format, device)
        if why is not None:
            return f"{options.kernels.fp8_linear_format} GEMM emulated: {why}"
    return None
