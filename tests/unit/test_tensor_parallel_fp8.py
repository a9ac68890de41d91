"""FP8 checkpoints under tensor parallel on the CPU (gloo): each rank reads its part of every
float8 weight and the block scales that cover it. Kept in float8 (`--fp8-weights keep`, the
dequantizing reference path on the CPU) two ranks give the logits of one device holding the
same float8 checkpoint; dequantized at load, too, even where a split cuts a scale block, which
a float8 load refuses by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.runner.model_runner import weights_bytes
from ballast.models.arch.builtin import builtin_config
from ballast.models.arch.parallel import shard_weights_bytes
from ballast.models.base import UnsupportedModel
from ballast.models.layers.fp8 import FP8
from ballast.models.weights.hf_loader import inspect_hf_dir, load_hf_dir
from tp_harness import (
    assert_tp_serves_like_one_device,
    run_steps,
    sharded_logits,
    steps_for,
    write_checkpoint,
)

VOCAB = 1001
# Whole blocks on both ranks of every split of these tiny models' float8 weights (the smallest:
# the experts' and the shared expert's 32 intermediate rows, 16 per rank; llama's k/v 32 rows).
BLOCK = (16, 16)


def _tiny(name: str, **over: Any) -> dict[str, Any]:
    return {**builtin_config(name), "vocab_size": VOCAB, **over}


def one_device(hf: dict[str, Any], keep: bool, steps: list) -> list[torch.Tensor]:  # type: ignore[type-arg]
    model = load_hf_dir(hf["checkpoint_dir"], keep_fp8=keep)
    return run_steps(model, steps, torch.float32, torch.device("cpu"))


def test_two_ranks_keep_fp8_weights_with_the_logits_of_one(tmp_path: Path) -> None:
    models = {
        "qwen3_next, one tensor per expert": write_checkpoint(
            _tiny("tiny-qwen3-next"), tmp_path / "next", True, BLOCK
        ),
        "llama, tied head": write_checkpoint(_tiny("tiny-llama"), tmp_path / "llama", False, BLOCK),
    }
    for hf in models.values():
        ckpt = inspect_hf_dir(hf["checkpoint_dir"])
        assert ckpt.scales and ckpt.fp8_block == BLOCK
    steps = steps_for(VOCAB)[:4]
    kept = [{**hf, "keep_fp8": True} for hf in models.values()]
    sharded = sharded_logits(kept, steps, 2, torch.float32, "cpu")
    for (name, hf), got in zip(models.items(), sharded, strict=True):
        want = one_device(hf, True, steps)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"{name}, step {i}")


def test_a_split_inside_a_scale_block_is_refused_kept_and_exact_dequantized(tmp_path: Path) -> None:
    """Block (32, 16): the shared expert's 32 gate rows split 16 + 16, inside one block of scales."""
    hf = write_checkpoint(_tiny("tiny-qwen3-next"), tmp_path / "next", True, (32, 16))
    steps = steps_for(VOCAB)[:3]
    [got] = sharded_logits([hf], steps, 2, torch.float32, "cpu")  # dequantized as each part loads
    for i, (g, w) in enumerate(zip(got, one_device(hf, False, steps), strict=True)):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"step {i}")
    cfg = EngineConfig(
        model=hf["checkpoint_dir"], device="cpu", max_model_len=64, max_num_seqs=1, tensor_parallel_size=2
    )
    with pytest.raises(UnsupportedModel, match=r"shared_expert\.gate_proj.*scale blocks"):
        Engine.load(EngineConfig(**{**cfg.__dict__, "fp8_weights": "keep"}))


def test_the_engine_serves_an_fp8_checkpoint_on_two_ranks_in_float8(tmp_path: Path) -> None:
    """Through the engine (its workers load their own shards): float8 weights held and counted
    as such, and the greedy tokens and logprobs of one device."""
    hf = write_checkpoint(_tiny("tiny-qwen3-next"), tmp_path / "next", True, BLOCK)

    def check(engine: Any, tp: int) -> None:
        model = engine._loaded.model
        experts = next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))
        assert experts.gate_up_proj.dtype == FP8
        if tp == 2:
            ckpt = inspect_hf_dir(hf["checkpoint_dir"])
            spec = (ckpt.fp8_params().__contains__, ckpt.fp8_block)
            assert weights_bytes(model) == shard_weights_bytes(ckpt.config, 2, torch.float32, spec)

    assert_tp_serves_like_one_device(hf["checkpoint_dir"], check)
