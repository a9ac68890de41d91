"""Expert parallel on the CPU (gloo): with `--expert-parallel` each of two ranks holds half the
routed experts whole (float8 ones with all their scale blocks), computes only the pairs routed to
them, and the ranks together give the logits and greedy tokens of one device, for every MoE
architecture, from built-in weights and from HF directories (per-expert and fused tensors)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.runner.model_runner import weights_bytes
from ballast.models.arch.builtin import builtin_config
from ballast.models.arch.parallel import (
    ShardPlan,
    TPGroup,
    build_shard,
    check_tensor_parallel,
    shard_weights_bytes,
)
from ballast.models.base import UnsupportedModel
from ballast.models.blocks.moe import Experts, experts_forward, local_expert_ids
from ballast.models.layers.fp8 import FP8, quantize_blocks
from ballast.models.weights.hf_loader import inspect_hf_dir, load_hf_dir
from ballast.models.weights.shard_loading import load_hf_shard
from tp_harness import (
    assert_tp_serves_like_one_device,
    full_model,
    reference_logits,
    run_steps,
    sharded_logits,
    steps_for,
    write_checkpoint,
)

from ballast.settings import ConfigError

VOCAB = 1001
BLOCK = (16, 16)  # FP8 scale blocks: the tiny experts' 32 intermediate rows are two whole blocks


def _tiny(name: str, **over: Any) -> dict[str, Any]:
    return {**builtin_config(name), "vocab_size": VOCAB, **over}


def _experts(model: torch.nn.Module) -> list[Experts]:
    return [m for m in model.modules() if isinstance(m, Experts)]


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped GEMM", "padded bmm"])
def test_the_halves_of_the_experts_add_up_to_all_of_them(grouped: bool) -> None:
    """Each half computes only the pairs routed to its experts (the others add exactly 0), so the
    two partial outputs sum to the output of all experts; a half that received no pair gives 0."""
    gen = torch.Generator().manual_seed(0)
    num, hidden, inter, tokens = 8, 16, 8, 11
    x = torch.randn(tokens, hidden, generator=gen)
    gate_up = torch.randn(num, 2 * inter, hidden, generator=gen)
    down = torch.randn(num, hidden, inter, generator=gen)
    experts = torch.randint(0, num, (tokens, 3), generator=gen)
    weights = torch.rand(tokens, 3, generator=gen)
    whole = experts_forward(x, experts, weights, gate_up, down, grouped)
    parts = [
        experts_forward(
            x, local_expert_ids(experts, first, 4), weights, gate_up[first : first + 4],
            down[first : first + 4], grouped, outside=True,
        )
        for first in (0, 4)
    ]  # fmt: skip
    assert not torch.equal(parts[0], torch.zeros_like(parts[0]))
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=1e-5, rtol=1e-5)
    low = experts_forward(
        x, local_expert_ids(experts % 4, 4, 4), weights, gate_up[4:], down[4:], grouped, outside=True
    )
    assert torch.equal(low, torch.zeros_like(x))


def test_two_ranks_with_whole_experts_give_the_logits_of_one_device(tmp_path: Path) -> None:
    """Built-in weights cut in memory, and HF directories read per rank: one tensor per expert
    (a rank reads only its experts'), fused [E, ...] tensors (a rank reads its rows), and FP8
    checkpoints whose experts stay float8 on each rank (the loader takes float8 experts one
    tensor per expert, as the FP8 releases store them)."""
    next_hf, moe_hf = _tiny("tiny-qwen3-next"), _tiny("tiny-qwen3.5-moe")
    float32 = {
        "qwen3_next, built-in": next_hf,
        "qwen3_next, one tensor per expert": write_checkpoint(next_hf, tmp_path / "next", True),
        "qwen3_5_moe, fused experts": write_checkpoint(moe_hf, tmp_path / "q35", False),
    }
    fp8 = {
        "qwen3_next FP8, one tensor per expert": write_checkpoint(next_hf, tmp_path / "n8", True, BLOCK),
        "qwen3_5_moe FP8, one tensor per expert": write_checkpoint(moe_hf, tmp_path / "q8", True, BLOCK),
    }
    models = [{**hf, "expert_parallel": True} for hf in float32.values()]
    models += [{**hf, "expert_parallel": True, "keep_fp8": True} for hf in fp8.values()]
    steps = steps_for(VOCAB)[:4]
    sharded = sharded_logits(models, steps, 2, torch.float32, "cpu")
    wants = [reference_logits(hf, steps, torch.float32, "cpu") for hf in float32.values()]
    for hf in fp8.values():
        one = load_hf_dir(hf["checkpoint_dir"], keep_fp8=True)
        assert all(e.gate_up_proj.dtype == FP8 for e in _experts(one))
        wants.append(run_steps(one, steps, torch.float32, torch.device("cpu")))
    for name, got, want in zip([*float32, *fp8], sharded, wants, strict=True):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"{name}, step {i}")


def test_each_rank_holds_only_its_experts(tmp_path: Path) -> None:
    """Rank r's experts are experts [4r, 4r + 4) of the checkpoint, whole, in float8 with every
    scale block of theirs; the rank's bytes are what admission counted, and its expert bytes are
    half of the model's (the shared expert and the rest split as under plain tensor parallel)."""
    hf = write_checkpoint(_tiny("tiny-qwen3-next"), tmp_path / "next", True, BLOCK)
    ckpt = inspect_hf_dir(hf["checkpoint_dir"])
    spec = (ckpt.fp8_params().__contains__, ckpt.fp8_block)
    full = _experts(full_model(hf, torch.float32, "cpu"))
    for rank in range(2):
        shard = build_shard(hf, TPGroup(rank, 2), torch.float32, torch.device("cpu"), spec, True)
        load_hf_shard(shard, ckpt, ShardPlan(hf, rank, 2, expert_parallel=True))
        held = _experts(shard)
        assert len(held) == len(full) and all(e.first == 4 * rank for e in held)
        for mine, whole in zip(held, full, strict=True):
            assert mine.gate_up_proj.dtype == FP8 and mine.gate_up_proj.shape == (4, 64, 64)
            assert mine.gate_up_proj_scale_inv.shape == (4, 4, 4)
            want, _ = quantize_blocks(whole.gate_up_proj.detach()[4 * rank : 4 * rank + 4], BLOCK)
            assert torch.equal(mine.gate_up_proj.view(torch.uint8), want.view(torch.uint8))
        assert weights_bytes(shard) == shard_weights_bytes(ckpt.config, 2, torch.float32, spec, True)
        held_bytes = sum(p.numel() * p.element_size() for e in held for p in e.parameters())
        half = sum(p.numel() for e in full for p in e.parameters()) // 2
        assert held_bytes == half + half // (BLOCK[0] * BLOCK[1]) * 4  # float8, a float32 scale a block


def test_expert_parallel_is_refused_where_it_cannot_split() -> None:
    with pytest.raises(ConfigError, match="expert-parallel.*tensor-parallel-size"):
        EngineConfig(model="builtin:tiny-qwen3-next", expert_parallel=True)
    with pytest.raises(UnsupportedModel, match=r"num_experts \(6\) is not a multiple"):
        check_tensor_parallel(_tiny("tiny-qwen3-next", num_experts=6), 4, True)
    with pytest.raises(UnsupportedModel, match="no routed experts"):
        check_tensor_parallel(_tiny("tiny-llama"), 2, True)
    check_tensor_parallel(_tiny("tiny-qwen3-next"), 2, True)


def test_the_engine_with_expert_parallel_serves_the_greedy_tokens_of_one_device(tmp_path: Path) -> None:
    """Through the engine (its worker loads its own experts from an FP8 checkpoint, float8 kept):
    the greedy tokens and logprobs of one device."""
    hf = write_checkpoint(_tiny("tiny-qwen3-next"), tmp_path / "next", True, BLOCK)

    def check(engine: Any, tp: int) -> None:
        if tp > 1:
            held = _experts(engine._loaded.model)
            assert all(e.first == 0 and e.gate_up_proj.shape[0] == 4 for e in held)

    assert_tp_serves_like_one_device(hf["checkpoint_dir"], check, expert_parallel=True)
