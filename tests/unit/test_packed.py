"""A GGUF's packed weights as the CPU holds them (models/layers/packed.py): the file's Q4 integers and
scales held as they are, and a block packed whole or not at all. (What the block linears compute
with them: tests/unit/test_cpu_blocks.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ballast.models.arch.llama import q4_blocks
from ballast.models.layers.packed import q4_weight, q8_weight
from ballast.models.weights.gguf_quants import dequantize
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from ggufdata import random_blocks


def _packed(qtype: QT, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    return random_blocks(qtype, n * k // block, rng).reshape(n, k // block * size)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1])
def test_q4_weight_holds_the_files_values(qtype: QT) -> None:
    rows = _packed(qtype, 64, 256)
    w = q4_weight(rows, qtype, (64, 256))
    assert w.qs.dtype == torch.uint8 and w.qs.shape == (64, 128)  # the file's nibbles, still packed
    expected = dequantize(rows.reshape(-1), qtype).reshape(64, 256)
    assert torch.equal(w.dequantize(), expected)


def test_q8_weight_holds_the_files_values() -> None:
    rows = _packed(QT.Q8_0, 16, 64, seed=1)
    w = q8_weight(rows, (16, 64))
    expected = dequantize(rows.reshape(-1), QT.Q8_0).reshape(16, 64)
    assert torch.equal(w.q.float() * w.scale.repeat_interleave(32, dim=1), expected)


def test_a_block_is_packed_whole_or_not_at_all() -> None:
    full = {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    mlp = {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")}  # no down: not 4-bit
    assert [(i, b) for i, b, _ in q4_blocks(full | mlp, set())] == [(0, "self_attn")]
    biased = {"model.layers.0.self_attn.q_proj.bias"}
    assert q4_blocks(full, biased) == []
