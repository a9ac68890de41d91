"""HF directory loading: transformers' save_pretrained output (single and sharded safetensors)
loads into our models with identical logits; mismatches are typed errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from ballast.engine.config import EngineConfig
from ballast.engine.runner.loading import load
from ballast.models.arch.builtin import BUILTIN, build_builtin, builtin_config
from ballast.models.arch.registry import MODEL_CLASSES, build_model
from ballast.models.base import ForwardBatch, ModelConfigError, UnsupportedModel, WeightLoadError
from ballast.models.layers.state import allocate_states
from ballast.models.weights.hf_loader import INDEX_FILE, inspect_hf_dir, load_hf_dir, load_hf_model
from safetensors.torch import save_file
from torch import nn

IDS = [5, 17, 2, 99, 64, 3, 8]


def tiny_hf(tied: bool, model_type: str = "llama") -> nn.Module:
    torch.manual_seed(0)
    cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[model_type]
    cfg = cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@torch.no_grad()
def last_logits(model: nn.Module, ids: list[int] = IDS) -> torch.Tensor:
    dtype = next(model.parameters()).dtype
    states = allocate_states(model.layer_specs(4), 1, 32, "cpu", dtype)
    return model(ForwardBatch.build([(0, ids, 0)], "cpu"), states)[0]


@pytest.mark.parametrize(
    ("tied", "shard", "model_type"),
    [
        (True, None, "llama"),
        (False, None, "llama"),
        (True, "40KB", "llama"),
        (False, "60KB", "qwen3"),
    ],
)
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
    assert torch.equal(
        model.model.layers[1].mlp.up_proj.weight, hf.model.layers[1].mlp.up_proj.weight.float()
    )
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
    with pytest.raises(ModelConfigError):
        inspect_hf_dir(tmp_path)  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(WeightLoadError, match="safetensors"):
        inspect_hf_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError):
        inspect_hf_dir(tmp_path)


def test_unknown_model_type_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModel) as err:
        build_model({"model_type": "gpt2", "vocab_size": 10})
    for name in MODEL_CLASSES:
        assert name in str(err.value)
    with pytest.raises(ModelConfigError, match="lacks"):
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


# ---- hybrid MoE checkpoints: per-expert tensors, checkpoint_key, tensors the model does not use --

# The parity module's tiny configs and random weights; its autouse fixture keeps the reference on
# transformers' pure-torch kernels (imported here, it applies to this module's tests too).
from test_qwen3_next_parity import ARCHS, random_pair, reference_in_pure_torch  # noqa: E402, F401

HYBRID_IDS = [5, 17, 2, 90, 64, 3, 8, 41]
# tensors a published checkpoint carries that the text model does not load
UNUSED = {"mtp.fc.weight": (8, 4), "mtp.layers.0.input_layernorm.weight": (4,)}
VISUAL = {"model.visual.patch_embed.proj.weight": (4, 3), "model.visual.blocks.0.attn.qkv.weight": (6, 4)}


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors -> the per-expert layout (`mlp.experts.{e}.{gate,up,down}_proj.weight`)."""
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts") and leaf == "gate_up_proj":
            half = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half].clone()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:].clone()
        elif prefix.endswith(".mlp.experts") and leaf == "down_proj":
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t.clone().contiguous()
    return out


