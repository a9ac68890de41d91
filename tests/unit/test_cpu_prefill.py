"""Prompt chunks in bfloat16 on the CPU (--cpu-prefill bfloat16, models/blocks/cpu_linear.py): a
prompt's rows through bfloat16 matmuls with float32 sums, its attention in bfloat16, and
everything of a few rows (decode) float32 exactly as the dense path. (The default model against
float32 over a 2k-token prompt: bench/cpu_weight_tolerance.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from ballast.engine.config import EngineConfig
from ballast.engine.runner.loading import LoadedModel, load
from ballast.models.arch.llama import LlamaForCausalLM
from ballast.models.base import ForwardBatch
from ballast.models.blocks.cpu_linear import PROMPT_BF16_MIN_ROWS, PromptLinear, bf16_available
from ballast.models.layers.core import linear
from ballast.models.layers.cpu_blocks import BlockLinear
from ballast.models.layers.state import allocate_states
from test_gguf_loader import MIXED_Q4_LAYERS, write_tiny_llama

from ballast.settings import ConfigError

pytestmark = pytest.mark.skipif(not bf16_available(), reason="no native bfloat16 matmuls on this CPU")


def _bf16_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The product of the bfloat16-rounded inputs and weights, summed exactly (float64)."""
    y = x.bfloat16().double() @ w.bfloat16().double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("bias", [False, True])
