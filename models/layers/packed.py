"""A GGUF's packed weights as the CPU holds them (models/layers/cpu_blocks.py multiplies them): Q4_0 /
Q4_1 / Q8_0 blocks of 32 weights along the input, each with its scale (and Q4_1 its minimum), and
the pair of block linears an attention or MLP block runs through once they replace its dense ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import Tensor, nn

GROUP = 32  # weights of a block, along the input
_Q4_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}
Q4_TYPES = tuple(_Q4_BLOCK_BYTES)


@dataclass(frozen=True)
class Q4Weight:
    """One [N, K] weight as 4-bit integers: value = q * scale + minimum, per group of 32 along K.
    The integers stay packed as the file has them (`qs`: block b of a row at bytes 16 b .. 16 b + 15,
    weight j < 16 the low nibble of byte j, weight 16 + j its high nibble)."""

    qs: Tensor  # [N, K / 2] uint8
    scale: Tensor  # [N, K / 32] float32
    minimum: Tensor  # [N, K / 32] float32

    def dequantize(self) -> Tensor:
        """[N, K] float32: the values the dense path computes with."""
        n = self.qs.shape[0]
        blocks = self.qs.view(n, -1, GROUP // 2)
        q = torch.cat((blocks & 0xF, blocks >> 4), dim=-1).reshape(n, -1).float()
        return q * self.scale.repeat_interleave(GROUP, dim=1) + self.minimum.repeat_interleave(GROUP, dim=1)


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


def q8_weight(rows: np.ndarray, shape: tuple[int, ...]) -> Q8Weight:
    """A Q8_0 tensor's packed bytes, [N, row bytes] (a block: an fp16 scale, then 32 int8)."""
    n, k = shape
    blocks = np.ascontiguousarray(rows).reshape(n, k // GROUP, 2 + GROUP)
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, k)
    return Q8Weight(torch.from_numpy(q), torch.from_numpy(scale))


class QuantizedPair(nn.Module):
    """A block's two matmuls held packed: `first` reads the block's input (q/k/v, or gate/up,
    stacked), `second` makes its output (o, or down)."""

    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.first = first
        self.second = second


def drop_dense(*linears: nn.Linear) -> None:
    """Empty the dense weights a packed pair replaces, so the packed form is the only copy
    held (the memory layer counts parameters and buffers)."""
    for lin in linears:
        lin.weight = nn.Parameter(torch.empty(0), requires_grad=False)
