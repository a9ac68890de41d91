"""What the decoder-only architectures share: reading an HF config's common fields, and the forward
over the layer states. Each architecture supplies its layers' mixers (`DecoderLayer.mix`) and what
its layers share in a step (`DecoderLM.layer_step`)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

from ballast.models.base import ForwardBatch, ModelConfigError, UnsupportedModel
from ballast.models.layers.core import (
    FusedLinears,
    LayerStep,
    RMSNorm,
    Rope,
    RotaryEmbedding,
    token_embedding,
)
from ballast.models.layers.cpu_blocks import BlockDecoder
from ballast.models.layers.state import LayerState, PagedKV
from torch import Tensor, nn


def hf_int(hf: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = hf.get(key, default)
    if value is None:
        raise ModelConfigError(f"model config lacks {key!r}")
    return int(value)


def eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def check_hf(hf: Mapping[str, Any], model_type: str, supported: Sequence[str]) -> None:
    """The architecture is one of `supported`, and its MLPs' activation silu."""
    if model_type not in supported:
        raise UnsupportedModel(f"model_type {model_type!r} is not one of {', '.join(supported)}")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only silu)")


POSITIVE = {"positive": True}  # the metadata of a config field that must be > 0


def hf_key(default: int | None = None, positive: bool = True) -> dict[str, Any]:
    """The metadata of a config field `hf_ints` reads from the HF key of its name (default None:
    required); positive: `check_dims` checks it is > 0."""
    return {"hf_default": default, "positive": positive}


def hf_ints(cls: Any, hf: Mapping[str, Any]) -> dict[str, int]:
    """Every `hf_key` field of the config dataclass cls, read from hf."""
    return {
        f.name: hf_int(hf, f.name, f.metadata["hf_default"])
        for f in fields(cls)
        if "hf_default" in f.metadata
    }


def check_dims(cfg: Any) -> None:
    """Every POSITIVE field of the config dataclass is > 0, and the query heads are whole KV groups."""
    for f in fields(cfg):
        if f.metadata.get("positive") and getattr(cfg, f.name) <= 0:
            raise ModelConfigError(f"{f.name} must be > 0, got {getattr(cfg, f.name)}")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")


class DecoderLayer(nn.Module):
    """A mixer (attention, or linear attention) and an MLP, each after its norm, HF names."""

    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    mlp: nn.Module

    def mix(self, x: Tensor, step: LayerStep, state: LayerState) -> Tensor:
        raise NotImplementedError

    def forward(
        self, h: Tensor, pending: Tensor | None, step: LayerStep, state: LayerState
    ) -> tuple[Tensor, Tensor]:
        """(residual stream, this layer's MLP output still to add): each residual add runs with
        the norm after it (`add_norm`); pending is the last layer's MLP output (None first)."""
        if pending is None:
            x = self.input_layernorm(h)
        else:
            h, x = self.input_layernorm.add_norm(h, pending)
        h, x = self.post_attention_layernorm.add_norm(h, self.mix(x, step, state))
        return h, self.mlp(x)


class DecoderModel(nn.Module):
    """The stack under HF's `model.` names."""

    def __init__(
        self, vocab: int, hidden: int, layers: Iterable[DecoderLayer], norm: RMSNorm, rope: RotaryEmbedding
    ) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rope


class DecoderLM(nn.Module):
    """A decoder-only language model over the slot states, under the HF checkpoints' names."""

    def __init__(self, config: Any, model: DecoderModel, lm_head: nn.Linear) -> None:
        super().__init__()
        self.config = config
        self.model = model
        self.lm_head = lm_head
        self.quantized_head: nn.Module | None = None  # the CPU's block head, where held
        self.block_decoder: BlockDecoder | None = None  # the CPU's one-call decode step, where held
        # Layer states past the decoder's (a drafting layer's KV, `layer_specs` lists them last);
        # where there are any, `last_hidden` keeps each forward's normed hidden states, every row.
        self.extra_states = 0
        self.last_hidden: Tensor | None = None
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the output head when the config says so (call after loading
        weights with assign=True, which replaces the embedding's parameter)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def fuse_projections(self, keep_values: bool = True, device: str | None = None) -> None:
        """Run every `FusedLinears` of the layers as one matmul. build_model does this on the meta
        device with the model's device (keep_values=False: nothing to copy; each fused weight made
        there once, its linears views); loading with copy_ keeps the fusion, and a forward re-fuses
        after anything re-creates the parameters."""
        for module in self.modules():
            for fused in vars(module).values():
                if isinstance(fused, FusedLinears):
                    fused.fuse(keep_values, device)

    def layer_step(self, batch: ForwardBatch, rope: Rope) -> LayerStep:
        return LayerStep(batch, rope)

    def forward(self, batch: ForwardBatch, states: Sequence[LayerState]) -> Tensor:
        """Logits [B, vocab] (float32) at each sequence's last token; updates states in place."""
        layers = self.model.layers
        if len(states) != len(layers) + self.extra_states:
            raise ValueError(f"{len(states)} layer states for {len(layers)} layers")
        states = states[: len(layers)]
        h = self.model.embed_tokens(batch.token_ids)
        cos, sin = self.model.rotary_emb(batch.positions, h.dtype)
        fused, first = self.block_decoder, states[0]
        stores = first.attention.step_stores(batch) if fused and isinstance(first, PagedKV) else []
        if fused is not None and fused.serves(batch, stores):  # the whole step in one kernel call
            return fused(h, batch, cos, sin, stores[0])
        step, pending = self.layer_step(batch, Rope(cos, sin)), None
        for layer, state in zip(layers, states, strict=True):
            h, pending = layer(h, pending, step, state)
        if pending is not None:
            h = h + pending
        # the final norm and the (large) head only for the rows asked for (last tokens; prompt logprobs)
        head = self.lm_head if self.quantized_head is None else self.quantized_head
        if self.extra_states:
            self.last_hidden = normed = self.model.norm(h)
            return head(normed if batch.decode_only else normed.index_select(0, batch.logit_index)).float()
        if not batch.decode_only:
            h = h.index_select(0, batch.logit_index)
        return head(self.model.norm(h)).float()
