"""Turning a model's modules float8 in place (`fp8.convert_linear` for linears, `fp8.convert_experts`
for MoE experts), as the loaders do before the checkpoint's float8 tensors are read. Apart from
models/fp8.py so that it stays a leaf: moe and layers import fp8, and this needs `Experts`."""

from __future__ import annotations

from collections.abc import Callable

from ballast.models.fp8 import Block, convert_experts, convert_linear
from ballast.models.moe import Experts
from torch import nn


def convert_model(model: nn.Module, quantized: Callable[[str], bool], block: Block) -> None:
    """Convert the modules whose weights `quantized` accepts (model parameter names of float8
    checkpoint tensors: `...q_proj.weight`, `...mlp.experts.gate_up_proj`). Experts whose gate and
    up halves would split a scale block stay in the model's dtype (the loader dequantizes them)."""
    for name, module in model.named_modules():
        prefix = name + "." if name else ""
        if isinstance(module, nn.Linear) and quantized(prefix + "weight"):
            convert_linear(module, block)
        elif (
            isinstance(module, Experts)
            and quantized(prefix + "gate_up_proj")
            and (module.gate_up_proj.shape[1] // 2) % block[0] == 0
        ):
            convert_experts(module, block)
