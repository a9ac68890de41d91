"""On CUDA: the flash-linear-attention kernels against the pure-torch gated delta rule on the same
inputs and weights (bf16 model, float32 state), and the torch path on CUDA (grouped-GEMM MoE)
against the float32 CPU model. Skips cleanly without CUDA; the fla tests also without `fla`."""

from __future__ import annotations

import pytest
import torch
from ballast.models.arch.builtin import build_builtin
from ballast.models.base import ForwardBatch
from ballast.models.blocks.gated_delta import DeltaPlan, fla_installed, gated_delta_varlen
from ballast.models.blocks.moe import experts_forward, grouped_mm_supported, route
from ballast.models.layers.state import RecurrentState, allocate_states, dtype_bytes
from torch import nn
from triton_kernels import delta_rule_inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]
needs_fla = pytest.mark.skipif(not fla_installed(), reason="flash-linear-attention (fla) is not installed")
CUDA = torch.device("cuda")
MODELS = ["builtin:tiny-qwen3-next", "builtin:tiny-qwen3.5-moe"]


def _rule_inputs(
    lens: list[int], hk: int = 4, hv: int = 8, dk: int = 64, dv: int = 64
) -> tuple[torch.Tensor, ...]:
    q, k, v, g, beta, state = delta_rule_inputs(sum(lens), len(lens), (hk, hv, dk, dv), 0.5, 0.1)
    return (
        q.bfloat16().to(CUDA),
        k.bfloat16().to(CUDA),
        v.bfloat16().to(CUDA),
        g.to(CUDA),
        beta.bfloat16().to(CUDA),
        state.to(CUDA),
    )


@needs_fla
def test_fla_rule_matches_torch_rule_on_a_mixed_batch() -> None:
    lens = [1, 200, 1, 17, 64, 1]  # decode tokens and prefill chunks of several lengths
    q, k, v, g, beta, state = _rule_inputs(lens)
    plan = DeltaPlan.build(lens, CUDA)
    o_fla, s_fla = gated_delta_varlen(q, k, v, g, beta, state, plan, use_fla=True)
    o_ref, s_ref = gated_delta_varlen(q, k, v, g, beta, state, plan, use_fla=False)
    assert s_fla.dtype == torch.float32
    torch.testing.assert_close(o_fla.float(), o_ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(s_fla, s_ref, atol=3e-2, rtol=3e-2)


def _bf16_model(name: str, use_fla: bool | None) -> nn.Module:
    model = build_builtin(name, dtype=torch.bfloat16, device=CUDA)
    model.use_fla = use_fla  # type: ignore[assignment]
    return model


def _run(
    model: nn.Module, prompts: list[list[int]], steps: int
) -> tuple[list[torch.Tensor], list[RecurrentState]]:
    """Prefill all prompts in one step, then decode them together on fixed tokens (not each run's
    own argmax: in bf16 a near-tie can flip one token and the runs would no longer be comparable);
    logits of every step."""
    dtype = next(model.parameters()).dtype
    states = allocate_states(model.layer_specs(dtype_bytes(dtype)), len(prompts), 512, CUDA, dtype)
    logits = model(ForwardBatch.build([(i, p, 0) for i, p in enumerate(prompts)], CUDA), states)
    out = [logits.float().cpu()]
    pos = [len(p) for p in prompts]
    feed = torch.randint(0, 49152, (steps, len(prompts)), generator=torch.Generator().manual_seed(3)).tolist()
    for tokens in feed:
        logits = model(ForwardBatch.build([(i, [t], pos[i]) for i, t in enumerate(tokens)], CUDA), states)
        pos = [p + 1 for p in pos]
        out.append(logits.float().cpu())
    return out, [s for s in states if isinstance(s, RecurrentState)]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (5, 70, 130, 257)]


@needs_fla
@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_fla_model_matches_torch_model(name: str) -> None:
    fla_logits, fla_states = _run(_bf16_model(name, use_fla=True), _prompts(), steps=4)
    ref_logits, ref_states = _run(_bf16_model(name, use_fla=False), _prompts(), steps=4)
    for a, b in zip(fla_logits, ref_logits, strict=True):
        assert torch.nn.functional.cosine_similarity(a, b, dim=-1).min() > 0.999
        torch.testing.assert_close(a, b, atol=5e-2, rtol=5e-2)
    for a_state, b_state in zip(fla_states, ref_states, strict=True):
        assert a_state.recurrent.dtype == torch.float32
        torch.testing.assert_close(a_state.recurrent, b_state.recurrent, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_cuda_bf16_torch_path_tracks_cpu_float32(name: str) -> None:
    gpu_logits, _ = _run(_bf16_model(name, use_fla=False), _prompts(), steps=0)
    cpu = build_builtin(name)
    states = allocate_states(cpu.layer_specs(4), 4, 512, "cpu", torch.float32)
    want = cpu(ForwardBatch.build([(i, p, 0) for i, p in enumerate(_prompts())], "cpu"), states)
    assert torch.nn.functional.cosine_similarity(gpu_logits[0], want, dim=-1).min() > 0.99


def test_cuda_grouped_gemm_matches_padded_bmm() -> None:
    if not grouped_mm_supported("cuda", torch.bfloat16):
        pytest.skip("no CUDA grouped GEMM for bf16 in this torch build / GPU")
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(300, 256, generator=gen).bfloat16().to(CUDA)
    gate_up = (torch.randn(16, 2 * 128, 256, generator=gen) * 0.05).bfloat16().to(CUDA)
    down = (torch.randn(16, 256, 128, generator=gen) * 0.05).bfloat16().to(CUDA)
    weights, experts = route(torch.randn(300, 16, generator=gen).to(CUDA), 4, True)
    grouped = experts_forward(x, experts, weights, gate_up, down, use_grouped_mm=True)
    padded = experts_forward(x, experts, weights, gate_up, down, use_grouped_mm=False)
    torch.testing.assert_close(grouped.float(), padded.float(), atol=2e-2, rtol=2e-2)
