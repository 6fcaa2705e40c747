"""Strict, payload-free reader for safetensors headers.

A safetensors file is ``[u64 little-endian header length N][N bytes UTF-8 JSON][data]``. The JSON maps
tensor names to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the data
section) plus an optional ``"__metadata__"`` object of str -> str.

Public API (reused by `h3direct inspect`, the strict DiT loader and other tools):

- :func:`read_header` ``(path) -> Header`` reads only the 8-byte length and the JSON header (the file
  size comes from ``os.stat``), parses it and, by default, :func:`validate` s it.
- :func:`validate` ``(header)`` checks every tensor against the dtype table and the file size: known
  dtype, ``begin <= end``, ``dtype x shape`` = byte span, tensors contiguous from byte 0 with no gap or
  overlap, and the last tensor ending exactly at the end of the file.
- :func:`read_tensor_bytes` ``(header, name, limit=...)`` is a bounded ``seek`` + ``read`` of one small
  tensor (quantization markers, scalar scales); it refuses anything larger than ``limit``.

Every problem raises :class:`h3direct.errors.CheckpointError` with one line naming the file and the
offending tensor / field / value.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from h3direct.errors import CheckpointError

# safetensors' own upper bound on the JSON header (the Rust crate refuses larger headers)
MAX_HEADER_BYTES = 100_000_000
# default cap for read_tensor_bytes: small companions only, never a weight payload
SMALL_TENSOR_LIMIT = 64 * 1024

# safetensors dtype string -> bits per element (the format's full dtype list, sub-byte ones included)
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

# the torch dtype name of each safetensors dtype string (for reports; no torch import needed)
TORCH_DTYPE_NAMES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16",
    "I32": "int32", "U32": "uint32", "F32": "float32",
    "I64": "int64", "U64": "uint64", "F64": "float64", "C64": "complex64",
    "F4": "float4_e2m1fn_x2", "F6_E2M3": "float6_e2m3", "F6_E3M2": "float6_e3m2",
}


@dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``data_offsets`` are relative to the data section, ``offset`` is absolute."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    offset: int

    @property
    def nbytes(self) -> int:
        return self.data_offsets[1] - self.data_offsets[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def expected_nbytes(self) -> int | None:
        """``numel x dtype size`` in bytes; None for an unknown dtype or a sub-byte count that is not whole."""
        bits = DTYPE_BITS.get(self.dtype)
        if bits is None or (self.numel * bits) % 8:
            return None
        return self.numel * bits // 8


@dataclass(frozen=True)
class Header:
    """The parsed header of one safetensors file (tensors in header order)."""

    path: Path
    file_size: int
    header_len: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str] | None

    @property
    def data_start(self) -> int:
        return 8 + self.header_len

    @property
    def data_size(self) -> int:
        return self.file_size - self.data_start

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {n: t.shape for n, t in self.tensors.items()}


def _open(path: Path) -> io.BufferedReader:
    """The one place this module opens a file (tests wrap it to count the bytes read)."""
    return open(path, "rb")


def _fail(path, msg: str) -> CheckpointError:
    return CheckpointError(msg, path=path)


def _no_duplicates(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_entry(path, name: str, entry, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _fail(path, f"tensor {name!r}: header entry is {type(entry).__name__}, expected an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise _fail(path, f"tensor {name!r}: header entry lacks {', '.join(missing)}")
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise _fail(path, f"tensor {name!r}: dtype {dtype!r} is not a string")
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise _fail(path, f"tensor {name!r}: shape {shape!r} is not a list of integers")
    if any(d < 0 for d in shape):
        raise _fail(path, f"tensor {name!r}: negative dimension in shape {shape}")
    if not isinstance(offs, list) or len(offs) != 2 or not all(_is_int(o) for o in offs):
        raise _fail(path, f"tensor {name!r}: data_offsets {offs!r} is not a pair of integers")
    if offs[0] < 0 or offs[1] < 0:
        raise _fail(path, f"tensor {name!r}: negative data_offsets {offs}")
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), data_offsets=(offs[0], offs[1]),
                      offset=data_start + offs[0])


def read_header(path: str | os.PathLike, *, check: bool = True) -> Header:
    """Read and parse the header of the safetensors file ``path`` without touching its payload.

    Reads exactly ``8 + header_len`` bytes; the file size comes from ``os.stat``. With ``check`` (the
    default) the result is also passed through :func:`validate`. Raises ``CheckpointError`` (one line
    naming the file) for a missing file, a header length past EOF, invalid UTF-8 / JSON, a malformed
    entry or ``__metadata__`` that is not str -> str.
    """
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except OSError as exc:
        raise _fail(path, f"cannot stat: {exc.strerror}") from None
    if not os.path.isfile(path):
        raise _fail(path, "not a regular file")
    size = st.st_size
    if size < 8:
        raise _fail(path, f"file is {size} bytes, too short for the 8-byte safetensors header length")
    try:
        with _open(path) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise _fail(path, f"header length {n} exceeds the safetensors limit of {MAX_HEADER_BYTES} bytes "
                                  f"(file size {size}): not a safetensors file?")
            if 8 + n > size:
                raise _fail(path, f"header length {n} runs past the end of the file (size {size}): "
                                  "truncated or not a safetensors file")
            raw = f.read(n)
    except OSError as exc:
        raise _fail(path, f"cannot read: {exc.strerror}") from None
    if len(raw) != n:
        raise _fail(path, f"short read: header length {n}, got {len(raw)} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _fail(path, f"header is not valid UTF-8 (byte {exc.start} of the header)") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise _fail(path, f"header is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except ValueError as exc:  # duplicate key
        raise _fail(path, f"header is not valid: {exc}") from None
    if not isinstance(obj, dict):
        raise _fail(path, f"header JSON is a {type(obj).__name__}, expected an object")

    metadata = obj.pop("__metadata__", None)
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise _fail(path, f"__metadata__ is a {type(metadata).__name__}, expected an object of str -> str")
        for k, v in metadata.items():
            if not isinstance(v, str):
                raise _fail(path, f"__metadata__[{k!r}] is a {type(v).__name__}, safetensors requires str -> str")
    tensors = {name: _parse_entry(path, name, entry, 8 + n) for name, entry in obj.items()}
    header = Header(path=path, file_size=size, header_len=n, tensors=tensors, metadata=metadata)
    if check:
        validate(header)
    return header


def validate(header: Header) -> None:
    """Check the tensor table of ``header`` against the dtype table and the file size.

    Raises ``CheckpointError`` naming the file and the first offending tensor for: an unknown dtype,
    ``data_offsets`` with end before begin, a byte span that differs from ``numel x dtype size``, a
    gap or overlap between tensors (the data section must be tiled contiguously from byte 0), a tensor
    past the end of the file (truncated payload) or trailing bytes after the last tensor.
    """
    path = header.path
    for t in header.tensors.values():
        if t.dtype not in DTYPE_BITS:
            raise _fail(path, f"tensor {t.name!r}: unknown dtype {t.dtype!r} "
                              f"(safetensors knows {', '.join(sorted(DTYPE_BITS))})")
        b, e = t.data_offsets
        if e < b:
            raise _fail(path, f"tensor {t.name!r}: data_offsets [{b}, {e}] out of order (end before begin)")
        want = t.expected_nbytes
        if want is None:
            raise _fail(path, f"tensor {t.name!r}: {t.numel} elements of {t.dtype} is not a whole number of bytes")
        if want != t.nbytes:
            raise _fail(path, f"tensor {t.name!r}: dtype {t.dtype} x shape {list(t.shape)} = {want} bytes "
                              f"but data_offsets [{b}, {e}] span {t.nbytes}")
    prev_end, prev_name = 0, None
    for t in sorted(header.tensors.values(), key=lambda t: t.data_offsets):
        b, e = t.data_offsets
        if b < prev_end:
            raise _fail(path, f"tensor {t.name!r}: data_offsets [{b}, {e}] overlap tensor {prev_name!r} "
                              f"(which ends at {prev_end})")
        if b > prev_end:
            where = f"after tensor {prev_name!r}" if prev_name else "at the start of the data section"
            raise _fail(path, f"tensor {t.name!r}: gap of {b - prev_end} bytes {where} (data_offsets [{b}, {e}])")
        prev_end, prev_name = e, t.name
    if prev_end > header.data_size:
        raise _fail(path, f"truncated payload: tensors need {prev_end} data bytes (file size "
                          f"{header.data_start + prev_end}) but the file has {header.data_size} "
                          f"(size {header.file_size}); tensor {prev_name!r} runs past the end")
    if prev_end < header.data_size:
        raise _fail(path, f"{header.data_size - prev_end} trailing bytes after the last tensor "
                          f"(tensors end at data byte {prev_end}, file has {header.data_size})")


def read_tensor_bytes(header: Header, name: str, *, limit: int = SMALL_TENSOR_LIMIT) -> bytes:
    """Bounded ``seek`` + ``read`` of one small tensor's raw bytes (markers, scalar or small scales).

    Refuses (``CheckpointError``) tensors larger than ``limit`` bytes, so a caller can never pull a
    weight payload through this path by mistake.
    """
    t = header.tensors[name]
    if t.nbytes > limit:
        raise _fail(header.path, f"tensor {name!r} is {t.nbytes} bytes, above the {limit}-byte small-read limit")
    with _open(header.path) as f:
        f.seek(t.offset)
        data = f.read(t.nbytes)
    if len(data) != t.nbytes:
        raise _fail(header.path, f"tensor {name!r}: short read ({len(data)} of {t.nbytes} bytes)")
    return data
