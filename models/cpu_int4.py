"""Weight-only quantized linears for the CPU: a GGUF's 4-bit linears kept 4-bit, the output head
8-bit, run by torch's own CPU kernels (`_weight_int4pack_mm_for_cpu`, `_weight_int8pack_mm`): a CPU
decode step is its weight read (the default model in float32: 538 MB a token; bench/cpu_decode.py).

Q4_0 / Q4_1 blocks are 32 weights along the input with one scale (and, Q4_1, a minimum): exactly
the int4 kernel's groups with a scale and a zero point, `w = (q - 8) * scale + zero`, so the 4-bit
integers are the file's own and only scale and zero are rounded (to bfloat16). The tied embedding
(Q8_0) becomes an int8 head with one scale per vocabulary row. Both kernels are vectorised only for
bfloat16 inputs (float32 takes a scalar loop ~25x slower), so each linear rounds its input to
bfloat16 and widens its output back; norms, rope, attention and the residual stream stay float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import Tensor, nn

GROUP = 32  # a Q4_0 / Q4_1 block: the int4 kernel's group size
# The weight-only kernels dequantize per row of input, so steps of more rows than this read a
# bfloat16 copy of the same values through oneDNN's AVX512-BF16 GEMM instead (1 thread, 3072x576:
# int4 0.34 ms at 1 row, 1.0 ms at 8, 90 ms at 512; bfloat16 dense 36 ms at 512).
INT4_MAX_ROWS = 2
# The packing's inner tile over K (the only value torch's CPU packing takes).
_INNER_K_TILES = 2
_Q4_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
Q4_TYPES = tuple(_Q4_BLOCK_BYTES)


def kernels_available() -> bool:
    """Whether this torch build has both CPU kernels."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_weight_int8pack_mm"
    )


@dataclass(frozen=True)
class Q4Weight:
    """One [N, K] weight as 4-bit integers: value = q * scale + minimum, per group of 32 along K.
    The integers stay packed as the file has them (`qs`: block b of a row at bytes 16 b .. 16 b + 15,
    weight j < 16 the low nibble of byte j, weight 16 + j its high nibble)."""

    qs: Tensor  # [N, K / 2] uint8
    scale: Tensor  # [N, K / 32] float32
    minimum: Tensor  # [N, K / 32] float32

    @property
    def q(self) -> Tensor:
        """[N, K] int32, 0..15."""
        n = self.qs.shape[0]
        blocks = self.qs.view(n, -1, GROUP // 2)
        return torch.cat((blocks & 0xF, blocks >> 4), dim=-1).reshape(n, -1).to(torch.int32)

    def dequantize(self) -> Tensor:
        """[N, K] float32: the values the dense path computes with."""
        scale = self.scale.repeat_interleave(GROUP, dim=1)
        return self.q.float() * scale + self.minimum.repeat_interleave(GROUP, dim=1)


def q4_weight(rows: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> Q4Weight:
    """A Q4_0 / Q4_1 tensor's packed bytes, [N, row bytes], as a Q4Weight. A block is an fp16
    scale (Q4_1: then an fp16 minimum) and 16 bytes of nibbles. Q4_0 is symmetric: value =
    (q - 8) * scale."""
    n, k = shape
    block = _Q4_BLOCK_BYTES[qtype]
    blocks = np.ascontiguousarray(rows).reshape(n, k // GROUP, block)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_1:
        minimum = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    else:
        minimum = -8.0 * scale
    qs = np.ascontiguousarray(blocks[..., block - 16 :]).reshape(n, k // 2)
    return Q4Weight(torch.from_numpy(qs), torch.from_numpy(scale), torch.from_numpy(minimum))


@dataclass(frozen=True)
class Q8Weight:
    """One [N, K] Q8_0 weight as the file has it: value = q * scale, per group of 32 along K."""

    q: Tensor  # [N, K] int8
    scale: Tensor  # [N, K / 32] float32

    def dequantize(self) -> Tensor:
        return self.q.float() * self.scale.repeat_interleave(GROUP, dim=1)


def q8_weight(rows: np.ndarray, shape: tuple[int, ...]) -> Q8Weight:
    """A Q8_0 tensor's packed bytes, [N, row bytes] (a block: an fp16 scale, then 32 int8)."""
    n, k = shape
    blocks = np.ascontiguousarray(rows).reshape(n, k // GROUP, 2 + GROUP)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return Q8Weight(torch.from_numpy(q), torch.from_numpy(scale))


class Int4Linear(nn.Module):
    """y = x W^T for W held as packed int4 with bfloat16 group scales and zero points. Built from
    one or more Q4Weights stacked along N (q/k/v, or gate/up: one matmul, as `FusedLinears`)."""

    def __init__(self, parts: Sequence[Q4Weight]) -> None:
        super().__init__()
        q = torch.cat([p.q for p in parts])
        scale = torch.cat([p.scale for p in parts])
        minimum = torch.cat([p.minimum for p in parts])
        self.out_features = int(q.shape[0])
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES))
        # The kernel's zero point is the value at q = 8: zero = minimum + 8 * scale.
        scales_zeros = torch.stack((scale, minimum + 8 * scale), dim=-1)  # [N, K/32, 2]
        self.register_buffer("scales_zeros", scales_zeros.transpose(0, 1).contiguous().bfloat16())
        self.wide: Tensor
        self.register_buffer("wide", torch.cat([p.dequantize() for p in parts]).bfloat16())
        # Steps of more than this many rows keep the bfloat16 output (the q/k/v projection under
        # --cpu-prefill bfloat16: its attention then runs in bfloat16); 0 = always widened.
        self.bf16_out_rows = 0

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if flat.shape[0] > INT4_MAX_ROWS:
            y = F.linear(flat, self.wide)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scales_zeros)
        if not 0 < self.bf16_out_rows < flat.shape[0]:
            y = y.to(x.dtype)
        return y.view(*shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """y = x W^T for W held as int8 with one bfloat16 scale per output row (absmax / 127)."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny)
        self.out_features = int(w.shape[0])
        self.register_buffer("q", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.bfloat16())
        self.wide: Tensor
        self.register_buffer("wide", w.bfloat16())

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if flat.shape[0] > INT4_MAX_ROWS:
            y = F.linear(flat, self.wide)
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        return y.to(x.dtype).view(*shape[:-1], self.out_features)


class QuantizedPair(nn.Module):
    """A block's two matmuls held quantized: `first` reads the block's input (q/k/v, or gate/up,
    stacked), `second` makes its output (o, or down)."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first = first
        self.second = second


def drop_dense(*linears: nn.Linear) -> None:
    """Empty the dense weights a quantized pair replaces, so the quantized form is the only copy
    held (the memory layer counts parameters and buffers)."""
    for lin in linears:
        lin.weight = nn.Parameter(torch.empty(0), requires_grad=False)
