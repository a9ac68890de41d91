"""The CPU's block linears (models/layers/cpu_blocks.py, --cpu-weights blocks, the default where the kernel
builds): a GGUF's Q4_0 / Q4_1 / Q8_0 weights multiplied as stored, in float32, against the dense
matmul of the same values, at decode rows and through the prompt path, and a GGUF load that holds
whole 4-bit blocks and the tied Q8_0 head as blocks. (The default model against transformers:
tests/integration/test_engine_parity.py.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.runner.loading import load
from ballast.models.arch.llama import LlamaForCausalLM
from ballast.models.base import ForwardBatch
from ballast.models.blocks.cpu_linear import bf16_available
from ballast.models.kernels import cpu_kernel
from ballast.models.layers import cpu_blocks
from ballast.models.layers.cpu_blocks import BLOCK_MAX_ROWS, BlockLinear
from ballast.models.layers.packed import q4_weight, q8_weight
from ballast.models.layers.state import allocate_states
from ballast.models.weights.gguf_quants import dequantize
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from ggufdata import random_blocks
from test_gguf_loader import MIXED_Q4_LAYERS, write_tiny_llama

from ballast.settings import ConfigError

pytestmark = pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler or no AVX2/FMA here")
CPU = torch.device("cpu")


def _packed(qtype: QT, n: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    return random_blocks(qtype, n * k // block, rng).reshape(n, k // block * size)


def _dense(rows: np.ndarray, qtype: QT, n: int, k: int) -> torch.Tensor:
    return dequantize(rows.reshape(-1), qtype).reshape(n, k)


@pytest.mark.parametrize("rows", [1, 3, 5, BLOCK_MAX_ROWS, BLOCK_MAX_ROWS + 1, 70])
def test_q4_blocks_multiply_as_the_dense_values_do(rows: int) -> None:
    # two weights stacked along the outputs (q/k/v, gate/up), one of each 4-bit type
    shapes = ((QT.Q4_1, 96), (QT.Q4_0, 40))
    packed = [_packed(qt, n, 256, seed) for seed, (qt, n) in enumerate(shapes)]
    layer = BlockLinear([q4_weight(p, qt, (n, 256)) for p, (qt, n) in zip(packed, shapes, strict=True)])
    dense = torch.cat([_dense(p, qt, n, 256) for p, (qt, n) in zip(packed, shapes, strict=True)])
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    got, want = layer(x), x.double() @ dense.double().t()
    assert got.dtype == torch.float32 and got.shape == (rows, 136)
    # float32 products and sums of the file's values: only the order of the additions differs
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())
    assert torch.equal(layer.dequantize(), dense)  # the prompt path's weights are the dense ones


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_q8_head_multiplies_as_its_dense_values_do(rows: int) -> None:
    packed = _packed(QT.Q8_0, 4100, 64, seed=3)  # past one 4,096-output slice of the prompt path
    head, dense = BlockLinear(q8_weight(packed, (4100, 64))), _dense(packed, QT.Q8_0, 4100, 64)
    x = torch.randn(2, rows, 64, generator=torch.Generator().manual_seed(4))  # leading dims kept
    got, want = head(x), x.double() @ dense.double().t()
    assert got.shape == (2, rows, 4100)
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())


def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it() -> None:
    """Up to BLOCK_MAX_ROWS rows share each block's unpacking, one at a time or 8 together: the same
    sums bit for bit (a speculative verify row's logits are the decode step's, so greedy text is the
    same with drafts)."""
    q4 = BlockLinear([q4_weight(_packed(QT.Q4_1, 24, 128), QT.Q4_1, (24, 128))])
    q8 = BlockLinear(q8_weight(_packed(QT.Q8_0, 24, 128, seed=2), (24, 128)))
    x = torch.randn(BLOCK_MAX_ROWS, 128, generator=torch.Generator().manual_seed(5))
    for layer in (q4, q8):
        alone = torch.cat([layer(row[None]) for row in x])
        for rows in range(2, BLOCK_MAX_ROWS + 1):
            assert torch.equal(layer(x[:rows]), alone[:rows]), rows
            assert torch.equal(layer(x[-rows:]), alone[-rows:]), rows


def test_decode_rows_must_be_float32_and_prompt_rows_may_be_bf16() -> None:
    layer = BlockLinear(q8_weight(_packed(QT.Q8_0, 32, 64), (32, 64)))
    with pytest.raises(TypeError, match="float32"):
        layer(torch.randn(1, 64, dtype=torch.bfloat16))
    x = torch.randn(BLOCK_MAX_ROWS + 1, 64, dtype=torch.bfloat16)  # after a bfloat16 attention
    assert torch.equal(layer(x), layer(x.float()))


def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    assert isinstance(model, LlamaForCausalLM)
    states = allocate_states(model.layer_specs(4), 1, 128, "cpu", torch.float32)
    with torch.inference_mode():
        first = model(ForwardBatch.build([(0, tokens, 0)], CPU, all_logits=[True]), states)
        step = model(ForwardBatch.build([(0, [5], len(tokens))], CPU), states)
    return torch.cat((first, step))


def test_the_default_holds_whole_q4_blocks_and_the_q8_head_as_blocks(tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "q4.gguf", layer_types=MIXED_Q4_LAYERS)
    dense = load(EngineConfig(model=str(tiny.path), device="cpu", cpu_weights="dense"), CPU, torch.float32)
    ours = load(EngineConfig(model=str(tiny.path), device="cpu"), CPU, torch.float32)  # auto
    m = ours.model
    assert isinstance(m, LlamaForCausalLM)
    kinds = [
        (type(b.quantized.first).__name__ if b.quantized else None)
        for layer in m.model.layers
        for b in (layer.self_attn, layer.mlp)
    ]
    assert kinds == ["BlockLinear", "BlockLinear", None, "BlockLinear"]  # layer 1's k is Q8_0: dense
    assert m.block_decoder is None  # a step in one kernel call needs every layer's blocks
    assert isinstance(m.quantized_head, BlockLinear) and not m.quantized_head.q4
    assert torch.equal(m.model.embed_tokens.weight, dense.model.model.embed_tokens.weight)  # lookups
    assert ours.weights_bytes < dense.weights_bytes
    tokens = [3, 17, 42, 99, 7, 8, 9, 10, 11, 12, 13]  # 11 rows: the prompt path, then a decode row
    got, want = _logits(m, tokens), _logits(dense.model, tokens)
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_an_untied_head_of_another_type_stays_dense(tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "untied.gguf", tied=False, seed=3)  # output.weight is Q6_K
    m = load(EngineConfig(model=str(tiny.path), device="cpu", cpu_weights="blocks"), CPU, torch.float32).model
    assert isinstance(m, LlamaForCausalLM) and m.quantized_head is None
    assert m.block_decoder is None  # a step in one call needs the head's blocks too
    want = torch.from_numpy(tiny.expected["lm_head.weight"])
    assert torch.equal(m.lm_head.weight, want)


def test_bf16_prompts_round_only_chunks_past_their_rows() -> None:
    if not bf16_available():
        pytest.skip("no native bfloat16 matmuls on this CPU")
    packed = _packed(QT.Q4_1, 64, 128)
    layer, plain = (BlockLinear([q4_weight(packed, QT.Q4_1, (64, 128))]) for _ in range(2))
    layer.bf16_rows, layer.bf16_out = 64, True  # as hold_prompt_bf16 sets a q/k/v projection
    for rows, rounded in ((64, False), (65, True)):
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        got, exact = layer(x), plain(x)
        assert got.dtype == (torch.bfloat16 if rounded else torch.float32)
        assert torch.equal(got.float(), exact) != rounded
        assert float((got.float() - exact).abs().max()) < 2e-2 * float(exact.abs().max())


def test_the_blocks_form_is_refused_where_the_kernel_cannot_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    cpu_kernel.library.cache_clear()
    try:
        assert not cpu_kernel.available()
        with pytest.raises(ConfigError, match="cpu-weights"):
            EngineConfig(device="cpu", cpu_weights="blocks").cpu_blocks(CPU)
        assert not EngineConfig(device="cpu").cpu_blocks(CPU)  # auto falls back to dense
    finally:
        cpu_kernel.library.cache_clear()
    with pytest.raises(ConfigError, match="cpu-weights"):
        EngineConfig(device="cpu", dtype="bfloat16", cpu_weights="blocks").cpu_blocks(CPU)


def test_the_kernel_is_built_once_into_the_cache_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BALLAST_CACHE_DIR", str(tmp_path))
    cpu_kernel.library.cache_clear()
    try:
        assert cpu_kernel.available()
        built = sorted(tmp_path.glob("cpu_blocks-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu_kernel.library.cache_clear()
        assert cpu_kernel.available() and built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
    finally:
        cpu_kernel.library.cache_clear()


def _decode_run(m: LlamaForCausalLM, prompts: list[int], steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits of each step, the KV store's layer tensor) of sequences of `prompts` tokens, then
    `steps` greedy decode steps of them all; odd slots' blocks handed out in reverse order."""
    states = allocate_states(m.layer_specs(4), len(prompts), 96, "cpu", torch.float32)
    store = states[0].store  # type: ignore[attr-defined]
    for slot in range(1, len(prompts), 2):
        store.set_table(slot, 0, store.block_table[slot].tolist()[::-1])
    rows = [(s, [(7 * s + i) % 200 + 1 for i in range(n)], 0) for s, n in enumerate(prompts)]
    with torch.inference_mode():
        out = [m(ForwardBatch.build(rows, CPU), states)]
        for k in range(steps):
            tokens = out[-1].argmax(-1).tolist()
            step = [(s, [tokens[s]], n + k) for s, n in enumerate(prompts)]
            out.append(m(ForwardBatch.build(step, CPU), states))
    return torch.stack(out), store.host.kv.clone()


