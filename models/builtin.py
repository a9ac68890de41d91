"""Random-init models built into ballast (`--model builtin:NAME`) for tests and benchmarks.

Each entry is an HF-style config dict plus `seed`; the same name always gives the same weights.
The vocabulary matches SmolLM2's tokenizer (49152), so the default model's tokenizer can drive
them. Append new entries; keep the literal plain."""

from __future__ import annotations

from typing import Any

import torch
from ballast.models.base import UnsupportedModel
from ballast.models.registry import build_model
from torch import nn

PREFIX = "builtin:"
_SMOLLM2_VOCAB = 49152

# What the two tiny hybrid models share (a mix of layer types, MoE, partial rotary).
_TINY_HYBRID: dict[str, Any] = {
    "vocab_size": _SMOLLM2_VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "seed": 0,
}

BUILTIN: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama",
        "vocab_size": _SMOLLM2_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "seed": 0,
    },
    "tiny-qwen3": {
        "model_type": "qwen3",
        "vocab_size": _SMOLLM2_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "seed": 0,
    },
    "tiny-qwen3-next": {
        # Hybrid: three gated-DeltaNet layers per full-attention layer, MoE everywhere but layer 1.
        **_TINY_HYBRID,
        "model_type": "qwen3_next",
        "intermediate_size": 128,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
    },
    "tiny-qwen3.5-moe": {
        # Text model of Qwen3.5-MoE: separate linear-attention projections, every layer MoE.
        **_TINY_HYBRID,
        "model_type": "qwen3_5_moe_text",
    },
}


def builtin_config(name: str) -> dict[str, Any]:
    """The config of `builtin:NAME` (the prefix is optional); a copy, safe to change."""
    key = name.removeprefix(PREFIX)
    if key not in BUILTIN:
        raise UnsupportedModel(
            f"no built-in model {name!r}; built in: {', '.join(PREFIX + n for n in sorted(BUILTIN))}"
        )
    return dict(BUILTIN[key])


def init_random(model: nn.Module, seed: int) -> None:
    """Seeded init on the CPU generator (the same weights on any device): norms 1, biases 0, other
    tensors N(0, 0.02) like HF's initializer_range. A model with parameters that need their own
    rule (e.g. a decay's A_log) provides `init_random_weights(generator)`, called afterwards."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        own = getattr(model, "init_random_weights", None)
        if own is not None:
            own(gen)


def build_builtin(
    name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> nn.Module:
    cfg = builtin_config(name)
    model = build_model(cfg, dtype=dtype, device=device)
    init_random(model, int(cfg.get("seed", 0)))
    return model
