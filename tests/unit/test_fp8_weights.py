"""FP8 checkpoints loaded with their float8 weights kept (`--fp8-weights keep`): linears and MoE
experts hold float8 values and block scales, the model equals transformers on the dequantized
weights, and the load holds (and the ledger is charged) float8 bytes, not the model dtype's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.engine.runner.loading import planned_weights_bytes
from ballast.engine.runner.model_runner import weights_bytes
from ballast.models.arch.builtin import BUILTIN, build_builtin, builtin_config
from ballast.models.layers.fp8 import FP8, Fp8Linear, dequantize_blocks, quantize_blocks
from ballast.models.weights.hf_loader import inspect_hf_dir, load_hf_dir
from test_fp8_checkpoint import BLOCK, reference, write_fp8_checkpoint
from test_hf_loader import HYBRID_IDS, IDS, last_logits, reference_logits, split_experts, write_checkpoint
from test_qwen3_next_parity import random_pair, reference_in_pure_torch  # noqa: F401 - autouse fixture


def test_block_quantization_round_trips_partial_blocks() -> None:
    w = torch.randn(3, 70, 50)  # batched, neither dimension a whole number of blocks
    q, scale = quantize_blocks(w, (32, 16))
    assert q.dtype == FP8 and scale.shape == (3, 3, 4)
    back = dequantize_blocks(q, scale, (32, 16), torch.float32)
    # e4m3 keeps 3 mantissa bits: each value within 1/16 of itself (plus the smallest step)
    assert ((back - w).abs() <= w.abs() / 16 + scale.max() / 8).all()


@pytest.mark.parametrize("block", [BLOCK, (64, 32)])
def test_kept_fp8_llama_equals_transformers_with_fp8_bytes(tmp_path: Path, block: tuple[int, int]) -> None:
    """(64, 32): k_proj and v_proj (32 rows) are not whole blocks, so q/k/v run one by one."""
    dequantized = write_fp8_checkpoint(tmp_path, block)
    ckpt = inspect_hf_dir(tmp_path)
    kept = load_hf_dir(tmp_path, keep_fp8=True)
    attn = kept.model.layers[0].self_attn
    assert isinstance(attn.q_proj, Fp8Linear) and attn.q_proj.weight.dtype == FP8
    assert attn.qkv.separate == (block == (64, 32))
    assert kept.model.embed_tokens.weight.dtype == torch.float32  # not quantized in the checkpoint
    held = weights_bytes(kept)
    assert held == ckpt.weights_bytes(torch.float32, keep_fp8=True)
    assert held < 0.45 * ckpt.weights_bytes(torch.float32) + 4 * kept.model.embed_tokens.weight.numel()
    with torch.no_grad():
        want = reference(dequantized)(torch.tensor([IDS])).logits[0, -1]
    got = last_logits(kept)
    assert (got - want).abs().max().item() < 1e-4
    assert (got - last_logits(load_hf_dir(tmp_path))).abs().max().item() < 1e-5


def quantize_state(state: dict[str, torch.Tensor], block: tuple[int, int]) -> tuple[dict, dict]:
    """Per-expert FP8 checkpoint tensors of a hybrid model's state (every decoder projection
    quantized, experts included), and the dequantized state in the model's own (fused) layout."""
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, t in split_experts(state).items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, scale = quantize_blocks(t, block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, block, t.dtype)
        else:
            tensors[name] = dequantized[name] = t
    for name, t in state.items():  # fuse the experts back for the reference
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj") and prefix.endswith(".mlp.experts"):
            parts = ["gate_proj", "up_proj"] if leaf == "gate_up_proj" else ["down_proj"]
            per = [
                torch.cat([dequantized[f"{prefix}.{e}.{p}.weight"] for p in parts]) for e in range(t.shape[0])
            ]
            dequantized[name] = torch.stack(per)
    return tensors, {k: v for k, v in dequantized.items() if k in state}


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_kept_fp8_hybrid_moe_equals_transformers(tmp_path: Path, arch: str) -> None:
    direct, ref = random_pair(arch)
    block = (16, 32)  # the tiny experts' intermediate size (32) is whole blocks of rows
    tensors, dequantized = quantize_state(direct.state_dict(), block)
    ref.load_state_dict(dequantized)
    config = {
        **ref.config.to_dict(),
        "quantization_config": {"quant_method": "fp8", "weight_block_size": block},
    }
    write_checkpoint(tmp_path, config, tensors)
    kept = load_hf_dir(tmp_path, keep_fp8=True)
    experts = next(m for n, m in kept.named_modules() if n.endswith("mlp.experts"))
    assert experts.gate_up_proj.dtype == FP8 and experts.down_proj_scale_inv.dtype == torch.float32
    assert weights_bytes(kept) == inspect_hf_dir(tmp_path).weights_bytes(torch.float32, keep_fp8=True)
    got = last_logits(kept, HYBRID_IDS)
    assert (got - reference_logits(ref)).abs().max().item() < 1e-4
    assert (got - last_logits(load_hf_dir(tmp_path), HYBRID_IDS)).abs().max().item() < 1e-5