@pytest.mark.parametrize("prompts", [[9], [9, 40, 17], [5, 33, 12, 64, 3, 20, 47, 8]])
def test_a_stack_of_q4_blocks_decodes_in_one_kernel_call_as_its_layers_do(
    prompts: list[int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = write_tiny_llama(tmp_path / "q4.gguf", layer_types=[MIXED_Q4_LAYERS[0]] * 2, seed=5)
    m = load(EngineConfig(model=str(tiny.path), device="cpu"), CPU, torch.float32).model
    assert isinstance(m, LlamaForCausalLM) and m.block_decoder is not None
    decoder, calls = m.block_decoder, []
    call = type(decoder).__call__
    monkeypatch.setattr(type(decoder), "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    decoder.threads.ceiling = 1
    got, got_kv = _decode_run(m, prompts, steps=4)
    assert len(calls) == 4  # every decode step of up to BLOCK_MAX_ROWS rows, no prompt step
    decoder.threads.ceiling = 2  # outputs and heads split over two threads: the same sums
    assert all(
        torch.equal(a, b) for a, b in zip(_decode_run(m, prompts, steps=4), (got, got_kv), strict=True)
    )
    m.block_decoder = None  # the same steps through the layers (torch ops around the block linears)
    want, want_kv = _decode_run(m, prompts, steps=4)
    assert len(calls) == 8
    # float32 throughout: only the order of additions (and the kernel's exp) differ
    assert float((got - want).abs().max()) < 1e-4 * float(want.abs().max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got_kv - want_kv).abs().max()) < 1e-4 * float(want_kv.abs().max())  # K/V written alike


def test_the_one_call_step_leaves_larger_and_int8_steps_to_the_layers(tmp_path: Path) -> None:
    tiny = write_tiny_llama(tmp_path / "q4.gguf", layer_types=[MIXED_Q4_LAYERS[0]] * 2)
    m = load(EngineConfig(model=str(tiny.path), device="cpu"), CPU, torch.float32).model
    assert isinstance(m, LlamaForCausalLM) and m.block_decoder is not None
    store = allocate_states(m.layer_specs(4), 1, 32, "cpu", torch.float32)[0].store  # type: ignore[attr-defined]
    int8 = allocate_states(m.layer_specs(4), 1, 32, "cpu", torch.float32, quantized_kv=True)[0].store  # type: ignore[attr-defined]
    decode = ForwardBatch.build([(s, [1], 3) for s in range(BLOCK_MAX_ROWS)], CPU)
    assert m.block_decoder.serves(decode, [store])
    assert not m.block_decoder.serves(ForwardBatch.build([(0, [1, 2], 3)], CPU), [store])  # a prompt chunk
    assert not m.block_decoder.serves(
        ForwardBatch.build([(s, [1], 3) for s in range(BLOCK_MAX_ROWS + 1)], CPU), [store]
    )
    assert not m.block_decoder.serves(decode, [int8]) and not m.block_decoder.serves(decode, [store, int8])


def test_the_decode_step_runs_extra_threads_only_while_they_keep_up() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine's intra-op count (engine/threads.py)
    try:
        threads, calm = cpu_blocks.DecodeThreads(ceiling=2), cpu_blocks.CALM_S
        assert threads.count(now=0.0) == 2
        threads.settle(2, wall=0.010, held_up=0.002, now=0.0)  # the extra thread kept up
        assert threads.count(0.0) == 2
        threads.settle(2, wall=0.010, held_up=0.008, now=10.0)  # held up: another process has its core
        assert threads.count(10.0 + calm / 2) == 1 and threads.count(10.0 + calm) == 2
        threads.settle(2, wall=0.010, held_up=0.009, now=11.0)  # the probe too: twice as long alone
        assert threads.count(11.0 + 1.5 * calm) == 1 and threads.count(11.0 + 2 * calm) == 2
        threads.settle(1, wall=0.010, held_up=0.010, now=13.0)  # a step on the engine's threads tells nothing
        assert threads.count(13.0) == 2
        threads.settle(2, wall=0.010, held_up=0.001, now=13.0)  # kept up again: the next stay is short
        threads.settle(2, wall=0.010, held_up=0.009, now=14.0)
        assert threads.count(14.0 + calm) == 2
        assert cpu_blocks.DecodeThreads(ceiling=1).count(0.0) == 1  # --cpu-threads 1: one thread
    finally:
        torch.set_num_threads(before)
