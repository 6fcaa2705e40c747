"""Record the inputs and outputs of every module of a running ComfyUI model under the shared trace names.

Names: `<module path>[#k].out[.N]`, `<module path>[#k].in.N` (see oracle/FORMAT.md). Every tensor is cloned when
its hook fires, because ComfyUI's H3 code modulates and accumulates residuals in place afterwards.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DETAILS = ("full", "reduced")

# modules whose positional inputs the shared traces keep (the `reduced` set and the shared non-curve files)
_SHARED_INPUT_SITES = re.compile(
    r"^(blocks\.0|blocks\.0\.attn|blocks\.0\.mlp|token_refiner\.blocks\.0|token_refiner\.blocks\.0\.attn|"
    r"time_embedder|final_layer)$"
)
# never recorded: the wide adaLN linear (its chunks are `adaln_proj.out.k`)
_SKIP_OUT = re.compile(r"\.adaln_proj\.linear$")
# reduced detail: blocks >= 1 keep only adaln_proj / attn.out_proj / mlp.fc2 / attn / mlp / block outputs
_REDUCED_DROP = re.compile(r"^blocks\.([1-9]\d*)\.(norm1|norm2|attn\.qkv_proj|mlp\.fc1)$")


def _is_late_block(path: str) -> bool:
    m = re.match(r"^blocks\.(\d+)\.", path)
    return bool(m and int(m.group(1)) >= 1)


@dataclass
class _Frame:
    path: str
    module: torch.nn.Module
    kwargs: dict[str, Any]


@dataclass
class Recorder:
    """Collects (name, tensor) in execution order."""

    detail: str = "full"
    attention_cls: type | None = None  # ComfyUI's H3 Attention class: its calls with rope_freqs give rope_q/k
    records: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    _names: set[str] = field(default_factory=set)
    _calls: Counter = field(default_factory=Counter)
    _stack: list[_Frame] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)
    enabled: bool = True
    payload: dict | None = None  # the minimax_payload of the last traced forward
    static_inputs: dict[str, Any] = field(default_factory=dict)  # non-tensor positional inputs (JSON-able)

    def __post_init__(self) -> None:
        if self.detail not in DETAILS:
            raise ValueError(f"detail {self.detail!r} not in {DETAILS}")

    # ------------------------------------------------------------------ storage
    def add(self, name: str, value: torch.Tensor) -> None:
        if not self.enabled or not isinstance(value, torch.Tensor):
            return
        if name in self._names:  # a repeated site outside module hooks: number it like a module call
            k = 1
            while f"{name}#{k}" in self._names:
                k += 1
            name = f"{name}#{k}"
        self._names.add(name)
        self.records.append((name, value.detach().clone()))

    def add_streams(self, prefix: str, value: Any) -> None:
        """A [video, audio] pair (list, tuple or ComfyUI NestedTensor) as `<prefix>.video` / `<prefix>.audio`."""
        parts = list(value.unbind()) if getattr(value, "is_nested", False) else list(value)
        for label, t in zip(("video", "audio"), parts, strict=False):
            self.add(f"{prefix}.{label}", t)

    def tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.records)

    # ------------------------------------------------------------------ module hooks
    def _wants_inputs(self, path: str) -> bool:
        if self.detail == "full":
            return True
        return bool(_SHARED_INPUT_SITES.match(path))

    def _wants_output(self, path: str) -> bool:
        if _SKIP_OUT.search(path):
            return False
        return not (self.detail == "reduced" and _REDUCED_DROP.match(path))

    def attach(self, root: torch.nn.Module, *, root_name: str | None = "dit_forward") -> None:
        """Hook every submodule of `root` (names = module paths); the root itself records `root_name.in/out`."""
        for path, module in root.named_modules():
            if path == "":
                if root_name:
                    self._handles.append(module.register_forward_pre_hook(self._root_pre(root_name), with_kwargs=True))
                    self._handles.append(module.register_forward_hook(self._root_post(root_name), with_kwargs=True))
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post(path), with_kwargs=True))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _call_name(self, path: str) -> str:
        k = self._calls[path]
        return path if k == 0 else f"{path}#{k}"

    def _pre(self, path: str) -> Callable:
        def hook(module, args, kwargs):
            self._stack.append(_Frame(path, module, kwargs))
            name = self._call_name(path)
            if self._wants_inputs(path):
                for i, a in enumerate(args):
                    if isinstance(a, torch.Tensor):
                        self.add(f"{name}.in.{i}", a)
                    elif self.enabled:
                        self.static_inputs[f"{name}.in.{i}"] = _jsonable(a)
            if path.endswith(".out_proj") and not (self.detail == "reduced" and _is_late_block(path)):
                self.add(f"{name}.in", args[0])  # the attention output
            return None

        return hook

    def _post(self, path: str) -> Callable:
        def hook(module, args, kwargs, output):
            name = self._call_name(path)
            self._calls[path] += 1
            if self._stack and self._stack[-1].module is module:
                self._stack.pop()
            if self._wants_output(path):
                self._add_output(name, output)
            return None

        return hook

    def _add_output(self, name: str, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            self.add(f"{name}.out", output)
        elif isinstance(output, list | tuple):
            for i, o in enumerate(output):
                self.add(f"{name}.out.{i}", o)

    def _root_pre(self, root_name: str) -> Callable:
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs.get("x")
            if isinstance(x, list | tuple) or getattr(x, "is_nested", False):
                self.add_streams(f"{root_name}.in", x)
            else:
                self.add(f"{root_name}.in.x", x)
            t = args[1] if len(args) > 1 else kwargs.get("timestep")
            self.add(f"{root_name}.in.timestep", t)
            return None

        return hook

    def _root_post(self, root_name: str) -> Callable:
        def hook(module, args, kwargs, output):
            if isinstance(output, list | tuple):
                self.add_streams(f"{root_name}.out", output)
            else:
                self.add(f"{root_name}.out", output)
            return None

        return hook

    # ------------------------------------------------------------------ ComfyUI extension points
    def current_attention(self) -> _Frame | None:
        for frame in reversed(self._stack):
            if self.attention_cls is None or isinstance(frame.module, self.attention_cls):
                return frame
        return None

    def attention_override(self, func: Callable, q, k, v, *args, **kwargs):
        """`transformer_options["optimized_attention_override"]`: records q/k after the fused RMSNorm+RoPE."""
        frame = self.current_attention()
        if frame is not None and frame.kwargs.get("rope_freqs") is not None:
            if not (self.detail == "reduced" and _is_late_block(frame.path)):
                name = self._call_name(frame.path)
                # [1, heads, S, d] -> [S, heads, d] (the layout of the shared traces)
                self.add(f"{name}.rope_q", q[0].transpose(0, 1))
                self.add(f"{name}.rope_k", k[0].transpose(0, 1))
        return func(q, k, v, *args, **kwargs)

    def diffusion_model_wrapper(self, executor, x, timestep, context, transformer_options, **kwargs):
        """WrappersMP.DIFFUSION_MODEL: what `MiniMaxH3Model._forward` sees and returns."""
        self.add_streams("dit_inner.in", x)
        self.add("dit_inner.in.timestep", timestep)
        self.add("dit_inner.in.context", context)
        self.payload = kwargs.get("minimax_payload")
        layout = (self.payload or {}).get("layout")
        if layout is not None:
            self.add("layout.position_ids", layout.position_ids)
        out = executor(x, timestep, context, transformer_options, **kwargs)
        self.add_streams("dit_inner.out", out)
        return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    return repr(value)


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            yield from iter_tensors(v)
