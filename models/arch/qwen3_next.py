"""Qwen3-Next: gated DeltaNet linear-attention layers interleaved with gated full attention, and
sparse MoE MLPs with a shared expert. Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`) differs in separate
plain q|k|v linear-attention projections instead of per-key-head interleaved ones, and MoE in every
layer; its mrope reduces to ordinary partial rotary for text (every position axis is the same).

Full-attention layers read a `PagedKV`, linear-attention layers a `RecurrentState`; the engine sees
only `layer_specs` and `forward(batch, states)`, so nothing outside this file knows it is hybrid.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from ballast.memory.specs import LayerSpec, RecurrentStateSpec
from ballast.models.arch.decoder import (
    DecoderLayer,
    DecoderLM,
    DecoderModel,
    check_dims,
    check_hf,
    eos_ids,
    hf_int,
    hf_ints,
    hf_key,
)
from ballast.models.arch.mtp import MultiTokenPredictor
from ballast.models.base import ForwardBatch, ModelConfigError
from ballast.models.blocks.gated_delta import GatedDeltaNet, HybridStep
from ballast.models.blocks.moe import SparseMoeBlock
from ballast.models.layers import pointwise
from ballast.models.layers.core import (
    FusedLinears,
    LayerStep,
    RMSNorm,
    Rope,
    RopeParams,
    RotaryEmbedding,
    SwiGLU,
)
from ballast.models.layers.state import LayerState, PagedKV, attention_spec, dtype_bytes
from torch import Tensor, nn

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridConfig:
    """The Qwen3-Next / Qwen3.5-MoE text config; defaults are the reference configs' defaults."""

    model_type: str
    vocab_size: int = field(metadata=hf_key())
    hidden_size: int = field(metadata=hf_key())
    num_hidden_layers: int = field(metadata=hf_key())
    num_attention_heads: int = field(metadata=hf_key())
    num_key_value_heads: int = field(metadata=hf_key(2))
    head_dim: int = field(metadata=hf_key(256))
    rms_norm_eps: float
    rope: RopeParams
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int = field(metadata=hf_key(4))
    linear_key_head_dim: int = field(metadata=hf_key(128))
    linear_value_head_dim: int = field(metadata=hf_key(128))
    linear_num_key_heads: int = field(metadata=hf_key(16))
    linear_num_value_heads: int = field(metadata=hf_key(32))
    num_experts: int = field(metadata=hf_key(512, positive=False))
    num_experts_per_tok: int = field(metadata=hf_key(10, positive=False))
    moe_intermediate_size: int = field(metadata=hf_key(512, positive=False))
    shared_expert_intermediate_size: int = field(metadata=hf_key(512, positive=False))
    norm_topk_prob: bool
    intermediate_size: int = field(metadata=hf_key(5632, positive=False))  # dense-MLP layers (0: none)
    decoder_sparse_step: int = field(metadata=hf_key(1))
    mlp_only_layers: tuple[int, ...]
    # Multi-token-prediction layers (`mtp.*`, models/arch/mtp.py); 0 unless drafting with them.
    num_nextn_predict_layers: int = field(metadata=hf_key(0, positive=False))
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_dims(self)
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ModelConfigError(
                f"layer_types must name {self.num_hidden_layers} layers of {LINEAR!r} / {FULL!r}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ModelConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if any(self.is_sparse(i) for i in range(self.num_hidden_layers)) and not (
            0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size > 0
        ):
            raise ModelConfigError(
                "MoE layers need 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0"
            )
        if not all(self.is_sparse(i) for i in range(self.num_hidden_layers)) and self.intermediate_size <= 0:
            raise ModelConfigError("dense MLP layers need intermediate_size > 0")

    def is_sparse(self, index: int) -> bool:
        return (
            index not in self.mlp_only_layers
            and self.num_experts > 0
            and (index + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf(
        cls, hf: Mapping[str, Any], model_types: tuple[str, ...], all_sparse: bool = False
    ) -> HybridConfig:
        """From an HF config dict (Qwen3.5's may nest it in text_config); all_sparse: MoE everywhere."""
        if isinstance(hf.get("text_config"), Mapping):
            outer = hf
            hf = {**hf["text_config"]}
            hf.setdefault("tie_word_embeddings", outer.get("tie_word_embeddings", False))
        model_type = str(hf.get("model_type"))
        check_hf(hf, model_type, model_types)
        ints = hf_ints(cls, hf)
        if all_sparse:
            # Qwen3.5's MTP layer is not built (its tensors are dropped): no drafting from it.
            ints.update(intermediate_size=0, decoder_sparse_step=1, num_nextn_predict_layers=0)
        kinds = hf.get("layer_types")
        if kinds is None:
            interval = hf_int(hf, "full_attention_interval", 4)
            kinds = [LINEAR if (i + 1) % interval else FULL for i in range(ints["num_hidden_layers"])]
        rope_src = dict(hf)
        if "partial_rotary_factor" not in hf and "partial_rotary_factor" not in (
            hf.get("rope_parameters") or {}
        ):
            rope_src["partial_rotary_factor"] = 0.25  # the reference's default for these models
        return cls(
            model_type=model_type,
            **ints,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeParams.from_hf(rope_src),
            layer_types=tuple(kinds),
            norm_topk_prob=True if all_sparse else bool(hf.get("norm_topk_prob", True)),
            mlp_only_layers=() if all_sparse else tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
            attention_bias=bool(hf.get("attention_bias", False)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids(hf.get("eos_token_id")),
        )


class CenteredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored around 0 and applied as (1 + weight), in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__(dim, eps)
        nn.init.zeros_(self.weight)

    def add_norm(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        return pointwise.centered_add_rms_norm(x, delta, self.weight, self.eps)

    def forward(self, x: Tensor) -> Tensor:
        return pointwise.centered_rms_norm(x, self.weight, self.eps)


class GatedAttention(nn.Module):
    """Full attention whose q_proj also yields a per-channel output gate; q/k RMS-normed per head;
    partial rotary. Names follow HF (`self_attn.*`)."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = CenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = CenteredRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, step: LayerStep, state: LayerState) -> Tensor:
        if not isinstance(state, PagedKV):
            raise TypeError(f"a full-attention layer needs a PagedKV, got {type(state).__name__}")
        t = x.shape[0]
        qg, k, v = self.qkv.outputs(x)
        # Per head, q_proj's output is [query (head_dim), gate (head_dim)].
        q, gate = qg.view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = step.rope(self.q_norm(q))
        k = step.rope(self.k_norm(k.view(t, self.kv_heads, self.head_dim)))
        state.write(step.batch, k, v.view(t, self.kv_heads, self.head_dim))
        out = pointwise.sigmoid_mul(state.attend(q, step.batch), gate)
        return self.o_proj(out)


class FusedGatedDeltaNet(GatedDeltaNet):
    """Qwen3-Next: in_proj_qkvz and in_proj_ba, laid out per key head as
    [q (Dk), k (Dk), v (r*Dv), z (r*Dv)] and [b (r), a (r)], r = value heads per key head."""

    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg)
        self.in_proj_qkvz = nn.Linear(cfg.hidden_size, 2 * self.key_width + 2 * self.value_width, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * self.v_heads, bias=False)
        self.in_proj = FusedLinears(self.in_proj_qkvz, self.in_proj_ba)
        self._order: Tensor | None = None

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """One gather puts the per-key-head columns in q|k|v|z|b|a order, so every part is a view
        (splitting the per-head layout took seven kernels a layer)."""
        mixed = self.in_proj(x)
        if self._order is None or self._order.device != mixed.device:
            self._order = self.column_order(mixed.device)
        parts = mixed.index_select(1, self._order).split(
            [self.conv_channels, self.value_width, self.v_heads, self.v_heads], dim=-1
        )
        qkv, z, b, a = parts
        return qkv, z.view(x.shape[0], self.v_heads, self.v_dim), b, a

    def column_order(self, device: torch.device) -> Tensor:
        """Columns of [qkvz | ba] (the fused output) in q|k|v|z|b|a order, heads in order."""
        r = self.v_heads // self.k_heads
        head = torch.arange(self.k_heads, device=device)[:, None]
        per_head = 2 * self.k_dim + 2 * r * self.v_dim  # one key head's qkvz columns

        def cols(offset: Tensor, width: int) -> Tensor:
            return (offset + torch.arange(width, device=device)[None, :]).reshape(-1)

        qkvz = head * per_head
        ba = self.k_heads * per_head + head * 2 * r
        return torch.cat(
            [
                cols(qkvz, self.k_dim),  # q
                cols(qkvz + self.k_dim, self.k_dim),  # k
                cols(qkvz + 2 * self.k_dim, r * self.v_dim),  # v
                cols(qkvz + 2 * self.k_dim + r * self.v_dim, r * self.v_dim),  # z
                cols(ba, r),  # b
                cols(ba + r, r),  # a
            ]
        )


class HybridDecoderLayer(DecoderLayer):
    def __init__(self, cfg: HybridConfig, index: int, linear_cls: type[GatedDeltaNet]) -> None:
        super().__init__()
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if cfg.layer_types[index] == LINEAR:
            self.linear_attn = linear_cls(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp: SparseMoeBlock | SwiGLU
        if cfg.is_sparse(index):
            self.mlp = SparseMoeBlock(
                cfg.hidden_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                cfg.shared_expert_intermediate_size,
                cfg.norm_topk_prob,
            )
        else:
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = CenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def mix(self, x: Tensor, step: LayerStep, state: LayerState) -> Tensor:
        if self.linear_attn is not None:
            assert isinstance(step, HybridStep)
            return self.linear_attn(x, step, state)
        assert self.self_attn is not None
        return self.self_attn(x, step, state)


class Qwen3NextForCausalLM(DecoderLM):
    linear_attention_class: type[GatedDeltaNet] = FusedGatedDeltaNet
    model_types: tuple[str, ...] = ("qwen3_next",)
    all_sparse = False
    # The gated-delta layers carry a chunk's rows through a recurrent state: padding rows would
    # run through it too, so no prefill graph.
    prefill_graphs_safe = False

    def __init__(self, config: HybridConfig) -> None:
        c = config
        layers = (HybridDecoderLayer(c, i, self.linear_attention_class) for i in range(c.num_hidden_layers))
        norm, rope = CenteredRMSNorm(c.hidden_size, c.rms_norm_eps), RotaryEmbedding(c.rope, c.head_dim)
        model = DecoderModel(c.vocab_size, c.hidden_size, layers, norm, rope)
        super().__init__(c, model, nn.Linear(c.hidden_size, c.vocab_size, bias=False))
        # Registered after the decoder and the head, so a random init gives those the same weights
        # with or without it.
        self.mtp: MultiTokenPredictor | None = None
        if c.num_nextn_predict_layers > 0:
            full = replace(c, layer_types=(FULL,) * c.num_hidden_layers)
            self.mtp = MultiTokenPredictor(
                c.hidden_size,
                lambda: CenteredRMSNorm(c.hidden_size, c.rms_norm_eps),
                (
                    HybridDecoderLayer(full, i, self.linear_attention_class)
                    for i in range(c.num_nextn_predict_layers)
                ),
            )
            self.extra_states = c.num_nextn_predict_layers
        # Which gated-delta kernels to use: None picks fla where it applies; False forces the
        # pure-torch forms (e.g. to compare the two on one set of weights).
        self.use_fla: bool | None = None

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any]) -> Qwen3NextForCausalLM:
        return cls(HybridConfig.from_hf(hf, cls.model_types, cls.all_sparse))

    @staticmethod
    def checkpoint_key(hf_key: str) -> str | None:
        """Our parameter name for a checkpoint tensor (`mtp.*` too: the loader drops those unless
        the config keeps `num_nextn_predict_layers`)."""
        return hf_key

    def layer_specs(self, kv_dtype_bytes: int) -> list[LayerSpec]:
        c = self.config
        conv_bytes = dtype_bytes(self.model.embed_tokens.weight.dtype)
        linear = RecurrentStateSpec(
            conv_shape=(
                2 * c.linear_num_key_heads * c.linear_key_head_dim
                + c.linear_num_value_heads * c.linear_value_head_dim,
                c.linear_conv_kernel_dim - 1,
            ),
            conv_dtype_bytes=conv_bytes,
            state_shape=(c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim),
            state_dtype_bytes=4,
        )
        full = attention_spec(c.num_key_value_heads, c.head_dim, kv_dtype_bytes)
        # The MTP layers' attention KV after the decoder's layers (`extra_states`).
        return [linear if kind == LINEAR else full for kind in c.layer_types] + [full] * len(
            self.mtp.layers if self.mtp is not None else ()
        )

    def mtp_forward(
        self, batch: ForwardBatch, hidden: Tensor, states: list[LayerState], depth: int = 0
    ) -> Tensor:
        """The MTP layer's normed output at every row of `batch`, whose tokens are the ones after
        each row's position (what the target chose there) and `hidden` the target's normed hidden
        states at those positions; writes the layer's KV. `mtp_logits` of a row: the next draft."""
        assert self.mtp is not None, "built without num_nextn_predict_layers"
        embedded = self.model.embed_tokens(batch.token_ids)
        cos, sin = self.model.rotary_emb(batch.positions, embedded.dtype)
        state = states[len(self.model.layers) + depth % len(self.mtp.layers)]
        if isinstance(state, PagedKV):
            state.begin(batch)
        return self.mtp(embedded, hidden.to(embedded.dtype), Rope(cos, sin), batch, state, depth)

    def mtp_logits(self, normed: Tensor) -> Tensor:
        head = self.lm_head if self.quantized_head is None else self.quantized_head
        return head(normed).float()

    def layer_step(self, batch: ForwardBatch, rope: Rope) -> HybridStep:
        return HybridStep.build(batch, rope, self.config.linear_conv_kernel_dim, self.use_fla)

    def init_random_weights(self, gen: torch.Generator) -> None:
        """After builtin.init_random's generic pass: centred norms back to 0 (scale 1), the decay
        parameters the reference's init (A in U(0.01, 16), dt_bias 1)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, CenteredRMSNorm):
                    module.weight.zero_()
                elif isinstance(module, GatedDeltaNet):
                    a = torch.empty(module.v_heads, device=gen.device).uniform_(0.01, 16.0, generator=gen)
                    module.A_log.copy_(a.log())
                    module.dt_bias.fill_(1.0)


class SplitGatedDeltaNet(GatedDeltaNet):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_channels, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_width, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj = FusedLinears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qkv, z, b, a = self.in_proj.outputs(x)
        return qkv, z.view(x.shape[0], self.v_heads, self.v_dim), b, a


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    linear_attention_class = SplitGatedDeltaNet
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    all_sparse = True

    @staticmethod
    def checkpoint_key(hf_key: str) -> str | None:
        """Our name for a Qwen3.5-MoE checkpoint tensor; None for the vision tower and MTP head."""
        if hf_key.startswith(("model.visual.", "mtp.")):
            return None
        if hf_key.startswith("model.language_model."):
            return "model." + hf_key.removeprefix("model.language_model.")
        return hf_key
