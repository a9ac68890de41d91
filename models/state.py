"""Per-layer, per-slot state behind one small interface ("hybrid is a strategy, not a branch").

Each decoder layer gets the state object its spec asks for: attention layers a `KVState`, linear
attention / SSM layers a `RecurrentState`. The engine allocates them once (fixed shapes, after its
profiling pass) with `allocate_states`, resets slots when a new sequence starts in them, and
saves/loads slot contents for checkpoints; the model reads and writes them inside `forward`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from ballast.memory.specs import AttentionSpec, LayerSpec, RecurrentStateSpec
from ballast.models.base import ForwardBatch
from torch import Tensor

# Quantized KV keeps one float32 scale per (token, kv head) for K and for V.
KV_SCALE_BYTES = 4
_INT8_MAX = 127.0


def attention_spec(num_kv_heads: int, head_dim: int, kv_dtype_bytes: int) -> AttentionSpec:
    """The spec of one attention layer's cache; 1-byte KV carries per token-head scales."""
    scale = KV_SCALE_BYTES if kv_dtype_bytes == 1 else 0
    return AttentionSpec(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=kv_dtype_bytes, scale_bytes=scale)


class LayerState(abc.ABC):
    """One decoder layer's state for every slot."""

    @abc.abstractmethod
    def reset(self, slots: Tensor) -> None:
        """Sequences start at position 0 in these slots."""

    @abc.abstractmethod
    def save(self, slot: int, n_tokens: int) -> tuple[Tensor, ...]:
        """Copies of the slot's state after it consumed n_tokens (for checkpoints / prefix reuse)."""

    @abc.abstractmethod
    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        """Put what `save` returned (from any slot) into this slot."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes this state holds on its device."""


