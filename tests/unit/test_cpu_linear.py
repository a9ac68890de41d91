"""The CPU's float16-weight linears (models/cpu_linear.py): FBGEMM's fp16 GEMM against the float32
matmul over the same weights rounded to float16, and a GGUF load under --cpu-weights fp16 that
holds every linear and the head that way. (The default model against its float32 weights:
tests/integration/test_engine_parity.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.loading import load
from ballast.models import cpu_linear
from ballast.models.base import ForwardBatch
from ballast.models.cpu_linear import Fp16Linear, fp16_available, packed_bytes
from ballast.models.llama import LlamaForCausalLM
from ballast.models.state import allocate_states
from test_gguf_loader import write_tiny_llama

from ballast.settings import ConfigError

pytestmark = pytest.mark.skipif(not fp16_available(), reason="torch lacks FBGEMM's fp16 GEMM")


@pytest.mark.parametrize("rows", [1, 2, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_fp16_linear_is_the_float32_matmul_of_the_rounded_weight(rows: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    w, x = torch.randn(300, 128, generator=gen) * 0.05, torch.randn(rows, 128, generator=gen)
    b = torch.randn(300, generator=gen) if bias else None
    got = Fp16Linear(w, b)(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 300)
    # Only the weight is rounded: against float32 maths on the float16 weight, float32 rounding.
    want = torch.nn.functional.linear(x.double(), w.half().double(), None if b is None else b.double())
    assert float((got.double() - want).abs().max()) < 1e-5
    # and it is not the float32 weight's product bit for bit (the rounding is real)
    assert not torch.equal(got, torch.nn.functional.linear(x, w, b))


def test_fp16_linear_keeps_leading_dims_and_refuses_other_dtypes() -> None:
    lin = Fp16Linear(torch.randn(16, 8))
    assert lin(torch.randn(2, 3, 8)).shape == (2, 3, 16)
    with pytest.raises(TypeError, match="float32"):
        lin(torch.randn(2, 8, dtype=torch.bfloat16))


def _logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    assert isinstance(model, LlamaForCausalLM)
    states = allocate_states(model.layer_specs(4), 1, 64, "cpu", torch.float32)
    with torch.inference_mode():
        first = model(ForwardBatch.build([(0, tokens, 0)], torch.device("cpu")), states)
        step = model(ForwardBatch.build([(0, [5], len(tokens))], torch.device("cpu")), states)
    return torch.cat((first, step))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases through the fused linear
def test_gguf_load_holds_every_linear_fp16(tmp_path: Path, arch: str) -> None:
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", arch=arch)
    cpu = torch.device("cpu")
    dense = load(EngineConfig(model=str(tiny.path), device="cpu", cpu_weights="dense"), cpu, torch.float32)
    half = load(EngineConfig(model=str(tiny.path), device="cpu", cpu_weights="fp16"), cpu, torch.float32)
    m = half.model
    assert isinstance(m, LlamaForCausalLM)
    for layer in m.model.layers:
        for pair in (layer.self_attn.quantized, layer.mlp.quantized):
            assert pair is not None
            assert isinstance(pair.first, Fp16Linear) and isinstance(pair.second, Fp16Linear)
    assert isinstance(m.quantized_head, Fp16Linear)
    # the packed weights are counted, and the whole is less than the float32 load
    assert packed_bytes(m) > 0 and half.weights_bytes >= packed_bytes(m)
    assert half.weights_bytes < dense.weights_bytes
    ours, ref = _logits(m, [3, 17, 42, 99, 7]), _logits(dense.model, [3, 17, 42, 99, 7])
    assert float((ours - ref).abs().max()) < 1e-2 * float(ref.abs().max())
    assert not torch.equal(ours, ref)


def test_fp16_weights_demand_a_float32_cpu_engine() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="cpu-weights"):
        EngineConfig(device="cpu", dtype="bfloat16", cpu_weights="fp16").cpu_fp16(cpu)
    assert EngineConfig(device="cpu", cpu_weights="fp16").cpu_fp16(cpu)
    assert not EngineConfig(device="cpu", cpu_weights="fp16").cpu_int4(cpu)  # one form, not both
    assert not EngineConfig(device="cpu", cpu_weights="auto").cpu_fp16(cpu)
    assert not EngineConfig(device="cpu").cpu_fp16(cpu)  # dense by default


def test_bf16_prompts_are_refused_where_onednn_keeps_float32() -> None:
    """bf16_available tries the product: with oneDNN's matmuls off (as on a CPU whose oneDNN
    ignores the bfloat16 mode) --cpu-prefill bfloat16 is an error, not a silent float32 prefill."""
    cpu = torch.device("cpu")
    cpu_linear.bf16_available.cache_clear()
    try:
        with torch.backends.mkldnn.flags(enabled=False):
            assert not cpu_linear.bf16_available()
            with pytest.raises(ConfigError, match="cpu-prefill"):
                EngineConfig(device="cpu", cpu_prefill="bfloat16").cpu_prompt_bf16(cpu)
    finally:
        cpu_linear.bf16_available.cache_clear()