def greedy_run(engine: Engine, steps: int) -> list[int]:
    greedy = SamplingParams(temperature=0.0)
    out = engine.step(
        StepPlan(prefills=(PrefillChunk(0, tuple(IDS), 0, True),), sampling={0: greedy})
    ).outputs
    tokens = [out[0].token_id]
    for pos in range(len(IDS), len(IDS) + steps - 1):
        out = engine.step(StepPlan(decodes=(DecodeToken(0, tokens[-1], pos),), sampling={0: greedy})).outputs
        tokens.append(out[0].token_id)
    return tokens


def test_engine_keeps_fp8_weights_on_request_with_the_same_tokens(tmp_path: Path) -> None:
    """`--fp8-weights keep` on the CPU: float8 weights held (the bytes the engine reports and
    admits), the same greedy tokens as the default there (dequantize at load)."""
    write_fp8_checkpoint(tmp_path)
    ckpt = inspect_hf_dir(tmp_path)
    runs = {}
    for mode in ("keep", "dequantize", "auto"):
        config = EngineConfig(
            model=str(tmp_path), device="cpu", max_num_seqs=1, max_model_len=64, fp8_weights=mode
        )
        engine = Engine.load(config)
        try:
            runs[mode] = (engine.load_report.weights_bytes, greedy_run(engine, 10))
        finally:
            engine.shutdown()
    assert runs["keep"][0] == ckpt.weights_bytes(torch.float32, keep_fp8=True)
    assert runs["dequantize"][0] == runs["auto"][0] == ckpt.weights_bytes(torch.float32)
    assert runs["keep"][1] == runs["dequantize"][1] == runs["auto"][1]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"


def test_flagship_builtins_plan_their_bytes_without_memory() -> None:
    """The 80B-A3B-shaped built-ins: ~160 GB in bf16; the FP8 entry holds its decoder
    projections and experts in float8, so it plans a bit over half of the bf16 bytes (planned on
    the meta device: these tests never allocate them)."""
    bf16 = planned_weights_bytes(builtin_config("qwen3-next-80b-a3b"), torch.bfloat16)
    fp8 = planned_weights_bytes(builtin_config("qwen3-next-80b-a3b-fp8"), torch.bfloat16)
    assert 150e9 < bf16 < 165e9  # ~79B parameters
    assert 0.5 * bf16 < fp8 < 0.53 * bf16  # scales: 4 bytes per 128 x 128 block
    # Its 26-expert twin (one GPU and a tensor-parallel pair side by side): 11.6 GB in bf16.
    assert 11e9 < planned_weights_bytes(builtin_config("qwen3-next-6b"), torch.bfloat16) < 12e9


def test_fp8_builtin_model_runs_on_its_float8_weights() -> None:
    """A built-in with a quantization_config is built with float8 projections and experts and
    random block-scaled values, deterministic per seed, and its forward gives finite logits."""
    cfg = {**builtin_config("tiny-qwen3-next"), "quantization_config": {"weight_block_size": [16, 32]}}
    BUILTIN["tmp-fp8"] = cfg
    try:
        a, b = build_builtin("tmp-fp8"), build_builtin("tmp-fp8")
    finally:
        del BUILTIN["tmp-fp8"]
    experts = next(m for n, m in a.named_modules() if n.endswith("mlp.experts"))
    assert experts.gate_up_proj.dtype == FP8
    assert a.model.layers[3].self_attn.q_proj.weight.dtype == FP8
    assert a.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(last_logits(a, HYBRID_IDS), last_logits(b, HYBRID_IDS))
    assert torch.isfinite(last_logits(a, HYBRID_IDS)).all()
