"""Load a GGUF file (llama.cpp's format) into an HF-style config dict, HF-named float tensors and a
transformers fast tokenizer, reading the file once: gguf_reader.py parses, gguf_quants.py
dequantizes, gguf_tokenizer.py builds the tokenizer, and this module maps the metadata to a
config.json-style dict and llama.cpp's tensor names to Hugging Face's.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from ballast.models.layers.packed import Q4_TYPES, Q4Weight, Q8Weight, q4_weight, q8_weight
from ballast.models.weights.gguf_quants import Scratch, dequantize
from ballast.models.weights.gguf_reader import (
    GGUFError,
    GGUFFile,
    GGUFTensorInfo,
    GGUFUnsupportedError,
    read_gguf,
)
from ballast.models.weights.gguf_tokenizer import build_tokenizer
from gguf import GGMLQuantizationType
from torch import Tensor
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

# a progress bar only when the load is long enough to wonder about
_PROGRESS_MIN_BYTES = 512 * 2**20


@dataclass(frozen=True)
class GGUFModel:
    config: dict[str, Any]  # HF-style (config.json) dict: the registry builds our model from it
    tensors: dict[str, Tensor]  # HF parameter names -> owned CPU tensors in the requested dtype
    tokenizer: PreTrainedTokenizerBase


@dataclass(frozen=True)
class _Arch:  # by general.architecture, which is also the HF model_type
    hf_class: str
    # llama.cpp's converter reorders q/k rows (rotate-half -> interleaved rope) for these only
    permuted_qk: bool


_ARCHS = {
    "llama": _Arch("LlamaForCausalLM", True),
    "qwen2": _Arch("Qwen2ForCausalLM", False),
    "qwen3": _Arch("Qwen3ForCausalLM", False),
}
_ROPE_FREQS = "rope_freqs.weight"  # configuration stored as a tensor: read into the config
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}  # fmt: skip


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if suffix in ("weight", "bias"):
        if len(parts) == 1 and parts[0] in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[parts[0]]}.{suffix}"
        if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
            return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise GGUFUnsupportedError(f"GGUF tensor {gguf_name!r} has no Llama-family counterpart")


def qk_row_order(rows: int, n_head: int) -> np.ndarray:
    """For each HF row of q_proj/k_proj, the GGUF row holding it. convert_hf_to_gguf's `permute`
    regrouped each head's rows from (2, dim/2) halves into interleaved pairs for llama.cpp's rope:
    GGUF row h*dim + 2*i + a holds HF row h*dim + a*dim/2 + i."""
    return np.arange(rows).reshape(n_head, -1, 2).transpose(0, 2, 1).reshape(-1)


def _arch(md: dict[str, Any]) -> tuple[str, _Arch]:
    name = md.get("general.architecture")
    if name not in _ARCHS:
        raise GGUFUnsupportedError(
            f"GGUF architecture {name!r} is not supported (supported: {', '.join(_ARCHS)})"
        )
    return name, _ARCHS[name]


def gguf_config(gf: GGUFFile) -> dict[str, Any]:
    """HF config.json-style dict from the GGUF metadata (keys as LlamaConfig/Qwen2Config name them)."""
    md = gf.metadata
    name, arch = _arch(md)

    def key(k: str, default: Any = None) -> Any:
        value = md.get(f"{name}.{k}", default)
        if value is None:
            raise GGUFError(f"{gf.path}: GGUF metadata lacks {name}.{k}")
        return value

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    if int(key("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFUnsupportedError(
            f"{gf.path}: partial rotary (rope.dimension_count != head_dim) is not supported"
        )
    embd = gf.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{gf.path}: no token_embd.weight tensor")
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": name,
        "vocab_size": embd.shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(md, name)
        if _ROPE_FREQS not in gf.tensors
        else _llama3_rope(gf, head_dim),
        "tie_word_embeddings": "output.weight" not in gf.tensors,
        "attention_bias": "blk.0.attn_q.bias" in gf.tensors,
        "mlp_bias": False,
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(md),
        "torch_dtype": "float32",
    }
    if md.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = md["tokenizer.ggml.padding_token_id"]
    return config


def _rope_scaling(md: dict[str, Any], name: str) -> dict[str, Any] | None:
    kind = md.get(f"{name}.rope.scaling.type", "none")
    if kind == "none":
        return None
    factor = float(md[f"{name}.rope.scaling.factor"])
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        original = int(md[f"{name}.rope.scaling.original_context_length"])
        return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original}
    raise GGUFUnsupportedError(f"rope scaling type {kind!r} is not supported (none, linear, yarn)")


def _llama3_rope(gf: GGUFFile, head_dim: int) -> dict[str, Any] | None:
    """Llama 3.1's rope scaling, which llama.cpp stores as a per-frequency divisor tensor, as HF
    `llama3` parameters giving the same divisors. The divisor is `factor` below the band, 1 above
    it, and 1/((1-s)/factor + s) inside, with s linear in old_context/wavelength; only the band's
    edges relative to the old context matter, so that context is pinned at Llama 3's 8192."""
    info = gf.tensors[_ROPE_FREQS]
    divisors = dequantize(gf.raw(_ROPE_FREQS), info.qtype).double().numpy()
    theta = float(gf.metadata.get(f"{gf.metadata['general.architecture']}.rope.freq_base", 10000.0))
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    factor = float(divisors.max())
    if divisors.shape != inv_freq.shape or factor <= 1.0:
        raise GGUFUnsupportedError(f"rope_freqs of shape {divisors.shape} is not Llama 3 rope scaling")
    u = 8192 * inv_freq / (2 * math.pi)
    s = (1 / divisors - 1 / factor) / (1 - 1 / factor)
    band = (s > 1e-4) & (s < 1 - 1e-4)
    if band.sum() < 2:
        raise GGUFUnsupportedError("rope_freqs has fewer than two frequencies in the smoothing band")
    slope, intercept = np.polyfit(u[band], s[band], 1)
    low = -intercept / slope
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
              "high_freq_factor": float(low + 1 / slope),
              "original_max_position_embeddings": 8192}  # fmt: skip
    smooth = np.clip((u - low) / (1 / slope), 0.0, 1.0)
    if not np.allclose(1 / ((1 - smooth) / factor + smooth), divisors, rtol=1e-4):
        raise GGUFUnsupportedError("rope_freqs does not follow Llama 3's rope scaling")
    return params


