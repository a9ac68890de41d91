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


class KVState(LayerState):
    """K and V of one attention layer: [num_slots, max_len, n_kv_heads, head_dim], in the model dtype
    or int8 plus float32 scales [num_slots, max_len, n_kv_heads, 1] when quantized."""

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
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        store = torch.int8 if quantized else dtype
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale: Tensor | None = None
        self.v_scale: Tensor | None = None
        if quantized:
            self.k_scale = torch.zeros((*shape[:3], 1), dtype=torch.float32, device=device)
            self.v_scale = torch.zeros((*shape[:3], 1), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        total = self.k.nbytes + self.v.nbytes
        if self.k_scale is not None and self.v_scale is not None:
            total += self.k_scale.nbytes + self.v_scale.nbytes
        return total

    def reset(self, slots: Tensor) -> None:
        # Nothing to clear: attention masks every cache position at or beyond a token's own
        # position, so what a previous sequence left behind is never read.
        return None

    def write(self, batch: ForwardBatch, k: Tensor, v: Tensor) -> None:
        """Store this step's k, v [T, n_kv_heads, head_dim] at (slot, position) of every token.
        Positions must be < max_len (the engine caps sequences at max_model_len)."""
        index = (batch.slot_of_token, batch.positions)
        if self.k_scale is None or self.v_scale is None:
            self.k.index_put_(index, k.to(self.dtype))
            self.v.index_put_(index, v.to(self.dtype))
            return
        qk, sk = _quantize(k)
        qv, sv = _quantize(v)
        self.k.index_put_(index, qk)
        self.v.index_put_(index, qv)
        self.k_scale.index_put_(index, sk)
        self.v_scale.index_put_(index, sv)

    def read(self, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """K and V of each sequence's slot, positions [0, max_ctx): [B, max_ctx, n_kv, head_dim] in
        the model dtype. Positions past a sequence's own end hold stale data; the caller masks."""
        n = batch.max_ctx
        # Slice the length first so the gather copies only max_ctx positions per slot.
        k = self.k[:, :n].index_select(0, batch.slots)
        v = self.v[:, :n].index_select(0, batch.slots)
        if self.k_scale is None or self.v_scale is None:
            return k, v
        ks = self.k_scale[:, :n].index_select(0, batch.slots)
        vs = self.v_scale[:, :n].index_select(0, batch.slots)
        return (k.float() * ks).to(self.dtype), (v.float() * vs).to(self.dtype)

    def _tensors(self) -> list[Tensor]:
        out = [self.k, self.v]
        if self.k_scale is not None and self.v_scale is not None:
            out += [self.k_scale, self.v_scale]
        return out

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
