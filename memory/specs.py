"""Per-layer memory specs. Each layer kind states its cost; the memory layer only adds them up."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionSpec:
    """A full-attention layer's KV cache: K and V of num_kv_heads x head_dim per token."""

    num_kv_heads: int
    head_dim: int
    dtype_bytes: int  # 4 fp32, 2 bf16/fp16, 1 int8/fp8
    scale_bytes: int = 0  # per token-head scale bytes when quantized (e.g. 4 for a float32 scale)

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.head_dim <= 0 or self.dtype_bytes <= 0 or self.scale_bytes < 0:
            raise ValueError(f"invalid AttentionSpec {self}")

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * (self.head_dim * self.dtype_bytes + self.scale_bytes)


@dataclass(frozen=True)
class RecurrentStateSpec:
    """A linear-attention / SSM layer's fixed-size state per slot: conv window + recurrent state."""

    conv_shape: tuple[int, ...]  # per slot, e.g. (channels, kernel - 1)
    conv_dtype_bytes: int
    state_shape: tuple[int, ...]  # per slot, e.g. (heads, head_k_dim, head_v_dim)
    state_dtype_bytes: int = 4  # the recurrent state stays float32

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dtype_bytes
        for d in self.conv_shape:
            conv *= d
        state = self.state_dtype_bytes
        for d in self.state_shape:
            state *= d
        return conv + state

    def bytes_per_verify_row(self, drafts: int) -> int:
        """What a verify row of up to `drafts` drafts keeps for its rollback: the state after each
        drafted position, and the conv's saved inputs followed by the drafts' inputs."""
        conv = self.conv_dtype_bytes * (self.conv_shape[-1] + drafts)
        for d in self.conv_shape[:-1]:
            conv *= d
        state = self.state_dtype_bytes * drafts
        for d in self.state_shape:
            state *= d
        return conv + state


LayerSpec = AttentionSpec | RecurrentStateSpec


def kv_bytes_per_token(specs: Iterable[LayerSpec]) -> int:
    return sum(s.bytes_per_token for s in specs if isinstance(s, AttentionSpec))


def state_bytes_per_slot(specs: Iterable[LayerSpec]) -> int:
    return sum(s.bytes_per_slot for s in specs if isinstance(s, RecurrentStateSpec))


def verify_bytes(specs: Iterable[LayerSpec], rows: int, drafts: int) -> int:
    """The verify workspace for `rows` drafting sequences of up to `drafts` drafts a step."""
    return rows * sum(s.bytes_per_verify_row(drafts) for s in specs if isinstance(s, RecurrentStateSpec))
