"""FP8 checkpoints in the Hugging Face fine-grained format load by dequantizing each float8 weight
with its block scales: the model equals transformers' on the dequantized weights (logits, and the
greedy tokens the engine serves); the load admits and reports the model dtype's bytes; a scale
missing or of the wrong grid, or another quantization method, is a clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.models.base import UnsupportedModel, WeightLoadError
from ballast.models.layers.fp8 import dequantize_blocks, quantize_blocks
from ballast.models.weights.hf_loader import inspect_hf_dir, load_hf_dir
from safetensors.torch import save_file
from test_hf_loader import IDS, last_logits, tiny_hf

BLOCK = (32, 32)  # hidden 64, intermediate 96: several blocks per weight, and partial ones


def write_fp8_checkpoint(path: Path, block: tuple[int, int] = BLOCK) -> dict[str, torch.Tensor]:
    """A tiny Llama as an FP8 checkpoint (every decoder linear quantized; embeddings, norms and the
    head kept, as the releases do); returns the dequantized state dict, the reference's weights."""
    hf = tiny_hf(tied=False)
    hf.save_pretrained(path)
    state = hf.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if ".layers." in name and name.endswith("proj.weight"):
            q, scale = quantize_blocks(w, block)
            tensors[name], tensors[name + "_scale_inv"] = q, scale
            dequantized[name] = dequantize_blocks(q, scale, block, torch.float32)
        else:
            tensors[name] = dequantized[name] = w.contiguous()
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


def reference(dequantized: dict[str, torch.Tensor]) -> torch.nn.Module:
    hf = tiny_hf(tied=False)
    hf.load_state_dict(dequantized)
    return hf


def test_fp8_checkpoint_equals_transformers_on_the_dequantized_weights(tmp_path: Path) -> None:
    dequantized = write_fp8_checkpoint(tmp_path)
    ckpt = inspect_hf_dir(tmp_path)
    assert len(ckpt.scales) == 2 * 7 and ckpt.fp8_block == BLOCK  # 7 linears in each of 2 layers
    n_params = sum(t.numel() for t in dequantized.values())
    assert ckpt.weights_bytes(torch.float32) == 4 * n_params  # what the dequantized model holds
    model = load_hf_dir(tmp_path)
    hf = reference(dequantized)
    with torch.no_grad():
        want = hf(torch.tensor([IDS])).logits[0, -1]
    assert (last_logits(model) - want).abs().max().item() < 1e-4
    # The quantization is real: the dequantized weights are not the float32 originals.
    original = tiny_hf(tied=False).state_dict()
    name = "model.layers.0.mlp.down_proj.weight"
    assert not torch.equal(dequantized[name], original[name])


def test_engine_serves_an_fp8_checkpoint_with_the_references_greedy_tokens(tmp_path: Path) -> None:
    dequantized = write_fp8_checkpoint(tmp_path)
    with torch.no_grad():
        want = reference(dequantized).generate(torch.tensor([IDS]), max_new_tokens=12, do_sample=False)[
            0, len(IDS) :
        ]
    engine = Engine.load(EngineConfig(model=str(tmp_path), device="cpu", max_num_seqs=1, max_model_len=64))
    try:
        greedy = SamplingParams(temperature=0.0)
        out = engine.step(
            StepPlan(prefills=(PrefillChunk(0, tuple(IDS), 0, True),), sampling={0: greedy})
        ).outputs
        tokens = [out[0].token_id]
        for pos in range(len(IDS), len(IDS) + 11):
            out = engine.step(
                StepPlan(decodes=(DecodeToken(0, tokens[-1], pos),), sampling={0: greedy})
            ).outputs
            tokens.append(out[0].token_id)
    finally:
        engine.shutdown()
    assert tokens == want.tolist()


def test_bad_fp8_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    write_fp8_checkpoint(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**config, "quantization_config": {"quant_method": "gptq"}})
    )
    with pytest.raises(UnsupportedModel, match="gptq"):
        inspect_hf_dir(tmp_path)
    # The scales of another block size do not fit the weights' grid.
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                **config,
                "quantization_config": {**config["quantization_config"], "weight_block_size": [16, 16]},
            }
        )
    )
    with pytest.raises(WeightLoadError, match="weight_scale_inv"):
        inspect_hf_dir(tmp_path)
