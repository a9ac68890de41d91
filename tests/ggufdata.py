"""Shared GGUF test data: random valid quant blocks and llama.cpp's q/k row permutation.
Import as `from ggufdata import ...` (tests/ is on sys.path via conftest.py)."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

# byte offsets of the fp16 scale/min fields in each block layout (ggml-common.h)
F16_FIELDS = {QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q4_K: (0, 2), QT.Q6_K: (208,)}
BLOCK_TYPES = tuple(F16_FIELDS)


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random but valid blocks: random quant bits, finite positive fp16 scales."""
    blocks = rng.integers(0, 256, size=(n_blocks, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scale = rng.uniform(1e-3, 2e-2, size=n_blocks).astype(np.float16)
        blocks[:, at : at + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return blocks


def hf_to_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (its `permute`), written from its
    description: each head's two rotate-half halves become interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
