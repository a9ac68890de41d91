"""The Llama family (llama, and qwen2 / qwen3, which differ only in q/k/v bias and per-head q/k
norms), over the slot state."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ballast.memory.specs import LayerSpec
from ballast.models.arch.decoder import (
    POSITIVE,
    DecoderLayer,
    DecoderLM,
    DecoderModel,
    check_dims,
    check_hf,
    eos_ids,
    hf_ints,
    hf_key,
)
from ballast.models.base import UnsupportedModel
from ballast.models.kernels.cpu_kernel import kernel_fits
from ballast.models.layers.core import (
    LayerStep,
    Linear,
    RMSNorm,
    RopeParams,
    RotaryEmbedding,
    SlotAttention,
    SwiGLU,
)
from ballast.models.layers.cpu_blocks import BlockDecoder, BlockLinear
from ballast.models.layers.packed import Q4Weight, Q8Weight, QuantizedPair, drop_dense
from ballast.models.layers.state import LayerState, PagedKV, attention_spec
from torch import Tensor

LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int = field(metadata=hf_key())
    hidden_size: int = field(metadata=hf_key())
    intermediate_size: int = field(metadata=hf_key())
    num_hidden_layers: int = field(metadata=hf_key())
    num_attention_heads: int = field(metadata=hf_key())
    num_key_value_heads: int = field(metadata=POSITIVE)
    head_dim: int = field(metadata=POSITIVE)
    rms_norm_eps: float
    rope: RopeParams
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_dims(self)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        model_type = str(hf.get("model_type", "llama"))
        check_hf(hf, model_type, LLAMA_FAMILY)
        # A sliding window that is configured but switched off (qwen2/3: use_sliding_window false,
        # mistral: sliding_window null) is plain causal attention; an active one we do not implement.
        window_on = hf.get("use_sliding_window", model_type == "mistral") and hf.get("sliding_window")
        if window_on:
            raise UnsupportedModel(
                f"sliding-window attention ({model_type}, window {hf['sliding_window']}) is not supported"
            )
        ints = hf_ints(cls, hf)
        heads, hidden = ints["num_attention_heads"], ints["hidden_size"]
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            **ints,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hidden // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeParams.from_hf(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # qwen2 always has q/k/v bias and none on o; llama's attention_bias covers all four.
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids(hf.get("eos_token_id")),
        )


# The blocks the CPU holds packed: the matmuls reading the block's input, then its output's.
_Q4_BLOCKS = (("self_attn", ("q", "k", "v", "o")), ("mlp", ("gate", "up", "down")))


def q4_blocks(q4: Collection[str], names: Collection[str]) -> list[tuple[int, str, list[str]]]:
    """(layer, block, weight names) of each block whose every weight is in `q4` (4-bit in the
    file) and none has a bias among `names`: a block is held packed whole or not at all."""
    layers = {int(n.split(".")[2]) for n in q4 if n.startswith("model.layers.")}
    out = []
    for i in sorted(layers):
        for where, parts in _Q4_BLOCKS:
            weights = [f"model.layers.{i}.{where}.{p}_proj.weight" for p in parts]
            biased = any(w.removesuffix("weight") + "bias" in names for w in weights)
            if all(w in q4 for w in weights) and not biased:
                out.append((i, where, weights))
    return out


class LlamaDecoderLayer(DecoderLayer):
    mlp: SwiGLU

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = SlotAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            qkv_bias=cfg.qkv_bias,
            o_bias=cfg.o_bias,
            qk_norm_eps=cfg.rms_norm_eps if cfg.qk_norm else None,
        )
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, x: Tensor, step: LayerStep, state: LayerState) -> Tensor:
        if not isinstance(state, PagedKV):
            raise TypeError(f"a Llama layer needs a PagedKV, got {type(state).__name__}")
        return self.self_attn(x, step, state)


class LlamaForCausalLM(DecoderLM):
    # A step's rows meet only in attention, which reads real tokens only: padding rows of a prefill
    # graph cannot change a real row (`engine/prefill_graphs`).
    prefill_graphs_safe = True

    def __init__(self, config: LlamaConfig) -> None:
        c = config
        layers = (LlamaDecoderLayer(c) for _ in range(c.num_hidden_layers))
        norm, rope = RMSNorm(c.hidden_size, c.rms_norm_eps), RotaryEmbedding(c.rope, c.head_dim)
        model = DecoderModel(c.vocab_size, c.hidden_size, layers, norm, rope)
        super().__init__(c, model, Linear(c.hidden_size, c.vocab_size, bias=False))

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> LlamaForCausalLM:
        return cls(LlamaConfig.from_hf(hf))

    def hold_blocks(self, held: Mapping[str, Q4Weight | Q8Weight], decode_threads: int = 1) -> int:
        """Run the blocks `q4_blocks` finds in `held` (a GGUF's packed weights by HF name) through
        block linears (models/layers/cpu_blocks.py), and the output head too where its blocks are in
        `held`; a stack of them all decodes in one call on up to `decode_threads`. Returns the
        blocks converted."""
        q4 = {n: w for n, w in held.items() if isinstance(w, Q4Weight)}
        blocks = q4_blocks(q4, set())
        for i, where, names in blocks:
            layer = self.model.layers[i]
            assert isinstance(layer, LlamaDecoderLayer)
            parts = [q4[n] for n in names]
            block = layer.self_attn if where == "self_attn" else layer.mlp
            block.quantize(QuantizedPair(BlockLinear(parts[:-1]), BlockLinear(parts[-1:])))
        tied = self.config.tie_word_embeddings  # a tied head's weight is the embedding table
        head = held.get("model.embed_tokens.weight" if tied else "lm_head.weight")
        if head is not None:
            self.quantized_head = BlockLinear(head if isinstance(head, Q8Weight) else [head])
            if not tied:
                drop_dense(self.lm_head)
        c, layers, head = self.config, list(self.model.layers), self.quantized_head
        whole = len(blocks) == 2 * len(layers) and c.rope.partial_rotary_factor == 1.0 and not c.qk_norm
        if whole and isinstance(head, BlockLinear) and kernel_fits(c.head_dim):  # all of a step in one call
            shape = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, decode_threads)
            self.block_decoder = BlockDecoder(layers, head, self.model.norm.weight, *shape)
        return len(blocks)

    def layer_specs(self, kv_dtype_bytes: int) -> list[LayerSpec]:
        c = self.config
        return [
            attention_spec(c.num_key_value_heads, c.head_dim, kv_dtype_bytes)
            for _ in range(c.num_hidden_layers)
        ]
