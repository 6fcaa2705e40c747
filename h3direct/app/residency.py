"""Where the text encoder stays between requests: the policy `text_encoder_policy` (`--text-encoder-policy`,
H3_TEXT_ENCODER_POLICY).

- resident: on the device all the time;
- offload: in host memory between requests (page-locked when the device is a GPU, so the copy runs at the link's
  full rate), copied to the device for a request's text encode; after it the device copy is dropped and the host copy,
  kept all along and never changed, is the encoder again (no copy back);
- unload: freed after the encode and read again from its file, straight to the device, for the next request's;
- auto (the default): resident when the hot footprint (`app/footprint.py`: the weights every model holds) plus
  `WORKING_MARGIN` fits the device's memory; else unload on a unified-memory device (GB10 / DGX Spark: host and
  device share one memory, so moving the encoder to the host frees nothing) and offload on a discrete GPU;
  resident on the CPU.

The policy moves the weights and never changes them (offload reuses the very host tensors it loaded), so a clip is
bitwise the same under every policy. Between requests the encoder's memory serves sampling and decoding; during the
encode it is on the device with the other models. Each move's seconds are the request's timings (`text_encoder_load`,
`text_encoder_to_device`, `text_encoder_to_host`, `text_encoder_free`); the last move is the slot's (`/ready`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

POLICIES = ("auto", "resident", "offload", "unload")
# room for what is not weights: the activations of a generation at the request limits, the VAE decode's tiles, the
# allocator's cache and, on a unified-memory device, the operating system and the host side of the process
WORKING_MARGIN = 16 << 30
UNIFIED_CAPABILITIES = ((12, 1),)  # GB10 (DGX Spark), should its driver not report the device as integrated


@dataclass(frozen=True)
class Machine:
    """What `auto` needs to know of the device: its type, its memory and whether the host shares it."""

    device_type: str
    memory_bytes: int = 0
    unified: bool = False


def machine_of(device: torch.device) -> Machine:
    if device.type != "cuda":
        return Machine(device.type)
    props = torch.cuda.get_device_properties(device)
    unified = bool(getattr(props, "is_integrated", False)) or (props.major, props.minor) in UNIFIED_CAPABILITIES
    return Machine("cuda", int(props.total_memory), unified)


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def choose(asked: str, hot_bytes: int, machine: Machine) -> tuple[str, str]:
    """(policy, why) for the asked policy, the hot footprint's bytes and the device."""
    if asked not in POLICIES:
        from h3direct.errors import ConfigError

        raise ConfigError(f"text encoder policy {asked!r} is not one of {', '.join(POLICIES)}")
    if asked != "auto":
        return asked, "asked"
    if machine.device_type != "cuda":
        return "resident", f"{machine.device_type}: the models are in host memory already"
    need = f"weights {gib(hot_bytes)} + working margin {gib(WORKING_MARGIN)}"
    if hot_bytes + WORKING_MARGIN <= machine.memory_bytes:
        return "resident", f"{need} fit the device's {gib(machine.memory_bytes)}"
    if machine.unified:
        return "unload", (f"{need} exceed the device's {gib(machine.memory_bytes)}, which the host shares (unified "
                          "memory: offloading to the host would free nothing)")
    return "offload", f"{need} exceed the device's {gib(machine.memory_bytes)}"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TextEncoderSlot:
    """The text encoder under a residency policy. `build(device)` makes it from its file on `device`; `move(encoder,
    device)` moves it (a test may put a stand-in there). `where`: device, host or unloaded."""

    def __init__(self, build: Callable | None, policy: str = "resident", device="cpu", *, host="cpu",
                 why: str = "asked", asked: str | None = None):
        if policy not in POLICIES[1:]:
            raise ValueError(f"text encoder policy {policy!r} is not one of {', '.join(POLICIES[1:])}")
        self.build, self.policy, self.why, self.asked = build, policy, why, asked or policy
        self.device, self.host = torch.device(device), torch.device(host)
        self.encoder = None
        self.where = "unloaded"
        self.loads = 0
        self.last_move: dict | None = None  # {"move", "seconds"}
        self._host: HostCopy | None = None  # offload, while the encoder is on the device: its host tensors

    @classmethod
    def holding(cls, encoder, device) -> TextEncoderSlot:
        """A resident slot around an encoder already loaded (None: no text encoder)."""
        slot = cls(None, "resident", device)
        slot.encoder, slot.where = encoder, ("device" if encoder is not None else "unloaded")
        return slot

    @property
    def present(self) -> bool:
        """A text encoder is configured (loaded or not)."""
        return self.build is not None or self.encoder is not None

    def start(self) -> None:
        """At load time: resident on the device, offload in host memory, unload nothing yet."""
        if self.build is not None and self.policy != "unload":
            self._timed("load", lambda: self._load("device" if self.policy == "resident" else "host"))

    def acquire(self) -> str | None:
        """The encoder onto the device for an encode; the move it took (None: it was there, or there is none)."""
        if self.where == "device" or not self.present:
            return None
        if self.where == "host":
            return self._timed("to_device", self._to_device)
        return self._timed("load", lambda: self._load("device"))

    def release(self) -> str | None:
        """After an encode: back to the host (offload) or freed (unload); the move it took."""
        if self.where != "device" or self.policy == "resident":
            return None
        if self.policy == "offload":
            return self._timed("to_host", self._to_host)
        return self._timed("free", self._free)

    def move(self, encoder, device: torch.device) -> None:
        encoder.to(device)  # from page-locked host tensors the copies run at the link's rate

    def view(self) -> dict:
        return {"policy": self.policy, "asked": self.asked, "why": self.why, "where": self.where, "loads": self.loads,
                "last_move": self.last_move}

    # ---- the moves ----
    def _timed(self, name: str, do: Callable[[], None]) -> str:
        t = time.perf_counter()
        do()
        _sync(self.device)
        self.last_move = {"move": name, "seconds": round(time.perf_counter() - t, 4)}
        return name

    def _load(self, where: str) -> None:
        self.encoder = self.build(self.device if where == "device" else self.host)
        if where == "host" and self.device.type == "cuda" and self.host.type == "cpu":
            HostCopy.of(self.encoder.net).pin()
        self.loads += 1
        self.where = where

    def _to_device(self) -> None:
        self._host = HostCopy.of(self.encoder.net)  # kept: after the encode these tensors are the encoder again
        self.move(self.encoder, self.device)
        self.where = "device"

    def _to_host(self) -> None:
        self._host.restore()  # the host tensors back in place: the device copy is dropped, nothing is copied
        self._host = None
        self.where = "host"
        _empty_cache(self.device)

    def _free(self) -> None:
        self.encoder = None
        self.where = "unloaded"
        _empty_cache(self.device)


