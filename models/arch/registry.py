"""HF `model_type` -> our model class, and building it. Keep `MODEL_CLASSES` a plain dict literal:
each architecture adds one import and one entry."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from ballast.models.arch.llama import LlamaForCausalLM
from ballast.models.arch.qwen3_next import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from ballast.models.base import UnsupportedModel
from ballast.models.blocks.moe import Experts, convert_experts
from ballast.models.layers.fp8 import Block, convert_linear
from torch import Tensor, nn

# Every class here has `from_hf_config(hf)`, `layer_specs`, `forward(batch, states)`, and optionally
# `tie_weights()` and `fuse_projections(keep_values, device)`.
MODEL_CLASSES: dict[str, Any] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
}


def model_class(hf_config: Mapping[str, Any]) -> Any:
    model_type = hf_config.get("model_type")
    cls = MODEL_CLASSES.get(str(model_type))
    if cls is None:
        raise UnsupportedModel(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(MODEL_CLASSES))}"
        )
    return cls


def without_mtp(hf_config: dict[str, Any], keep: bool = False) -> dict[str, Any]:
    """The config with its MTP layers dropped (`num_nextn_predict_layers` 0) unless `keep`: they
    are built and loaded only for drafting (the 80B's is 1.5B parameters)."""
    if not keep and hf_config.get("num_nextn_predict_layers"):
        hf_config["num_nextn_predict_layers"] = 0
    return hf_config


def build_model(
    hf_config: Mapping[str, Any],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    fp8: tuple[Callable[[str], bool], Block] | None = None,
) -> nn.Module:
    """The model for an HF config dict, parameters uninitialised in dtype on device (fp8: which
    names, block: held in float8 with block scales). Built on the meta device first, so no time
    goes into an initialisation the weights overwrite."""
    cls = model_class(hf_config)
    with torch.device("meta"):
        model: nn.Module = cls.from_hf_config(hf_config).to(dtype)
    if fp8 is not None:
        convert_model(model, *fp8)
    return materialize(model, device)


def materialize(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A model built on the meta device with real (still uninitialised) storage on device, each
    weight allocated once: the fused projections' tensors first (their linears views into them),
    then every tensor still on meta, a tied head the embedding's. `to_empty` then fusing gave
    each linear (and a tied head) storage of its own that the fusing freed, on a GPU into the
    caching allocator: 8.5 GiB on the 8B shape (q, k, v, gate and up of 32 layers), whose load
    estimate was 7.1 GiB under its measured peak (s26, H100)."""
    fuse = getattr(model, "fuse_projections", None)
    if fuse is not None:
        fuse(keep_values=False, device=str(device))  # the parameters hold nothing yet
    made: dict[int, tuple[Tensor, Tensor]] = {}  # a meta tensor met twice (tied) is made once

    def place(t: Tensor) -> Tensor:
        if not t.is_meta:
            return t
        if id(t) not in made:
            made[id(t)] = (t, torch.empty_like(t, device=device))
        return made[id(t)][1]

    model._apply(place)
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()  # one Parameter in both places again (_apply wrapped the shared storage twice)
    return model.eval()


def convert_model(model: nn.Module, quantized: Callable[[str], bool], block: Block) -> None:
    """Turn float8 in place, on the meta device, the modules whose weights `quantized` accepts.
    Experts whose gate and up halves would split a scale block stay in the model's dtype (the
    loader dequantizes them)."""
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
