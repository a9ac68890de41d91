"""Dequantize GGUF tensor data (block layouts: ggml-common.h block_* structs).

Not `gguf.quants.dequantize`, which alone takes ~2 s on the default model: numpy, one thread, in
cache-sized chunks through reused scratch buffers. With free-page reporting (VMs) the first touch of
fresh memory costs ~10 us a page, more than the arithmetic, and torch's OpenMP wake-ups cost more
than these element-wise ops on 2 cores; so each tensor's output is the only new memory it touches.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
from ballast.models.weights.gguf_reader import GGUFUnsupportedError
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

_CHUNK_VALUES = 1 << 16  # per dequant step: 256 KiB of float32, cache-sized


class Scratch:
    """Named uint8 buffers that grow to the largest tensor and are reused for every other."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < n:
            buf = self._bufs[key] = np.empty(n, np.uint8)
        return buf[:n].view(dtype).reshape(shape)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """One fp16 field per block as a float32 column (nb, 1)."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles_into(qs: np.ndarray, dst: np.ndarray) -> None:
    """(..., k) bytes -> dst (..., 2k): the k low nibbles, then the k high ones (ggml's order)."""
    k = qs.shape[-1]
    np.bitwise_and(qs, 0xF, out=dst[..., :k])
    np.right_shift(qs, 4, out=dst[..., k:])


def _q8_0(b: np.ndarray, out: np.ndarray, s: Scratch) -> None:
    np.copyto(out, b[:, 2:].view(np.int8))
    out *= _f16(b, 0)


def _q4_0(b: np.ndarray, out: np.ndarray, s: Scratch) -> None:
    q = s.get("q", out.shape, np.uint8)
    _nibbles_into(b[:, 2:], q)
    np.copyto(out, q)
    out -= 8.0
    out *= _f16(b, 0)


def _q4_1(b: np.ndarray, out: np.ndarray, s: Scratch) -> None:
    q = s.get("q", out.shape, np.uint8)
    _nibbles_into(b[:, 4:], q)
    np.copyto(out, q)
    out *= _f16(b, 0)
    out += _f16(b, 2)


def _q4_k(b: np.ndarray, out: np.ndarray, s: Scratch) -> None:
    # 8 sub-blocks of 32 with a 6-bit scale and min each, packed in 12 bytes (get_scale_min_k4)
    nb = b.shape[0]
    q = s.get("q", (nb, 4, 64), np.uint8)
    _nibbles_into(b[:, 16:].reshape(nb, 4, 32), q)
    np.copyto(out, q.reshape(nb, 256))
    sc = b[:, 4:16]
    scale = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)
    minimum = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    sub = out.reshape(nb, 8, 32)
    sub *= (_f16(b, 0) * scale)[:, :, None]
    sub -= (_f16(b, 2) * minimum)[:, :, None]


def _q6_k(b: np.ndarray, out: np.ndarray, s: Scratch) -> None:
    # two halves of 128 values, each 4 groups of 32: low 4 bits from ql (low nibbles of its two
    # 32-byte rows, then high nibbles), high 2 bits from qh at shift 2*group; an int8 scale per 16
    nb = b.shape[0]
    q = s.get("q", (nb, 2, 4, 32), np.uint8)
    ql = b[:, :128].reshape(nb, 2, 2, 32)
    np.bitwise_and(ql, 0xF, out=q[:, :, 0:2])
    np.right_shift(ql, 4, out=q[:, :, 2:4])
    qh = b[:, 128:192].reshape(nb, 2, 32)
    t = s.get("t", (nb, 2, 32), np.uint8)
    for group in range(4):
        np.right_shift(qh, 2 * group, out=t)
        np.bitwise_and(t, 3, out=t)
        np.left_shift(t, 4, out=t)
        np.bitwise_or(q[:, :, group], t, out=q[:, :, group])
    np.copyto(out, q.reshape(nb, 256))
    out -= 32.0
    out.reshape(nb, 16, 16)[...] *= (_f16(b, 208) * b[:, 192:208].view(np.int8))[:, :, None]


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray, Scratch], None]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
# numpy has no bfloat16: BF16 is read as int16 and reinterpreted by torch
_FLOAT_VIEWS: dict[GGMLQuantizationType, tuple[type[np.generic], torch.dtype | None]] = {
    GGMLQuantizationType.F32: (np.float32, None),
    GGMLQuantizationType.F16: (np.float16, None),
    GGMLQuantizationType.BF16: (np.int16, torch.bfloat16),
}
SUPPORTED_TYPES = tuple(t.name for t in (*_FLOAT_VIEWS, *_BLOCK_DEQUANT))


def dequantize(
    raw: np.ndarray,
    qtype: GGMLQuantizationType,
    dtype: torch.dtype = torch.float32,
    scratch: Scratch | None = None,
) -> Tensor:
    """Flat uint8 bytes of one tensor -> flat values in dtype, always in new memory."""
    if qtype in _FLOAT_VIEWS:
        np_type, reinterpret = _FLOAT_VIEWS[qtype]
        values = torch.from_numpy(raw.view(np_type))
        return (values if reinterpret is None else values.view(reinterpret)).to(dtype, copy=True)
    fn = _BLOCK_DEQUANT.get(qtype)
    if fn is None:
        raise GGUFUnsupportedError(
            f"ggml type {qtype.name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})"
        )
    scratch = scratch or Scratch()
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, block_bytes)
    shape = (blocks.shape[0], block)
    # float32 straight into the result; another dtype goes through a float32 scratch
    out = np.empty(shape, np.float32) if dtype == torch.float32 else scratch.get("f32", shape, np.float32)
    # in chunks that stay in cache: each value reaches main memory once, not once per pass
    step = max(1, _CHUNK_VALUES // block)
    for i in range(0, shape[0], step):
        fn(blocks[i : i + step], out[i : i + step], scratch)
    result = torch.from_numpy(out.reshape(-1))
    return result if dtype == torch.float32 else result.to(dtype)
