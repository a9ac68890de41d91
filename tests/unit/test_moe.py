"""MoE routing and expert compute against the transformers Qwen3-Next / Qwen3.5-MoE modules."""

from __future__ import annotations

import pytest
import torch
from ballast.models.blocks.moe import (
    SparseMoeBlock,
    experts_forward,
    grouped_mm_supported,
    per_expert_target,
    place_expert_tensor,
    route,
)
from transformers import Qwen3NextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

HIDDEN, EXPERTS, TOP_K, INTER, SHARED = 32, 8, 3, 16, 24


def _randomised(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return module.eval()


def _next_block(norm_topk_prob: bool) -> torch.nn.Module:
    cfg = Qwen3NextConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=SHARED,
        norm_topk_prob=norm_topk_prob,
    )
    return _randomised(Qwen3NextSparseMoeBlock(cfg), seed=0)


def _ours(reference: torch.nn.Module, normalize: bool) -> SparseMoeBlock:
    ours = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, INTER, SHARED, normalize)
    ours.load_state_dict(reference.state_dict(), strict=True)
    return ours.eval()


@pytest.mark.parametrize("normalize", [True, False])
def test_block_matches_qwen3_next(normalize: bool) -> None:
    reference = _next_block(normalize)
    x = torch.randn(2, 13, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(x).reshape(-1, HIDDEN)
        got = _ours(reference, normalize)(x.reshape(-1, HIDDEN))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_block_matches_qwen3_5_moe() -> None:
    cfg = Qwen3_5MoeTextConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        moe_intermediate_size=INTER,
        shared_expert_intermediate_size=SHARED,
    )
    reference = _randomised(Qwen3_5MoeSparseMoeBlock(cfg), seed=2)
    x = torch.randn(1, 9, HIDDEN, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = reference(x).reshape(-1, HIDDEN)
        got = _ours(reference, normalize=True)(x.reshape(-1, HIDDEN))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_route_normalises_only_when_asked() -> None:
    logits = torch.randn(5, EXPERTS, generator=torch.Generator().manual_seed(4))
    w, e = route(logits, TOP_K, normalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(5))
    w_raw, e_raw = route(logits, TOP_K, normalize=False)
    assert torch.equal(e, e_raw)
    assert bool((w_raw.sum(-1) < 1).all())
    # the chosen experts are the k largest logits
    assert torch.equal(e.sort(-1).values, logits.topk(TOP_K).indices.sort(-1).values)


def _loop_reference(x, experts, weights, gate_up, down):  # type: ignore[no-untyped-def]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("grouped", [False, True])
def test_expert_paths_match_a_per_token_loop(grouped: bool) -> None:
    if grouped and not grouped_mm_supported("cpu", torch.float32):
        pytest.skip("this torch build has no CPU grouped GEMM")
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(11, HIDDEN, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.2
    # Unbalanced on purpose: most pairs go to expert 6, experts 0-2 receive nothing.
    experts = torch.full((11, 2), 6, dtype=torch.int64)
    experts[:, 1] = torch.tensor([3, 4, 5, 7, 3, 3, 4, 5, 7, 7, 3])
    weights = torch.rand(11, 2, generator=gen)
    got = experts_forward(x, experts, weights, gate_up, down, use_grouped_mm=grouped)
    torch.testing.assert_close(got, _loop_reference(x, experts, weights, gate_up, down), atol=1e-5, rtol=1e-5)


def test_bf16_output_dtype_and_closeness() -> None:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(7, HIDDEN, generator=gen)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.2
    weights, experts = route(torch.randn(7, EXPERTS, generator=gen), TOP_K, True)
    want = experts_forward(x, experts, weights, gate_up, down, use_grouped_mm=False)
    got = experts_forward(x.bfloat16(), experts, weights.bfloat16(), gate_up.bfloat16(), down.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2)


def test_bad_top_k_is_refused() -> None:
    with pytest.raises(ValueError):
        SparseMoeBlock(HIDDEN, EXPERTS, EXPERTS + 1, INTER, SHARED, True)


def test_per_expert_checkpoint_tensors_fill_the_fused_parameters() -> None:
    """Unfused checkpoints (one tensor per expert and projection) land where transformers'
    conversion puts them, so the block computes the same thing."""
    reference = _next_block(norm_topk_prob=True)
    ours = _ours(reference, normalize=True)
    fused = dict(ours.named_parameters())
    rebuilt = {n: torch.zeros_like(p) for n, p in fused.items()}
    gate_up, down = reference.experts.gate_up_proj.detach(), reference.experts.down_proj.detach()
    for e in range(EXPERTS):
        per_expert = {"gate_proj": gate_up[e, :INTER], "up_proj": gate_up[e, INTER:], "down_proj": down[e]}
        for part, tensor in per_expert.items():
            target = per_expert_target(f"model.layers.3.mlp.experts.{e}.{part}.weight")
            assert target is not None
            name, expert, got_part = target
            assert name in ("model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj")
            place_expert_tensor(rebuilt[name.removeprefix("model.layers.3.mlp.")], expert, got_part, tensor)
    assert torch.equal(rebuilt["experts.gate_up_proj"], fused["experts.gate_up_proj"].detach())
    assert torch.equal(rebuilt["experts.down_proj"], fused["experts.down_proj"].detach())
    assert per_expert_target("model.layers.3.mlp.shared_expert.gate_proj.weight") is None
    with pytest.raises(ValueError):
        place_expert_tensor(rebuilt["experts.down_proj"], 0, "down_proj", torch.zeros(3, 3))