class HostCopy:
    """A module's parameter and buffer tensors as they are now (`of`), to be put back in place (`restore`) after the
    module was moved: a move gives parameters new data and buffers new tensors, and these are the old ones."""

    def __init__(self, params: list, buffers: list):
        self.params, self.buffers = params, buffers  # [(Parameter, data)], [(owner module, name, tensor)]

    @classmethod
    def of(cls, module: torch.nn.Module) -> HostCopy:
        params, buffers = {}, []  # a parameter two modules share: once
        for m in module.modules():
            params.update({id(p): (p, p.data) for p in m._parameters.values() if p is not None})
            buffers += [(m, name, b) for name, b in m._buffers.items() if b is not None]
        return cls(list(params.values()), buffers)

    def restore(self) -> None:
        for p, data in self.params:
            p.data = data
        for m, name, b in self.buffers:
            m._buffers[name] = b

    def pin(self) -> None:
        """Each tensor into page-locked memory, in place (a buffer two modules share stays one tensor)."""
        pinned: dict[int, torch.Tensor] = {}

        def locked(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in pinned:
                pinned[id(t)] = t if t.is_pinned() else t.pin_memory()
            return pinned[id(t)]

        self.params = [(p, locked(data)) for p, data in self.params]
        self.buffers = [(m, name, locked(b)) for m, name, b in self.buffers]
        self.restore()


def _empty_cache(device: torch.device) -> None:
    """The device memory the encoder held goes back to the driver (on unified memory: to the whole machine)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