def _quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 with one float32 scale per row of the last dim (per token-head)."""
    scale = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-8) / _INT8_MAX
    q = torch.round(x.float() / scale).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


def _gather_prefix(cache: Tensor, slots: Tensor, n: int) -> Tensor:
    """cache[slots, :n] as a new [B, n, ...] tensor. Gathering rows of a 2-D view whose rows are
    each slot's first n positions (contiguous in memory) is one memcpy per slot, many times
    faster on CPU than index_select over a sliced 4-D view."""
    rows = cache.view(cache.shape[0], -1)[:, : n * cache[0, 0].numel()]
    return rows.index_select(0, slots).view(slots.shape[0], n, *cache.shape[2:])


class KVState(LayerState):
    """K and V of one attention layer, stored together as kv [num_slots, max_len, 2 * n_kv_heads,
    head_dim] (K heads first, then V heads) so one gather serves both; `k` and `v` are views. The
    model dtype, or int8 plus float32 scales [num_slots, max_len, 2 * n_kv_heads, 1] when quantized."""

    def __init__(
        self,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        quantized: bool = False,
    ) -> None:
        if num_slots <= 0 or max_len <= 0:
            raise ValueError(f"KVState needs num_slots > 0 and max_len > 0, got {num_slots}, {max_len}")
        self.dtype = dtype
        self.quantized = quantized
        self.max_len = max_len
        self.num_kv_heads = num_kv_heads
        shape = (num_slots, max_len, 2 * num_kv_heads, head_dim)
        self.kv = torch.zeros(shape, dtype=torch.int8 if quantized else dtype, device=device)
        self.scale: Tensor | None = None
        if quantized:
            self.scale = torch.zeros((*shape[:3], 1), dtype=torch.float32, device=device)

    @property
    def k(self) -> Tensor:
        return self.kv[:, :, : self.num_kv_heads]

    @property
    def v(self) -> Tensor:
        return self.kv[:, :, self.num_kv_heads :]

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def reset(self, slots: Tensor) -> None:
        # Nothing to clear: attention masks every cache position at or beyond a token's own
        # position, so what a previous sequence left behind is never read.
        return None

    def write(self, batch: ForwardBatch, k: Tensor, v: Tensor) -> None:
        """Store this step's k, v [T, n_kv_heads, head_dim] at (slot, position) of every token.
        Positions must be < max_len (the engine caps sequences at max_model_len)."""
        self.write_kv(batch, torch.cat((k, v), dim=1))

    def write_kv(self, batch: ForwardBatch, kv: Tensor) -> None:
        """As `write`, with K and V already side by side: kv [T, 2 * n_kv_heads, head_dim]."""
        index = (batch.slot_of_token, batch.positions)
        if self.scale is None:
            self.kv.index_put_(index, kv.to(self.dtype))
            return
        q, scale = _quantize(kv)
        self.kv.index_put_(index, q)
        self.scale.index_put_(index, scale)

    def read(self, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """K and V of each sequence's slot, positions [0, max_ctx): [B, max_ctx, n_kv, head_dim] in
        the model dtype (views of one gathered tensor). Positions past a sequence's own end hold
        stale data; the caller masks them."""
        kv = _gather_prefix(self.kv, batch.slots, batch.max_ctx)
        if self.scale is not None:
            kv = (kv.float() * _gather_prefix(self.scale, batch.slots, batch.max_ctx)).to(self.dtype)
        h = self.num_kv_heads
        return kv[:, :, :h], kv[:, :, h:]

    def _tensors(self) -> list[Tensor]:
        return [self.kv] if self.scale is None else [self.kv, self.scale]

    def save(self, slot: int, n_tokens: int) -> tuple[Tensor, ...]:
        if not 0 <= n_tokens <= self.max_len:
            raise ValueError(f"cannot save {n_tokens} tokens of a {self.max_len}-token cache")
        return tuple(t[slot, :n_tokens].clone() for t in self._tensors())

    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        mine = self._tensors()
        if len(saved) != len(mine):
            raise ValueError(f"expected {len(mine)} saved tensors, got {len(saved)} (quantized={self.quantized})")
        for dst, src in zip(mine, saved, strict=True):
            dst[slot, : src.shape[0]].copy_(src)

    def copy_tokens(self, src_slot: int, dst_slot: int, n_tokens: int) -> None:
        """Share a prefix: the first n_tokens of src_slot's cache become dst_slot's."""
        for t in self._tensors():
            t[dst_slot, :n_tokens].copy_(t[src_slot, :n_tokens])


class RecurrentState(LayerState):
    """A linear-attention / SSM layer's fixed-size state: conv window [num_slots, *conv_shape] in the
    model dtype and recurrent state [num_slots, *state_shape] in float32 (as the reference keeps it:
    the recurrence accumulates over the whole sequence and bf16 would drift)."""

    def __init__(
        self,
        num_slots: int,
        conv_shape: tuple[int, ...],
        state_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"RecurrentState needs num_slots > 0, got {num_slots}")
        self.conv = torch.zeros((num_slots, *conv_shape), dtype=dtype, device=device)
        self.recurrent = torch.zeros((num_slots, *state_shape), dtype=state_dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def reset(self, slots: Tensor) -> None:
        # Unlike KV, this state is read whole at every step, so a new sequence must start from zero.
        self.conv.index_fill_(0, slots, 0)
        self.recurrent.index_fill_(0, slots, 0)

    def tensors(self, slot: int) -> tuple[Tensor, Tensor]:
        """Views (no copy) of one slot's conv and recurrent state, e.g. to copy into pool buffers."""
        return self.conv[slot], self.recurrent[slot]

    def save(self, slot: int, n_tokens: int = 0) -> tuple[Tensor, ...]:
        # n_tokens is irrelevant: a recurrent state is the same size after any number of tokens.
        return self.conv[slot].clone(), self.recurrent[slot].clone()

    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        if len(saved) != 2:
            raise ValueError(f"expected (conv, recurrent), got {len(saved)} tensors")
        self.conv[slot].copy_(saved[0])
        self.recurrent[slot].copy_(saved[1])


_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def allocate_states(
    specs: Sequence[LayerSpec],
    num_slots: int,
    max_len: int,
    device: torch.device | str,
    dtype: torch.dtype,
    quantized_kv: bool = False,
) -> list[LayerState]:
    """One state per decoder layer, chosen by its spec. quantized_kv stores attention KV as int8."""
    states: list[LayerState] = []
    for spec in specs:
        if isinstance(spec, AttentionSpec):
            states.append(KVState(num_slots, max_len, spec.num_kv_heads, spec.head_dim, dtype, device, quantized_kv))
        elif isinstance(spec, RecurrentStateSpec):
            state_dtype = torch.float32 if spec.state_dtype_bytes == 4 else dtype
            states.append(RecurrentState(num_slots, spec.conv_shape, spec.state_shape, dtype, device, state_dtype))
        else:
            raise TypeError(f"no state kind for spec {spec!r}")
    return states


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a model dtype (for `layer_specs(kv_dtype_bytes)`)."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unsupported model dtype {dtype}")
    return _DTYPE_BYTES[dtype]
