"""The CPU's weight-only int4 / int8 linears (models/cpu_int4.py): the file's Q4 integers held as
they are, the kernels against the dense matmul they replace, and a GGUF load that keeps whole
4-bit blocks int4 and every other tensor dense. (The default model against transformers:
tests/integration/test_engine_parity.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.loading import load
from ballast.models.base import ForwardBatch
from ballast.models.cpu_int4 import Int4Linear, Int8Linear, kernels_available, q4_weight
from ballast.models.gguf_quants import dequantize
from ballast.models.llama import LlamaForCausalLM, int4_blocks
from ballast.models.state import allocate_states
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from ggufdata import random_blocks
from test_gguf_loader import MIXED_Q4_LAYERS, write_tiny_llama

from ballast.settings import ConfigError

pytestmark = pytest.mark.skipif(not kernels_available(), reason="torch lacks the int4/int8 CPU kernels")


def _q4(qtype: QT, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    return random_blocks(qtype, n * k // block, rng).reshape(n, k // block * size)


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1])
def test_q4_weight_holds_the_files_values(qtype: QT) -> None:
    rows = _q4(qtype, 64, 256)
    w = q4_weight(rows, qtype, (64, 256))
    assert int(w.q.min()) >= 0 and int(w.q.max()) <= 15
    expected = dequantize(rows.reshape(-1), qtype).reshape(64, 256)
    assert torch.equal(w.dequantize(), expected)


@pytest.mark.parametrize("rows", [1, 7, 64])
def test_int4_linear_matches_the_dense_matmul(rows: int) -> None:
    parts = [q4_weight(_q4(QT.Q4_1, n, 256, seed), QT.Q4_1, (n, 256)) for seed, n in enumerate((96, 32))]
    dense = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    got = Int4Linear(parts)(x)
    want = x @ dense.t()
    assert got.dtype == torch.float32 and got.shape == (rows, 128)
    # bfloat16 input, scales and zero points: a few parts in a thousand of the output's scale
    assert float((got - want).abs().max()) < 1e-2 * float(want.abs().max())


def test_int8_linear_matches_the_dense_matmul() -> None:
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(300, 128, generator=gen), torch.randn(3, 128, generator=gen)
    got, want = Int8Linear(w)(x), x @ w.t()
    assert float((got - want).abs().max()) < 2e-2 * float(want.abs().max())


def test_a_block_is_int4_whole_or_not_at_all() -> None:
    full = {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"}
    mlp = {f"model.layers.0.mlp.{p}_proj.weight" for p in ("gate", "up")}  # no down: not 4-bit
    assert [(i, b) for i, b, _ in int4_blocks(full | mlp, set())] == [(0, "self_attn")]
    biased = {"model.layers.0.self_attn.q_proj.bias"}
    assert int4_blocks(full, biased) == []


def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    lm = model
    assert isinstance(lm, LlamaForCausalLM)
    states = allocate_states(lm.layer_specs(4), 1, 64, "cpu", torch.float32)
    with torch.inference_mode():
        first = lm(ForwardBatch.build([(0, tokens, 0)], torch.device("cpu")), states)
        step = lm(ForwardBatch.build([(0, [5], len(tokens))], torch.device("cpu")), states)
    return torch.cat((first, step))


def test_gguf_load_keeps_whole_q4_blocks_int4_and_the_rest_dense(tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "q4.gguf", layer_types=MIXED_Q4_LAYERS)
    dense = load(
        EngineConfig(model=str(tiny.path), device="cpu", cpu_weights="dense"),
        torch.device("cpu"),
        torch.float32,
    )
    int4 = load(
        EngineConfig(model=str(tiny.path), device="cpu", cpu_weights="int4"),
        torch.device("cpu"),
        torch.float32,
    )
    m = int4.model
    assert isinstance(m, LlamaForCausalLM)
    held = [
        (i, layer.self_attn.quantized is not None, layer.mlp.quantized is not None)
        for i, layer in enumerate(m.model.layers)
    ]
    assert held == [(0, True, True), (1, False, True)]
    # the dense block kept the file's values (never the uninitialised placeholders of skipped tensors)
    attn1 = m.model.layers[1].self_attn
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        want = torch.from_numpy(tiny.expected[f"model.layers.1.self_attn.{proj}.weight"])
        assert torch.equal(getattr(attn1, proj).weight, want), proj
    assert int4.weights_bytes < dense.weights_bytes
    ours, ref = _logits(m, [3, 17, 42, 99, 7]), _logits(dense.model, [3, 17, 42, 99, 7])
    assert float((ours - ref).abs().max()) < 0.05 * float(ref.abs().max())


def test_int4_weights_demand_a_float32_cpu_engine() -> None:
    with pytest.raises(ConfigError, match="cpu-weights"):
        EngineConfig(device="cpu", dtype="bfloat16", cpu_weights="int4").cpu_int4(torch.device("cpu"))
    assert not EngineConfig(device="cpu", cpu_weights="dense").cpu_int4(torch.device("cpu"))
    assert EngineConfig(device="cpu", cpu_weights="int4").cpu_int4(torch.device("cpu"))
    assert not EngineConfig(device="cpu", cpu_weights="auto").cpu_int4(torch.device("cpu"))  # opt-in
    assert not EngineConfig(device="cpu").cpu_int4(torch.device("cpu"))