def _eos_ids(md: dict[str, Any]) -> int | list[int] | None:
    """eos, plus end-of-turn / end-of-message tokens where the file names others: a chat model
    stops on any of them."""
    ids: list[int] = []
    for k in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = md.get(f"tokenizer.ggml.{k}")
        if value is not None and value not in ids:
            ids.append(int(value))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def gguf_tensors(
    gf: GGUFFile, config: dict[str, Any], dtype: torch.dtype = torch.float32, skip: Collection[str] = ()
) -> dict[str, Tensor]:
    """Every tensor dequantized to dtype under its HF name, q/k rows back in HF order; those in
    `skip` (held quantized by the caller) left uninitialised: no work, no memory until written."""
    total = sum(t.nbytes for t in gf.tensors.values())
    show = sys.stderr.isatty() and total >= _PROGRESS_MIN_BYTES
    out: dict[str, Tensor] = {}
    scratch = Scratch()
    for info in tqdm(gf.tensors.values(), desc=f"loading {gf.path.name}", unit="tensor", disable=not show):
        if info.name == _ROPE_FREQS:
            continue
        hf = hf_tensor_name(info.name)
        if hf in skip:
            out[hf] = torch.empty(info.shape, dtype=dtype)
            continue
        raw = _hf_rows(gf, info, config, scratch)
        out[hf] = dequantize(raw.reshape(-1), info.qtype, dtype, scratch).reshape(info.shape)
    return out


def gguf_block_weights(gf: GGUFFile, config: dict[str, Any]) -> dict[str, Q4Weight | Q8Weight]:
    """The Q4_0 / Q4_1 / Q8_0 2-D tensors under their HF names, as the file's own integers and
    scales (rows in HF order): what the CPU's block linears hold instead of dequantized floats."""
    out: dict[str, Q4Weight | Q8Weight] = {}
    scratch = Scratch()
    for info in gf.tensors.values():
        if len(info.shape) != 2 or info.qtype not in (*Q4_TYPES, GGMLQuantizationType.Q8_0):
            continue
        rows = _hf_rows(gf, info, config, scratch).reshape(info.shape[0], -1)
        name = hf_tensor_name(info.name)
        out[name] = (
            q4_weight(rows, info.qtype, info.shape) if info.qtype in Q4_TYPES else q8_weight(rows, info.shape)
        )
    return out


def _hf_rows(gf: GGUFFile, info: GGUFTensorInfo, config: dict[str, Any], scratch: Scratch) -> np.ndarray:
    """A tensor's packed bytes with q/k rows back in HF order (in scratch where reordered)."""
    _, arch = _arch(gf.metadata)
    raw = gf.raw(info.name)
    hf = hf_tensor_name(info.name)
    heads = {
        ".self_attn.q_proj.": config["num_attention_heads"],
        ".self_attn.k_proj.": config["num_key_value_heads"],
    }
    n_head = next((n for part, n in heads.items() if part in hf), None)
    if not (arch.permuted_qk and n_head is not None):
        return raw
    # whole rows of packed bytes (a row is whole blocks): the floats are written once, in HF order
    rows = raw.reshape(info.shape[0], -1)
    out = scratch.get("rows", rows.shape, np.uint8)
    np.take(rows, qk_row_order(info.shape[0], n_head), axis=0, out=out)
    return out


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Config, tensors and tokenizer of a GGUF file, reading it once."""
    gf = read_gguf(path)
    config = gguf_config(gf)
    # Sequential on purpose: building the tokenizer on a second thread was tried, and its long
    # GIL-holding calls stall the chunked dequantization more than the overlap gains.
    return GGUFModel(config, gguf_tensors(gf, config, dtype), build_tokenizer(gf.metadata))


def gguf_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Just the tokenizer (with chat template and special ids); the tensor data is not touched."""
    return build_tokenizer(read_gguf(path).metadata)