def write_checkpoint(
    path: Path, config: dict[str, object], tensors: dict[str, torch.Tensor], shards: int = 1
) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    if shards > 1:
        (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@torch.no_grad()
def reference_logits(reference: Any) -> torch.Tensor:
    return reference(torch.tensor([HYBRID_IDS])).logits[0, -1]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def hybrid(request: pytest.FixtureRequest) -> tuple[str, nn.Module, Any]:
    """(arch, ours with the weights loaded in memory, the transformers reference)."""
    return (request.param, *random_pair(request.param))


def test_hybrid_save_pretrained_loads_with_identical_logits(
    tmp_path: Path, hybrid: tuple[str, nn.Module, Any]
) -> None:
    _, direct, reference = hybrid
    reference.save_pretrained(tmp_path)
    ckpt = inspect_hf_dir(tmp_path)
    model = load_hf_model(ckpt)
    assert ckpt.weights_bytes(torch.float32) == 4 * sum(p.numel() for p in model.parameters())
    assert torch.equal(last_logits(model, HYBRID_IDS), last_logits(direct, HYBRID_IDS))
    assert (last_logits(model, HYBRID_IDS) - reference_logits(reference)).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_hybrid_checkpoint_layouts_with_unused_tensors(
    tmp_path: Path, hybrid: tuple[str, nn.Module, Any], layout: str
) -> None:
    """Hand-written checkpoints: experts stored one by one or fused, sharded, with a
    multi-token-prediction head; Qwen3.5 as the full multimodal checkpoint (language model under
    `model.language_model.`, a vision tower, the text config nested)."""
    arch, direct, reference = hybrid
    state = direct.state_dict()
    tensors = split_experts(state) if layout == "per_expert" else {k: v.clone() for k, v in state.items()}
    if layout == "per_expert":
        assert not any(k.endswith("gate_up_proj") for k in tensors)
    unused = dict(UNUSED)
    config = reference.config.to_dict()
    if arch == "qwen3_5_moe_text":
        tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
                   for k, v in tensors.items()}  # fmt: skip
        unused.update(VISUAL)
        config = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                  "text_config": config, "vision_config": {"depth": 1},
                  "tie_word_embeddings": False}  # fmt: skip
    tensors.update({name: torch.randn(shape) for name, shape in unused.items()})
    write_checkpoint(tmp_path, config, tensors, shards=2)
    ckpt = inspect_hf_dir(tmp_path)
    assert not set(unused) & set(ckpt.tensors)  # left out of the byte figures too
    assert ckpt.weights_bytes(torch.float32) == 4 * sum(t.numel() for t in state.values())
    model = load_hf_model(ckpt)
    for name, p in direct.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    assert torch.equal(last_logits(model, HYBRID_IDS), last_logits(direct, HYBRID_IDS))
    assert (last_logits(model, HYBRID_IDS) - reference_logits(reference)).abs().max().item() < 1e-4


def test_per_expert_mismatches_are_typed_errors(tmp_path: Path) -> None:
    direct, reference = random_pair("qwen3_next")
    config = reference.config.to_dict()  # type: ignore[union-attr, operator]
    good = split_experts(direct.state_dict())
    expert = "model.layers.0.mlp.experts"

    def load_with(tensors: dict[str, torch.Tensor]) -> None:
        write_checkpoint(tmp_path, config, tensors)
        load_hf_dir(tmp_path)

    with pytest.raises(WeightLoadError, match=r"missing \['model.layers.0.mlp.experts.gate_up_proj'\]"):
        load_with({k: v for k, v in good.items() if k != f"{expert}.3.up_proj.weight"})
    with pytest.raises(
        WeightLoadError, match=r"unexpected \['model.layers.0.mlp.experts.8.down_proj.weight'\]"
    ):
        load_with({**good, f"{expert}.8.down_proj.weight": good[f"{expert}.0.down_proj.weight"].clone()})
    with pytest.raises(WeightLoadError, match=f"{expert}.2.gate_proj.weight: checkpoint shape"):
        load_with({**good, f"{expert}.2.gate_proj.weight": torch.zeros(3, 64)})
    with pytest.raises(WeightLoadError, match=r"filled twice \['model.layers.0.mlp.experts.down_proj'\]"):
        load_with({**good, f"{expert}.down_proj": direct.state_dict()[f"{expert}.down_proj"].clone()})


def test_engine_loads_a_hybrid_checkpoint_directory(
    tmp_path: Path, hybrid: tuple[str, nn.Module, Any]
) -> None:
    """The engine's load path (admission figures from inspect_hf_dir, then load_hf_model) on a
    transformers-written directory."""
    _, direct, reference = hybrid
    reference.save_pretrained(tmp_path)
    loaded = load(EngineConfig(model=str(tmp_path)), torch.device("cpu"), torch.float32)
    assert loaded.weights_bytes == 4 * sum(p.numel() for p in direct.parameters())
    assert torch.equal(last_logits(loaded.model, HYBRID_IDS), last_logits(direct, HYBRID_IDS))
