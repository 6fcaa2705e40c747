"""Record per-module tensors under the oracle's names (see `oracle/FORMAT.md` and ../shared/oracle/README.md).

Names: `<module path>.out` (`.out.k` for the k-th element of a tuple output), `<module path>.in.N` for the
N-th positional tensor input, `<module path>#k.…` for the k-th call of a module within one record, plus
explicit names (`blocks.i.attn.rope_q`, `dit_inner.*`, `dit_forward.*`, `sampler.*`, `layout.position_ids`).
The input of an `out_proj` (the attention output) is named `<path>.in`, as in the oracle traces.

Tensors are cloned when recorded (the forward updates its residual stream in place) and kept in the dtype
they were produced in (the trace file stores them widened to float32, the manifest keeps the produced dtype).
"""

from __future__ import annotations

import re

import torch
from torch import nn


class Tracer:
    def __init__(self, model: nn.Module, *, inputs_for: str | None = r".*", skip: str | None = None):
        """inputs_for: regex of module paths whose positional inputs are recorded (default all)."""
        self.model = model
        self.tensors: dict[str, torch.Tensor] = {}
        self._calls: dict[str, int] = {}
        self._handles = []
        self._names = {m: n for n, m in model.named_modules() if n}
        self._inputs_re = re.compile(inputs_for) if inputs_for else None
        self._skip_re = re.compile(skip) if skip else None
        self.gather = None  # (name, tensor) -> tensor: set while sharded blocks run (h3direct.dit.parallel)

    # ---- explicit records ------------------------------------------------------------------
    def record(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.tensors:
            k = 1
            while f"{name}#{k}" in self.tensors:
                k += 1
            name = f"{name}#{k}"
        if self.gather is not None:
            tensor = self.gather(name, tensor)
        self.tensors[name] = tensor.detach().clone().cpu()

    def record_tensor(self, module: nn.Module, suffix: str, tensor: torch.Tensor) -> None:
        self.record(f"{self._call_name(module)}.{suffix}", tensor)

    # ---- hooks -------------------------------------------------------------------------------
    def _call_name(self, module: nn.Module, *, new_call: bool = False) -> str:
        path = self._names[module]
        k = self._calls.get(path, 0)
        if new_call:
            self._calls[path] = k + 1
        else:
            k = max(k - 1, 0)
        return path if k == 0 else f"{path}#{k}"

    def _pre(self, module, args):
        name = self._call_name(module, new_call=True)
        path = self._names[module]
        if self._skip_re is not None and self._skip_re.fullmatch(path):
            return
        if path.endswith("out_proj") and args and torch.is_tensor(args[0]):
            self.record(f"{name}.in", args[0])
        elif self._inputs_re is not None and self._inputs_re.fullmatch(path):
            for i, a in enumerate(args):
                if torch.is_tensor(a):
                    self.record(f"{name}.in.{i}", a)

    def _post(self, module, args, out):
        path = self._names[module]
        if self._skip_re is not None and self._skip_re.fullmatch(path):
            return
        name = self._call_name(module)
        if torch.is_tensor(out):
            self.record(f"{name}.out", out)
        elif isinstance(out, (tuple, list)):
            for i, o in enumerate(out):
                if torch.is_tensor(o):
                    self.record(f"{name}.out.{i}", o)

    def __enter__(self) -> Tracer:
        for module in self._names:
            self._handles.append(module.register_forward_pre_hook(self._pre))
            self._handles.append(module.register_forward_hook(self._post))
            if hasattr(module, "tracer"):
                module.tracer = self
        if hasattr(self.model, "tracer"):
            self.model.tracer = self
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module in self._names:
            if hasattr(module, "tracer"):
                module.tracer = None
        if hasattr(self.model, "tracer"):
            self.model.tracer = None
        return False
