"""Load a GGUF file (llama.cpp's format) into an HF-style config dict, HF-named float tensors and a
transformers fast tokenizer, reading the file once.

Why not `gguf.GGUFReader`: it builds a numpy memmap object per metadata item, which costs ~4 s for
the default model's 98k-entry vocabulary and merge list, more than our whole 3 s load budget. The
format is small, so we parse the header ourselves (struct over an mmap) and keep the `gguf` package
for its enums and block sizes, and as the reference our tests compare against. Likewise the
dequantization is our own (chunked numpy into reused buffers), several times faster than
`gguf.quants.dequantize`, which alone takes ~2 s here.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from torch import Tensor
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

_MAGIC = b"GGUF"
_U64 = struct.Struct("<Q")
_CHUNK_VALUES = 1 << 16  # per dequant step: 256 KiB of float32, cache-sized
_DEFAULT_ALIGNMENT = 32
# a progress bar only when the load is long enough to wonder about
_PROGRESS_MIN_BYTES = 512 * 2**20


class GGUFError(ValueError):
    """The file is not a GGUF we can read (bad magic, truncated, unknown value type)."""


class GGUFUnsupportedError(GGUFError):
    """A well-formed GGUF that uses something we do not map (architecture, tensor, quant type)."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (outermost first): GGUF lists dims innermost first
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensorInfo]
    data: np.ndarray  # the whole file as uint8, mapped, never copied

    def raw(self, name: str) -> np.ndarray:
        info = self.tensors[name]
        return self.data[info.offset : info.offset + info.nbytes]


@dataclass(frozen=True)
class GGUFModel:
    config: dict[str, Any]  # HF-style (config.json) dict: the registry builds our model from it
    tensors: dict[str, Tensor]  # HF parameter names -> owned CPU tensors in the requested dtype
    tokenizer: PreTrainedTokenizerBase


# ---- reading -----------------------------------------------------------------------------------

_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"truncated GGUF: needed {size} bytes at offset {self.pos}")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        return self.strings(1)[0]

    def strings(self, count: int) -> list[str]:
        # the vocabulary and merges: ~100k strings, so a tight loop with everything local
        buf, pos, size, read_len = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        try:
            for _ in range(count):
                (length,) = read_len(buf, pos)
                pos += 8
                if pos + length > size:
                    raise GGUFError(f"truncated GGUF: string of {length} bytes at offset {pos}")
                out.append(buf[pos : pos + length].decode("utf-8"))
                pos += length
        except (struct.error, UnicodeDecodeError) as exc:
            raise GGUFError(f"bad GGUF string array at offset {pos}: {exc}") from exc
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type == GGUFValueType.STRING:
                return self.strings(count)
            if item_type in _SCALAR_FORMATS:
                fmt = _SCALAR_FORMATS[GGUFValueType(item_type)]
                size = struct.calcsize(fmt) * count
                if self.pos + size > len(self.buf):
                    raise GGUFError(f"truncated GGUF: array of {count} at offset {self.pos}")
                items = list(struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos))
                self.pos += size
                return items
            return [self.value(item_type) for _ in range(count)]
        if vtype not in _SCALAR_FORMATS:
            raise GGUFError(f"unknown GGUF value type {vtype} at offset {self.pos}")
        return self.unpack(_SCALAR_FORMATS[GGUFValueType(vtype)])


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse header, metadata and tensor table; the tensor data stays mapped, untouched."""
    path = Path(path)
    with open(path, "rb") as f:
        if f.read(4) != _MAGIC:
            raise GGUFError(f"{path} is not a GGUF file (no GGUF magic)")
        # ACCESS_COPY: a private mapping looks writable, so torch.from_numpy takes views of it
        # without a read-only warning; nothing ever writes to it.
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise GGUFUnsupportedError(f"{path}: GGUF version {version} (supported: 2, 3)")
    n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    table = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("<Q") for _ in range(cur.unpack("<I"))]
        table.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {}
    for name, dims, type_id, offset in table:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError as exc:
            raise GGUFUnsupportedError(f"{path}: tensor {name} has unknown ggml type {type_id}") from exc
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if dims[0] % block:
            raise GGUFError(f"{path}: tensor {name} row of {dims[0]} is not whole {qtype.name} blocks")
        nbytes = math.prod(dims) // block * block_bytes
        start = data_start + offset
        if start + nbytes > len(buf):
            raise GGUFError(f"{path}: tensor {name} runs past the end of the file")
        tensors[name] = GGUFTensorInfo(name, qtype, tuple(reversed(dims)), start, nbytes)
    return GGUFFile(path, metadata, tensors, np.frombuffer(buf, dtype=np.uint8))


# ---- dequantization (layouts: ggml-common.h block_* structs) ------------------------------------
# numpy, single-threaded, writing through reused scratch buffers: on VMs with free-page reporting
# the first touch of fresh memory costs ~10 us a page, more than the arithmetic, and torch's
# OpenMP wake-ups cost more than these element-wise ops on 2 cores. So each tensor's output is
# the only new memory it touches.


class _Scratch:
    """Named uint8 buffers that grow to the largest tensor and are reused for every other."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, key: str, shape: tuple[int, ...], dtype: type[np.generic]) -> np.ndarray:
        n = math.prod(shape) * np.dtype(dtype).itemsize
        buf = self._bufs.get(key)
        if buf is None or buf.nbytes < n:
            buf = self._bufs[key] = np.empty(n, np.uint8)
        return buf[:n].view(dtype).reshape(shape)


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """One fp16 field per block as a float32 column (nb, 1)."""
    return blocks[:, start : start + 2].view(np.float16).astype(np.float32)