def test_prompt_rows_are_bf16_products_with_float32_sums(bias: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(192, 96, generator=gen) * 0.1
    x = torch.randn(PROMPT_BF16_MIN_ROWS + 36, 96, generator=gen)
    b = torch.randn(192, generator=gen) if bias else None
    mode = torch.backends.mkldnn.matmul.fp32_precision  # type: ignore[attr-defined]
    got = PromptLinear(w, b)(x)
    assert torch.backends.mkldnn.matmul.fp32_precision == mode  # type: ignore[attr-defined]  # put back
    assert got.dtype == torch.float32 and got.shape == (100, 192)
    # bfloat16 rounding of inputs and weights, float32 accumulation and output: close to the exact
    # product of the rounded values, far from it in bfloat16 output precision terms
    want = _bf16_reference(x, w, b)
    assert float((got.double() - want).abs().max()) < 1e-4
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert float((got.double() - exact).abs().max()) > 1e-3  # the rounding is real
    assert PromptLinear(w, b, bf16_out=True)(x).dtype == torch.bfloat16


def test_few_rows_stay_float32_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(2)
    w, b = torch.randn(64, 32, generator=gen), torch.randn(64, generator=gen)
    for rows in (1, 8, PROMPT_BF16_MIN_ROWS):
        x = torch.randn(rows, 32, generator=gen)
        got = PromptLinear(w, b, bf16_out=True)(x)
        assert got.dtype == torch.float32 and torch.equal(got, linear(x, w, b))
    assert PromptLinear(w)(torch.randn(2, 3, 32)).shape == (2, 3, 64)  # leading dims kept


def _logits(model: torch.nn.Module, tokens: list[int], int8_kv: bool = False) -> torch.Tensor:
    """Every position's logits of a prompt, then a decode step's (int8_kv: K/V in int8 blocks,
    which attention reads gathered, not in place)."""
    assert isinstance(model, LlamaForCausalLM)
    states = allocate_states(model.layer_specs(1 if int8_kv else 4), 1, 256, "cpu", torch.float32, int8_kv)
    cpu = torch.device("cpu")
    with torch.inference_mode():
        first = model(ForwardBatch.build([(0, tokens, 0)], cpu, all_logits=[True]), states)
        step = model(ForwardBatch.build([(0, [5], len(tokens))], cpu), states)
    return torch.cat((first, step))


def _loaded_twice(path: Path, weights: str) -> tuple[LoadedModel, LoadedModel]:
    """The GGUF at path with these CPU weights, as loaded plain and with bfloat16 prompts."""
    cpu = torch.device("cpu")
    plain, bf16 = (
        load(EngineConfig(model=str(path), device="cpu", cpu_weights=weights, **more), cpu, torch.float32)
        for more in ({}, {"cpu_prefill": "bfloat16"})
    )
    return plain, bf16


# qwen2: q/k/v biases through the fused linear; qwen3: q/k norms (which widen q and k to float32)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_load_runs_prompts_in_bf16_and_decode_in_float32(tmp_path: Path, arch: str) -> None:
    dense, bf16 = _loaded_twice(write_tiny_llama(tmp_path / "tiny.gguf", arch=arch).path, "dense")
    m = bf16.model
    assert isinstance(m, LlamaForCausalLM)
    for layer in m.model.layers:
        for pair in (layer.self_attn.quantized, layer.mlp.quantized):
            assert pair is not None
            assert isinstance(pair.first, PromptLinear) and isinstance(pair.second, PromptLinear)
    assert m.quantized_head is None  # the head stays float32
    assert bf16.weights_bytes == dense.weights_bytes  # the same float32 weights, no copy
    # a short prompt and its decode: float32, the dense path's numbers exactly
    short = [3, 17, 42, 99, 7]
    assert torch.equal(_logits(m, short), _logits(dense.model, short))
    # a long prompt: bfloat16, close to float32 and not equal to it (the median row: random
    # weights amplify the rounding on a few rows of this tiny model, in float64 emulation alike)
    gen = torch.Generator().manual_seed(3)
    long = torch.randint(3, 200, (PROMPT_BF16_MIN_ROWS + 60,), generator=gen).tolist()
    ours, ref = _logits(m, long), _logits(dense.model, long)
    per_row = (ours - ref).abs().amax(-1)
    assert float(per_row.median()) < 2e-2 * float(ref.abs().max())
    assert not torch.equal(ours, ref)
    # int8 K/V blocks: bfloat16 queries attend the gathered (float32) K/V
    ours, ref = _logits(m, long, int8_kv=True), _logits(dense.model, long, int8_kv=True)
    assert float((ours - ref).abs().amax(-1).median()) < 2e-2 * float(ref.abs().max())


def test_bf16_prefill_needs_a_float32_cpu_engine() -> None:
    cpu = torch.device("cpu")
    assert EngineConfig(device="cpu", cpu_weights="dense", cpu_prefill="bfloat16").cpu_prompt_bf16(cpu)
    assert not EngineConfig(device="cpu").cpu_prompt_bf16(cpu)  # float32 by default
    assert EngineConfig(device="cpu", cpu_weights="blocks", cpu_prefill="bfloat16").cpu_prompt_bf16(cpu)
    bad = EngineConfig(device="cpu", dtype="bfloat16", cpu_weights="dense", cpu_prefill="bfloat16")
    with pytest.raises(ConfigError, match="cpu-prefill"):
        bad.cpu_prompt_bf16(cpu)


def test_block_weights_take_bf16_prompts_and_attend_in_bf16(tmp_path: Path) -> None:
    blocks, both = _loaded_twice(
        write_tiny_llama(tmp_path / "q4.gguf", layer_types=MIXED_Q4_LAYERS).path, "blocks"
    )
    m = both.model
    assert isinstance(m, LlamaForCausalLM)
    first, second = m.model.layers
    assert first.self_attn.quantized is not None
    qkv = first.self_attn.quantized.first
    assert isinstance(qkv, BlockLinear) and qkv.bf16_rows == PROMPT_BF16_MIN_ROWS and qkv.bf16_out
    assert second.self_attn.quantized is not None  # the dense attention: prompt linears
    assert isinstance(second.self_attn.quantized.first, PromptLinear)
    assert both.weights_bytes == blocks.weights_bytes
    short = [3, 17, 42, 99, 7]
    assert torch.equal(_logits(m, short), _logits(blocks.model, short))
    gen = torch.Generator().manual_seed(4)
    long = torch.randint(3, 200, (PROMPT_BF16_MIN_ROWS + 60,), generator=gen).tolist()
    ours, ref = _logits(m, long), _logits(blocks.model, long)  # bfloat16 through o and down too
    assert float((ours - ref).abs().amax(-1).median()) < 2e-2 * float(ref.abs().max())
    assert not torch.equal(ours, ref)
