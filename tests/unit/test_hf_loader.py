"""HF directory loading: transformers' save_pretrained output (single and sharded safetensors)
loads into our models with identical logits; mismatches are typed errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from ballast.models.base import ConfigError, ForwardBatch, UnsupportedModel, WeightLoadError
from ballast.models.builtin import BUILTIN, build_builtin, builtin_config
from ballast.models.hf_loader import INDEX_FILE, inspect_hf_dir, load_hf_dir, load_hf_model
from ballast.models.registry import MODEL_CLASSES, build_model
from ballast.models.state import allocate_states
from safetensors.torch import save_file
from torch import nn

IDS = [5, 17, 2, 99, 64, 3, 8]


def tiny_hf(tied: bool, model_type: str = "llama") -> nn.Module:
    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[model_type]
    cfg = cls(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@torch.no_grad()
def last_logits(model: nn.Module, ids: list[int] = IDS) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    states = allocate_states(model.layer_specs(4), 1, 32, "cpu", dtype)
    return model(ForwardBatch.build([(0, ids, 0)], "cpu"), states)[0]


@pytest.mark.parametrize(("tied", "shard", "model_type"), [
    (True, None, "llama"), (False, None, "llama"), (True, "40KB", "llama"), (False, "60KB", "qwen3"),
])
def test_save_pretrained_round_trip(tmp_path: Path, tied: bool, shard: str | None, model_type: str) -> None:
    hf = tiny_hf(tied, model_type)
    kwargs = {"max_shard_size": shard} if shard else {}
    hf.save_pretrained(tmp_path, **kwargs)
    assert (tmp_path / INDEX_FILE).is_file() == bool(shard)
    ckpt = inspect_hf_dir(tmp_path)
    n_params = sum(p.numel() for p in hf.parameters())  # parameters() counts a tied tensor once
    assert ckpt.weights_bytes(torch.float32) == 4 * n_params
    assert ckpt.weights_bytes(torch.bfloat16) == 2 * n_params
    assert 0 < ckpt.transient_bytes() < ckpt.files_bytes  # a bounded read-ahead, not the whole checkpoint
    model = load_hf_model(ckpt)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    # Identical to the same weights loaded in memory, and to the reference within float error.
    direct = build_model(hf.config.to_dict())
    direct.load_state_dict(hf.state_dict())
    assert torch.equal(last_logits(model), last_logits(direct))
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0, -1]
    assert (last_logits(model) - ref).abs().max().item() < 1e-4


def test_bf16_checkpoint_casts_to_requested_dtype(tmp_path: Path) -> None:
    hf = tiny_hf(False).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    model = load_hf_dir(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, hf.model.layers[1].mlp.up_proj.weight.float())
    as_bf16 = load_hf_dir(tmp_path, dtype=torch.bfloat16)
    assert as_bf16.lm_head.weight.dtype == torch.bfloat16


def test_missing_and_unexpected_tensors_are_typed_errors(tmp_path: Path) -> None:
    hf = tiny_hf(False)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match="missing"):
        load_hf_dir(tmp_path)
    cfg["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightLoadError, match="unexpected"):
        load_hf_dir(tmp_path)


def test_wrong_shape_is_a_typed_error(tmp_path: Path) -> None:
    hf = tiny_hf(False)
    hf.save_pretrained(tmp_path)
    sd = {k: v.clone().contiguous() for k, v in hf.state_dict().items()}
    sd["model.norm.weight"] = torch.ones(63)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="model.norm.weight"):
        load_hf_dir(tmp_path)


def test_directory_problems_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadError):
        inspect_hf_dir(tmp_path / "absent")
    with pytest.raises(ConfigError):
        inspect_hf_dir(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(WeightLoadError, match="safetensors"):
        inspect_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError):
        inspect_hf_dir(tmp_path)


def test_unknown_model_type_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModel) as err:
        build_model({"model_type": "gpt2", "vocab_size": 10})
    for name in MODEL_CLASSES:
        assert name in str(err.value)
    with pytest.raises(ConfigError, match="lacks"):
        build_model({"model_type": "llama", "vocab_size": 10})
    with pytest.raises(UnsupportedModel, match="sliding"):
        build_model(dict(builtin_config("tiny-llama"), model_type="mistral", sliding_window=4096))
    with pytest.raises(UnsupportedModel, match="rope"):
        build_model(dict(builtin_config("tiny-llama"), rope_parameters={"rope_type": "yarn", "factor": 2.0}))


def test_builtins_are_deterministic_and_distinct() -> None:
    assert "tiny-llama" in BUILTIN
    a, b = build_builtin("builtin:tiny-llama"), build_builtin("tiny-llama")
    assert torch.equal(last_logits(a), last_logits(b))
    assert torch.isfinite(last_logits(a)).all()
    c = build_builtin("tiny-qwen3")
    assert c.config.qk_norm and not a.config.qk_norm
    with pytest.raises(UnsupportedModel, match="builtin:tiny-llama"):
        build_builtin("builtin:nope")
