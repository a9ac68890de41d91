"""GGUF dequantization against gguf-py's reference, and the q/k row order that undoes
llama.cpp's converter permutation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ballast.models.weights.gguf_loader import qk_row_order
from ballast.models.weights.gguf_quants import dequantize
from ballast.models.weights.gguf_reader import GGUFUnsupportedError
from gguf import GGMLQuantizationType as QT
from gguf import quants
from ggufdata import BLOCK_TYPES, hf_to_gguf_permute, random_blocks


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda q: q.name)
def test_block_dequant_matches_gguf_reference(qtype: QT) -> None:
    blocks = random_blocks(qtype, 300, np.random.default_rng(int(qtype)))
    ours = dequantize(blocks.reshape(-1), qtype).numpy()
    ref = quants.dequantize(blocks, qtype).reshape(-1)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda q: q.name)
def test_float_dequant_matches_gguf_reference(qtype: QT) -> None:
    values = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    raw = {QT.F32: values, QT.F16: values.astype(np.float16)}.get(qtype)
    data = quants.quantize(values, QT.BF16) if raw is None else raw
    ours = dequantize(data.view(np.uint8).reshape(-1), qtype).numpy()
    np.testing.assert_array_equal(ours, quants.dequantize(data.view(np.uint8), qtype).reshape(-1))


def test_dequant_to_bfloat16_is_the_float32_result_rounded() -> None:
    blocks = random_blocks(QT.Q4_K, 8, np.random.default_rng(1)).reshape(-1)
    as_bf16 = dequantize(blocks, QT.Q4_K, torch.bfloat16)
    assert as_bf16.dtype == torch.bfloat16
    assert torch.equal(as_bf16, dequantize(blocks, QT.Q4_K).to(torch.bfloat16))


def test_unsupported_quant_type_is_a_typed_error() -> None:
    with pytest.raises(GGUFUnsupportedError, match="Q5_K"):
        dequantize(np.zeros(176, np.uint8), QT.Q5_K)


@pytest.mark.parametrize("n_head", [1, 3, 8])
def test_qk_row_order_undoes_the_converter_permutation(n_head: int) -> None:
    w = np.random.default_rng(n_head).standard_normal((n_head * 16, 5))
    assert np.array_equal(hf_to_gguf_permute(w, n_head)[qk_row_order(w.shape[0], n_head)], w)
    bias = np.arange(n_head * 16)
    assert np.array_equal(hf_to_gguf_permute(bias, n_head)[qk_row_order(bias.shape[0], n_head)], bias)