def _nibbles_into(qs: np.ndarray, dst: np.ndarray) -> None:
    """(..., k) bytes -> dst (..., 2k): the k low nibbles, then the k high ones (ggml's order)."""
    k = qs.shape[-1]
    np.bitwise_and(qs, 0xF, out=dst[..., :k])
    np.right_shift(qs, 4, out=dst[..., k:])


def _q8_0(b: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    np.copyto(out, b[:, 2:].view(np.int8))
    out *= _f16(b, 0)


def _q4_0(b: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    q = s.get("q", out.shape, np.uint8)
    _nibbles_into(b[:, 2:], q)
    np.copyto(out, q)
    out -= 8.0
    out *= _f16(b, 0)


def _q4_1(b: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    q = s.get("q", out.shape, np.uint8)
    _nibbles_into(b[:, 4:], q)
    np.copyto(out, q)
    out *= _f16(b, 0)
    out += _f16(b, 2)


def _q4_k(b: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    # 8 sub-blocks of 32 with a 6-bit scale and min each, packed in 12 bytes (get_scale_min_k4)
    nb = b.shape[0]
    q = s.get("q", (nb, 4, 64), np.uint8)
    _nibbles_into(b[:, 16:].reshape(nb, 4, 32), q)
    np.copyto(out, q.reshape(nb, 256))
    sc = b[:, 4:16]
    scale = np.concatenate([sc[:, 0:4] & 63, (sc[:, 8:12] & 0xF) | ((sc[:, 0:4] >> 6) << 4)], axis=1)
    minimum = np.concatenate([sc[:, 4:8] & 63, (sc[:, 8:12] >> 4) | ((sc[:, 4:8] >> 6) << 4)], axis=1)
    sub = out.reshape(nb, 8, 32)
    sub *= (_f16(b, 0) * scale)[:, :, None]
    sub -= (_f16(b, 2) * minimum)[:, :, None]


def _q6_k(b: np.ndarray, out: np.ndarray, s: _Scratch) -> None:
    # two halves of 128 values, each 4 groups of 32: low 4 bits from ql (low nibbles of its two
    # 32-byte rows, then high nibbles), high 2 bits from qh at shift 2*group; an int8 scale per 16
    nb = b.shape[0]
    q = s.get("q", (nb, 2, 4, 32), np.uint8)
    ql = b[:, :128].reshape(nb, 2, 2, 32)
    np.bitwise_and(ql, 0xF, out=q[:, :, 0:2])
    np.right_shift(ql, 4, out=q[:, :, 2:4])
    qh = b[:, 128:192].reshape(nb, 2, 32)
    t = s.get("t", (nb, 2, 32), np.uint8)
    for group in range(4):
        np.right_shift(qh, 2 * group, out=t)
        np.bitwise_and(t, 3, out=t)
        np.left_shift(t, 4, out=t)
        np.bitwise_or(q[:, :, group], t, out=q[:, :, group])
    np.copyto(out, q.reshape(nb, 256))
    out -= 32.0
    out.reshape(nb, 16, 16)[...] *= (_f16(b, 208) * b[:, 192:208].view(np.int8))[:, :, None]


_BLOCK_DEQUANT: dict[GGMLQuantizationType, Callable[[np.ndarray, np.ndarray, _Scratch], None]] = {
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
SUPPORTED_TYPES = tuple(t.name for t in (*_FLOAT_TYPES, *_BLOCK_DEQUANT))


def dequantize(
    raw: np.ndarray, qtype: GGMLQuantizationType, dtype: torch.dtype = torch.float32, scratch: _Scratch | None = None
) -> Tensor:
    """Flat uint8 bytes of one tensor -> flat values in dtype, always in new memory."""
    if qtype == GGMLQuantizationType.BF16:  # numpy has no bfloat16
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).to(dtype, copy=True)
    if qtype == GGMLQuantizationType.F16:
        return torch.from_numpy(raw.view(np.float16)).to(dtype, copy=True)
    if qtype == GGMLQuantizationType.F32:
        return torch.from_numpy(raw.view(np.float32)).to(dtype, copy=True)
    fn = _BLOCK_DEQUANT.get(qtype)
    if fn is None:
        raise GGUFUnsupportedError(f"ggml type {qtype.name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")
    scratch = scratch or _Scratch()
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, block_bytes)
    shape = (blocks.shape[0], block)
    # float32 straight into the result; another dtype goes through a float32 scratch
    out = np.empty(shape, np.float32) if dtype == torch.float32 else scratch.get("f32", shape, np.float32)
    # in chunks that stay in cache: each value is then written to main memory once, not once
    # per arithmetic pass
    step = max(1, _CHUNK_VALUES // block)
    for i in range(0, shape[0], step):
        fn(blocks[i : i + step], out[i : i + step], scratch)
    result = torch.from_numpy(out.reshape(-1))
    return result if dtype == torch.float32 else result.to(dtype)


# ---- architecture: config and tensor names ------------------------------------------------------


@dataclass(frozen=True)
class _Arch:
    model_type: str
    hf_class: str
    # llama.cpp's converter reorders q/k rows (rotate-half -> interleaved rope) for these only
    permuted_qk: bool


_ARCHS = {
    "llama": _Arch("llama", "LlamaForCausalLM", True),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": _Arch("qwen3", "Qwen3ForCausalLM", False),
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
        raise GGUFUnsupportedError(f"GGUF architecture {name!r} is not supported (supported: {', '.join(_ARCHS)})")
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
        raise GGUFUnsupportedError(f"{gf.path}: partial rotary (rope.dimension_count != head_dim) is not supported")
    embd = gf.tensors.get("token_embd.weight")
    if embd is None:
        raise GGUFError(f"{gf.path}: no token_embd.weight tensor")
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
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
        "rope_scaling": _rope_scaling(md, name) if _ROPE_FREQS not in gf.tensors else _llama3_rope(gf, head_dim),
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
              "high_freq_factor": float(low + 1 / slope), "original_max_position_embeddings": 8192}  # fmt: skip
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


# ---- tokenizer (from tokenizer.ggml.* metadata; no transformers GGUF code, whose API moves) ------

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split before BPE; these follow llama.cpp's llama-vocab.cpp.
# "smollm" & co. split every digit apart, then apply GPT-2's regex (ByteLevel's built-in one).
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_SPLIT_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}  # fmt: skip
# llama.cpp (and Llama 3's tokenizer.json) take a split piece that is a vocabulary entry whole,
# without merging, and add BOS unless the file says otherwise
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return gpt2
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in _SPLIT_PRE:
        split = pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated")
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    known = sorted((*_GPT2_PRE, *_DIGITS_PRE, *_SPLIT_PRE))
    raise GGUFUnsupportedError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(known)})")


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a piece into two pieces is a merge,
    ranked by the merged piece's score (what SentencePiece's BPE picks first)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = [
        (-scores[ids[t]], ids[t], ids[t[:i]], ids[t[i:]])
        for t in ids
        for i in range(1, len(t))
        if t[:i] in ids and t[i:] in ids
    ]
    found.sort()
    return [(tokens[left], tokens[right]) for _, _, left, right in found]


