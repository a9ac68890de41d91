"""The engine's configuration: one frozen dataclass, validated when built.

Values found at load time (the slot count the memory layer allows, the profiled activation bytes)
are returned by the engine, never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
KV_QUANT_MODES = ("none", "int8")


def _setting(env: str, doc: str, rng: tuple[int, int] | None = None, choices: tuple[str, ...] | None = None) -> dict[str, object]:
    meta: dict[str, object] = {"env": env, "doc": doc}
    if rng is not None:
        meta["range"] = rng
    if choices is not None:
        meta["choices"] = choices
    return meta


class EngineConfigError(ValueError):
    """A configuration value is out of its accepted range."""


@dataclass(frozen=True)
class EngineConfig:
    # Field metadata names each setting's variable, range or choices, and doc: the one
    # configuration path (ballast.server.config) reads it to build flags and parse the environment.
    model: str = field(default="default", metadata=_setting("BALLAST_MODEL", "model to serve: default, builtin:NAME, a .gguf file or a Hugging Face directory"))
    dtype: str = field(default="auto", metadata=_setting("BALLAST_DTYPE", "weights and activations dtype (auto = bfloat16 on CUDA, float32 on CPU)", choices=("auto", *DTYPES)))
    device: str = field(default="auto", metadata=_setting("BALLAST_DEVICE", "auto, cpu, cuda or cuda:N"))
    max_num_seqs: int = field(default=8, metadata=_setting("BALLAST_MAX_NUM_SEQS", "concurrent sequences (slots allocated at load)", (1, 4096)))
    max_model_len: int = field(default=2048, metadata=_setting("BALLAST_MAX_MODEL_LEN", "prompt + generated tokens per sequence", (2, 1 << 20)))
    prefill_chunk_tokens: int = field(default=512, metadata=_setting("BALLAST_PREFILL_CHUNK_TOKENS", "largest prefill one step carries (profiled at load)", (1, 1 << 16)))
    kv_quant: str = field(default="none", metadata=_setting("BALLAST_KV_QUANT", "KV cache format: none keeps the model dtype, int8 adds per token-head scales", choices=KV_QUANT_MODES))
    kv_segment_bytes: int = field(default=0, metadata=_setting("BALLAST_KV_SEGMENT_BYTES", "KV pool growth step in bytes (whole blocks; 0 = 64 MiB on CPU, 256 MiB on CUDA)", (0, 1 << 40)))
    seed: int = field(default=0, metadata=_setting("BALLAST_SEED", "seed of random-init weights and the shared sampler", (0, (1 << 63) - 1)))
    cuda_graphs: bool = field(default=True, metadata=_setting("BALLAST_CUDA_GRAPHS", "replay decode steps as CUDA graphs (CUDA only; falls back to eager if capture fails)"))

    def __post_init__(self) -> None:
        if not self.model:
            raise EngineConfigError("model must name a model: default, builtin:NAME, a .gguf file or an HF dir")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise EngineConfigError(f"dtype={self.dtype!r}: accepted auto, {', '.join(DTYPES)}")
        if not _valid_device(self.device):
            raise EngineConfigError(f"device={self.device!r}: accepted auto, cpu, cuda, cuda:N")
        if not 1 <= self.max_num_seqs <= 4096:
            raise EngineConfigError(f"max_num_seqs={self.max_num_seqs}: accepted 1..4096")
        if not 2 <= self.max_model_len <= 1 << 20:
            raise EngineConfigError(f"max_model_len={self.max_model_len}: accepted 2..{1 << 20}")
        if not 1 <= self.prefill_chunk_tokens <= 1 << 16:
            raise EngineConfigError(f"prefill_chunk_tokens={self.prefill_chunk_tokens}: accepted 1..{1 << 16}")
        if self.kv_quant not in KV_QUANT_MODES:
            raise EngineConfigError(f"kv_quant={self.kv_quant!r}: accepted {', '.join(KV_QUANT_MODES)}")
        if not 0 <= self.kv_segment_bytes <= 1 << 40:
            raise EngineConfigError(f"kv_segment_bytes={self.kv_segment_bytes}: accepted 0..{1 << 40}")
        if not 0 <= self.seed < 1 << 63:
            raise EngineConfigError(f"seed={self.seed}: accepted 0..2**63-1")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


def _valid_device(device: str) -> bool:
    if device in ("auto", "cpu", "cuda"):
        return True
    head, _, index = device.partition(":")
    return head == "cuda" and index.isdigit()
