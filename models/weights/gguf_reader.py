"""Parse a GGUF file (llama.cpp's format): header, metadata and tensor table; the tensor data stays
mapped and untouched.

Not `gguf.GGUFReader`: its numpy memmap object per metadata item costs ~4 s for the default model's
98k-entry vocabulary and merges, past our whole 3 s load budget. We parse with struct over an mmap
and keep `gguf` for its enums and block sizes, and as the reference our tests compare against.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

_MAGIC = b"GGUF"
_U64 = struct.Struct("<Q")
_DEFAULT_ALIGNMENT = 32
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}  # fmt: skip


class GGUFError(ValueError):
    """The file is not a GGUF we can read (bad magic, truncated, unknown value type)."""


class GGUFUnsupportedError(GGUFError):
    """A well-formed GGUF that uses something we do not map (architecture, tensor, quant type)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (outermost first): GGUF lists dims innermost first
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data: np.ndarray  # the whole file as uint8, mapped, never copied

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return self.data[info.offset : info.offset + info.nbytes]


class _Cursor:
    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf = buf
        self.pos = pos

    def scalars(self, fmt: str, count: int = 1) -> tuple[Any, ...]:
        """count little-endian values of one struct format character."""
        size = struct.calcsize(f"<{count}{fmt}")
        if self.pos + size > len(self.buf):
            raise GGUFError(f"truncated GGUF: needed {size} bytes at offset {self.pos}")
        values = struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos)
        self.pos += size
        return values

    def scalar(self, fmt: str) -> Any:
        return self.scalars(fmt)[0]

    def strings(self, count: int) -> list[str]:
        # the vocabulary and merges: ~100k strings, so a tight loop with everything local
        buf, pos, size, read_len = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        try:
            for _ in range(count):
                (length,) = read_len(buf, pos)
                pos += 8
                if pos + length > size:
                    raise GGUFError(f"truncated GGUF: string of {length} bytes at offset {pos}")
                out.append(buf[pos : pos + length].decode("utf-8"))
                pos += length
        except (struct.error, UnicodeDecodeError) as exc:
            raise GGUFError(f"bad GGUF string array at offset {pos}: {exc}") from exc
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.strings(1)[0]
        if vtype == GGUFValueType.ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            if item_type in _SCALAR_FORMATS:
                return list(self.scalars(_SCALAR_FORMATS[GGUFValueType(item_type)], count))
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise GGUFError(f"unknown GGUF value type {vtype} at offset {self.pos}")
        return self.scalar(_SCALAR_FORMATS[GGUFValueType(vtype)])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse header, metadata and tensor table; the tensor data stays mapped, untouched."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
        # ACCESS_COPY: a private mapping looks writable, so torch.from_numpy takes views of it
        # without a read-only warning; nothing ever writes to it.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    cur = _Cursor(buf, len(_MAGIC))
    version = cur.scalar("I")
    if version not in (2, 3):
        raise GGUFUnsupportedError(f"{path}: GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.scalars("Q", 2)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.strings(1)[0]
        metadata[key] = cur.value(cur.scalar("I"))
    table = []
    for _ in range(n_tensors):
        name = cur.strings(1)[0]
        dims = cur.scalars("Q", cur.scalar("I"))
        type_id, offset = cur.scalar("I"), cur.scalar("Q")
        table.append((name, dims, type_id, offset))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in table:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError as exc:
            raise GGUFUnsupportedError(f"{path}: tensor {name} has unknown ggml type {type_id}") from exc
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {name} row of {dims[0]} is not whole {qtype.name} blocks")
        nbytes = math.prod(dims) // block * block_bytes
        start = data_start + offset
        if start + nbytes > len(buf):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file")
        tensors[name] = GGUFTensorInfo(name, qtype, tuple(reversed(dims)), start, nbytes)
    return GGUFFile(path, metadata, tensors, np.frombuffer(buf, dtype=np.uint8))