def _skeleton(md: dict[str, Any], merges: list[str]) -> Tokenizer:
    """The tokenizer's pipeline (normalizer, splitting, model options, decoder) around an empty
    vocabulary; the vocabulary goes in as JSON (see build_tokenizer)."""
    kind = md.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = Tokenizer(models.BPE(vocab={}, merges=[]))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(md.get("tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
        return tok
    if kind == "llama":  # SentencePiece BPE with byte fallback
        tokens: list[str] = md["tokenizer.ggml.tokens"]
        if not merges:
            merges.extend(f"{a} {b}" for a, b in _spm_merges(tokens, md["tokenizer.ggml.scores"]))
        unk_id = md.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        tok = Tokenizer(models.BPE(vocab={}, merges=[], unk_token=unk, fuse_unk=True, byte_fallback=True))
        spaces = normalizers.Replace(" ", "\u2581")
        if md.get("tokenizer.ggml.add_space_prefix", True):
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces])
            strip: list[decoders.Decoder] = [decoders.Strip(" ", 1, 0)]
        else:
            tok.normalizer, strip = spaces, []
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
        return tok
    raise GGUFUnsupportedError(f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)")


def build_tokenizer(md: dict[str, Any]) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer equal to the one the GGUF describes: vocab, merges, split
    rules, control tokens kept whole, bos/eos/unk/pad, bos/eos insertion, chat template.

    Built as tokenizer.json text that transformers parses once: handing it a Tokenizer object
    instead costs a deep copy (serialise + parse) of the 49k-entry vocabulary and merges."""
    if "tokenizer.ggml.tokens" not in md:
        raise GGUFError("GGUF has no tokenizer (tokenizer.ggml.tokens missing)")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type", [])
    merges: list[str] = list(md.get("tokenizer.ggml.merges", []))
    skeleton = _skeleton(md, merges)

    def special(name: str) -> list[tuple[str, int]]:
        token_id = md.get(f"tokenizer.ggml.{name}_token_id")
        return [] if token_id is None else [(tokens[token_id], int(token_id))]

    def content(name: str) -> str | None:
        found = special(name)
        return found[0][0] if found else None

    # llama.cpp adds BOS for SentencePiece and Llama 3 vocabularies that do not say otherwise
    llama3 = md.get("tokenizer.ggml.model") == "gpt2" and md.get("tokenizer.ggml.pre") in _LLAMA3_PRE
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", md.get("tokenizer.ggml.model") == "llama" or llama3))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    first, last = special("bos") if add_bos else [], special("eos") if add_eos else []
    if first or last:
        template = [t for t, _ in first] + ["$A"] + [t for t, _ in last]
        skeleton.post_processor = processors.TemplateProcessing(
            single=template, pair=[*template, "$B:1"], special_tokens=[*first, *last]
        )
    spec = json.loads(skeleton.to_str())
    spec["model"]["vocab"] = {t: i for i, t in enumerate(tokens)}
    spec["model"]["merges"] = merges  # "a b" strings, the format every tokenizers version reads
    spec["model"]["ignore_merges"] = llama3
    spec["added_tokens"] = [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t == _CONTROL}
        for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)
    ]  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
        f.flush()
        return PreTrainedTokenizerFast(
            tokenizer_file=f.name,
            bos_token=content("bos"),
            eos_token=content("eos"),
            unk_token=content("unknown"),
            pad_token=content("padding"),
            add_bos_token=bool(first),
            add_eos_token=bool(last),
            chat_template=md.get("tokenizer.chat_template"),
            model_max_length=int(md.get(f"{md.get('general.architecture')}.context_length", 2**31 - 1)),
        )


# ---- the whole load -----------------------------------------------------------------------------


def gguf_tensors(gf: GGUFFile, config: dict[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """Every tensor dequantized to dtype under its HF name, q/k rows back in HF order."""
    _, arch = _arch(gf.metadata)
    heads = {".self_attn.q_proj.": config["num_attention_heads"], ".self_attn.k_proj.": config["num_key_value_heads"]}
    total = sum(t.nbytes for t in gf.tensors.values())
    show = sys.stderr.isatty() and total >= _PROGRESS_MIN_BYTES
    out: dict[str, Tensor] = {}
    scratch = _Scratch()
    for info in tqdm(gf.tensors.values(), desc=f"loading {gf.path.name}", unit="tensor", disable=not show):
        if info.name == _ROPE_FREQS:
            continue
        hf = hf_tensor_name(info.name)
        raw = gf.raw(info.name)
        n_head = next((n for part, n in heads.items() if part in hf), None)
        if arch.permuted_qk and n_head is not None:
            # reorder whole rows of the packed bytes (a row is whole blocks), so the float
            # result is written once, already in HF order
            rows = raw.reshape(info.shape[0], -1)
            raw = scratch.get("rows", rows.shape, np.uint8)
            np.take(rows, qk_row_order(info.shape[0], n_head), axis=0, out=raw)
        out[hf] = dequantize(raw.reshape(-1), info.qtype, dtype, scratch).reshape(info.shape)
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
