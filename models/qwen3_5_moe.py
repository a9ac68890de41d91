"""Qwen3.5-MoE (text model): the Qwen3-Next architecture with two differences, so it reuses
models/qwen3_next.py and overrides only those:

- the linear-attention input projections are separate tensors (`in_proj_qkv`, `in_proj_z`,
  `in_proj_b`, `in_proj_a`) in plain q|k|v order instead of Qwen3-Next's per-key-head interleaved
  `in_proj_qkvz` / `in_proj_ba`;
- every layer is a sparse MoE layer with normalised top-k (no dense layers, no norm_topk_prob).

Its rotary embedding is multimodal (mrope) in the reference, but for text every position axis
carries the same index, which reduces exactly to the ordinary partial rotary used here.

A text-only checkpoint says `model_type: qwen3_5_moe_text`; the full multimodal one says
`qwen3_5_moe` and nests the text config under `text_config`, with the language model's tensors
under `model.language_model.*` (see `checkpoint_key`).
"""

from __future__ import annotations

from ballast.models.gated_delta import GatedDeltaNet
from ballast.models.layers import FusedLinears
from ballast.models.qwen3_next import HybridConfig, Qwen3NextForCausalLM
from torch import Tensor, nn


class SplitGatedDeltaNet(GatedDeltaNet):
    def __init__(self, cfg: HybridConfig) -> None:
        super().__init__(cfg)
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_channels, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_width, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.v_heads, bias=False)
        self.in_proj = FusedLinears(self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)

    def fuse(self, keep_values: bool = True) -> None:
        self.in_proj.fuse(keep_values)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        qkv, z, b, a = self.in_proj.outputs(x)
        return qkv, z.view(x.shape[0], self.v_heads, self.v_dim), b, a


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    linear_attention_class = SplitGatedDeltaNet
    model_types = ("qwen3_5_moe_text", "qwen3_5_moe")
    all_sparse = True

    @staticmethod
    def checkpoint_key(hf_key: str) -> str | None:
        """Our parameter name for a tensor of a Qwen3.5-MoE checkpoint, None for tensors this text
        model does not use (vision tower, multi-token-prediction head)."""
        if hf_key.startswith(("model.visual.", "mtp.")):
            return None
        if hf_key.startswith("model.language_model."):
            return "model." + hf_key.removeprefix("model.language_model.")
        return hf_key
