"""Random-init models built into ballast (`--model builtin:NAME`) for tests and benchmarks.

Each entry is an HF-style config dict plus `seed`; the same name always gives the same weights.
The vocabulary matches SmolLM2's tokenizer (49152), so the default model's tokenizer can drive
them. Append new entries; keep the literal plain."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from ballast.models.arch.registry import build_model, without_mtp
from ballast.models.base import UnsupportedModel
from ballast.models.layers import fp8
from torch import nn

PREFIX = "builtin:"
# What every entry shares: SmolLM2's vocabulary and special ids, and the seed of its weights.
_COMMON: dict[str, Any] = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "seed": 0}

# What the two tiny hybrid models share (a mix of layer types, MoE, partial rotary).
_TINY_HYBRID: dict[str, Any] = {
    **_COMMON,
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
}

_TINY_LLAMA: dict[str, Any] = {
    "model_type": "llama",
    **_COMMON,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": True,
}
_LLAMA_8B: dict[str, Any] = {
    **_TINY_LLAMA,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "tie_word_embeddings": False,
}
_QWEN3_NEXT_80B: dict[str, Any] = {
    "model_type": "qwen3_next",
    **_COMMON,
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "num_hidden_layers": 48,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 12,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-06,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
}
# Above this many parameters a built-in model is initialised by the generator of its own device:
# the CPU generator would take minutes for an 8B model and hours for an 80B one.
DEVICE_INIT_PARAMS = 2_000_000_000

BUILTIN: dict[str, dict[str, Any]] = {
    "tiny-llama": _TINY_LLAMA,
    "tiny-qwen3": {
        **_TINY_LLAMA,
        "model_type": "qwen3",
        "head_dim": 32,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "tiny-qwen3-next": {
        # Hybrid: three gated-DeltaNet layers per full-attention layer, MoE everywhere but layer 1.
        **_TINY_HYBRID,
        "model_type": "qwen3_next",
        "intermediate_size": 128,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "num_nextn_predict_layers": 1,  # a random MTP layer, built when drafting asks for it
    },
    # Llama-3.2-1B's shape: big enough that KV and the GPU's memory matter (32 KiB of KV a token).
    "llama-1b": {
        **_LLAMA_8B,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "tie_word_embeddings": True,
    },
    # Llama-3.1-8B's shape (SmolLM2's vocabulary: 7.5B parameters), for benchmarks; -fp8 holds its
    # decoder projections in float8 with 128 x 128 block scales.
    "llama-8b": _LLAMA_8B,
    "llama-8b-fp8": {
        **_LLAMA_8B,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    },
    # Qwen3-Next-80B-A3B's published config but SmolLM2's vocabulary (0.6% of the weights). ~160 GB
    # in bf16: two H200s with tensor parallel, or the -fp8 entry (as the FP8 release) on one.
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B,
    # The same shapes with 26 of the 512 experts (5.8B parameters, 11.6 GB in bf16): fits one GPU,
    # so one GPU and a tensor-parallel pair can serve the same shape side by side.
    "qwen3-next-6b": {**_QWEN3_NEXT_80B, "num_experts": 26},
    # The 6B cut in FP8 as the 80B's release holds it: the 80B's FP8 kernels at a size one load
    # takes seconds.
    "qwen3-next-6b-fp8": {
        **_QWEN3_NEXT_80B,
        "num_experts": 26,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    },
    "qwen3-next-80b-a3b-fp8": {
        **_QWEN3_NEXT_80B,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    },
    "tiny-qwen3.5-moe": {
        # Text model of Qwen3.5-MoE: separate linear-attention projections, every layer MoE.
        **_TINY_HYBRID,
        "model_type": "qwen3_5_moe_text",
    },
}


def builtin_config(name: str, mtp: bool = False) -> dict[str, Any]:
    """The config of `builtin:NAME` (the prefix is optional); a copy, safe to change. mtp: keep
    its multi-token-prediction layers (else `num_nextn_predict_layers` is 0: none built)."""
    key = name.removeprefix(PREFIX)
    if key not in BUILTIN:
        raise UnsupportedModel(
            f"no built-in model {name!r}; built in: {', '.join(PREFIX + n for n in sorted(BUILTIN))}"
        )
    return without_mtp(dict(BUILTIN[key]), mtp)


def init_random(model: nn.Module, seed: int) -> None:
    """Seeded init: norms 1, biases 0, others N(0, 0.02) like HF's initializer_range, on the CPU
    generator (the same weights on any device) up to DEVICE_INIT_PARAMS; past it on the device, in
    place: a float32 draw and its scaled copy per tensor took 1.5 GiB more of the device for the 8B's
    embedding alone, a start's transient no real checkpoint has. A model's own rules (e.g. a decay's
    A_log) come after, from its `init_random_weights(generator)`."""
    first = next(model.parameters())
    big = sum(p.numel() for p in model.parameters()) > DEVICE_INIT_PARAMS
    gen = torch.Generator(first.device if big else "cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == fp8.FP8 or name.endswith("_scale_inv"):
                continue
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif big:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=gen.device) * 0.02)
        fp8.init_random_fp8(model, gen)
        own = getattr(model, "init_random_weights", None)
        if own is not None:
            own(gen)


def fp8_weights(cfg: dict[str, Any]) -> tuple[Callable[[str], bool], fp8.Block] | None:
    """What of a built-in model is float8 (its decoder projections), or None."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return None
    rows, cols = quant["weight_block_size"]
    return fp8.decoder_projection, (rows, cols)


def build_builtin(
    name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", mtp: bool = False
) -> nn.Module:
    cfg = builtin_config(name, mtp)
    model = build_model(cfg, dtype=dtype, device=device, fp8=fp8_weights(cfg))
    init_random(model, int(cfg.get("seed", 0)))
    return model
