"""Per-layer, per-slot state behind one small interface ("hybrid is a strategy, not a branch").

Each decoder layer gets the state object its spec asks for: attention layers a `PagedKV` (their
K/V live in the blocks of one shared `KVStore`, reached through each slot's block table), linear
attention / SSM layers a `RecurrentState` (a fixed-size state per slot). The engine builds them at
load, resets slots when a new sequence starts in them, and copies the per-slot part out and back
for checkpoints (`slot_views` / `load`); the model reads and writes them inside `forward`.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch
from ballast.memory.specs import AttentionSpec, LayerSpec, RecurrentStateSpec
from ballast.models.base import ForwardBatch
from ballast.models.kv_store import SCALE_BYTES, KVStore, plan_layout, quantize_rows
from torch import Tensor


def attention_spec(num_kv_heads: int, head_dim: int, kv_dtype_bytes: int) -> AttentionSpec:
    """The spec of one attention layer's cache; 1-byte KV carries per token-head scales."""
    scale = SCALE_BYTES if kv_dtype_bytes == 1 else 0
    return AttentionSpec(num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=kv_dtype_bytes, scale_bytes=scale)


class LayerState(abc.ABC):
    """One decoder layer's state for every slot."""

    @abc.abstractmethod
    def reset(self, slots: Tensor) -> None:
        """Sequences start at position 0 in these slots."""

    @abc.abstractmethod
    def slot_views(self, slot: int) -> tuple[Tensor, ...]:
        """Views (no copy) of the slot's own state: what a checkpoint must copy to resume the slot
        later (empty where the state is shared by reference, as attention blocks are)."""

    @abc.abstractmethod
    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        """Put tensors shaped like `slot_views` (from any slot) into this slot."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes this state holds on its device."""


class PagedKV(LayerState):
    """One attention layer's view of the model's `KVStore`: writes this step's K/V into the slots'
    blocks and attends over them in place (on CUDA through the Triton kernels; on the CPU by
    gathering each sequence's blocks, one index_select per layer)."""

    def __init__(self, store: KVStore, layer: int) -> None:
        self.store = store
        self.layer = layer
        self.layout = store.layout
        self.kernels = store.device.type == "cuda"

    @property
    def num_kv_heads(self) -> int:
        return self.layout.num_kv_heads

    @property
    def quantized(self) -> bool:
        return self.layout.quantized

    @property
    def nbytes(self) -> int:
        return self.store.bytes_held // self.layout.num_layers

    def reset(self, slots: Tensor) -> None:
        # Nothing to clear: a sequence only reads positions it wrote, through its own table.
        return None

    def slot_views(self, slot: int) -> tuple[Tensor, ...]:
        # KV is reached through the block table and shared by reference, never copied per slot.
        return ()

    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        if saved:
            raise ValueError("an attention layer's checkpoint holds no tensors (its blocks are shared)")

    def _block_index(self, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        bs = self.layout.block_size
        blocks = self.store.block_table[batch.slot_of_token, batch.positions // bs].long()
        return blocks, batch.positions % bs

    def write(self, batch: ForwardBatch, k: Tensor, v: Tensor) -> None:
        """Store this step's k, v [T, n_kv_heads, head_dim] at (slot, position) of every token; the
        slot's table must already cover the position (the engine grows it before the step)."""
        kv = torch.cat((k, v), dim=1)
        if self.kernels:
            from ballast.models.paged_store import store_rows

            store_rows(self.store, self.layer, batch, kv)
            return
        host = self.store.host
        assert host is not None
        blocks, offsets = self._block_index(batch)
        if host.scale is None:
            host.kv[self.layer].index_put_((blocks, offsets), kv.to(self.layout.dtype))
            return
        q, scale = quantize_rows(kv)
        host.kv[self.layer].index_put_((blocks, offsets), q)
        host.scale[self.layer].index_put_((blocks, offsets), scale)

    def read(self, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
        """K and V of each sequence, positions [0, max_ctx): [B, max_ctx, n_kv, head_dim] in the
        model dtype, gathered from the blocks (CPU path). Positions past a sequence's own end hold
        stale data; the caller masks them."""
        host = self.store.host
        assert host is not None, "on CUDA attention reads the blocks in place (attend_in_place)"
        bs, b = self.layout.block_size, batch.num_seqs
        nb = -(-batch.max_ctx // bs)
        ids = self.store.block_table[batch.slots, :nb].reshape(-1).long()
        kv = _gather_blocks(host.kv[self.layer], ids, b)[:, : batch.max_ctx]
        if host.scale is not None:
            scale = _gather_blocks(host.scale[self.layer], ids, b)[:, : batch.max_ctx]
            kv = (kv.float() * scale[..., None]).to(self.layout.dtype)
        h = self.layout.num_kv_heads
        return kv[:, :, :h], kv[:, :, h:]

    def attend_in_place(self, q: Tensor, batch: ForwardBatch) -> Tensor:
        """q [T, Hq, D] over the blocks, by the CUDA kernels -> [T, Hq * D]."""
        from ballast.models.paged_triton import paged_decode, paged_prefill

        lay, cuda = self.layout, self.store.cuda
        assert cuda is not None
        out = torch.empty_like(q)
        common = dict(layer=self.layer, num_layers=lay.num_layers, seg_blocks=lay.seg_blocks,
                      block_size=lay.block_size, num_kv_heads=lay.num_kv_heads, kv_dtype=lay.storage_dtype,
                      sm_scale=q.shape[-1] ** -0.5)
        if batch.decode_only:
            paged_decode(q, out, cuda.kv_ptrs, cuda.scale_ptrs, self.store.block_table, batch.slots,
                         batch.positions + 1, max_ctx=batch.max_ctx, **common)  # type: ignore[arg-type]
        else:
            paged_prefill(q, out, cuda.kv_ptrs, cuda.scale_ptrs, self.store.block_table, batch.slots, batch.starts,
                          batch.cu_lens, max_len=batch.max_len, max_ctx=batch.max_ctx, **common)  # type: ignore[arg-type]
        return out.view(q.shape[0], -1)


def _gather_blocks(layer: Tensor, ids: Tensor, num_seqs: int) -> Tensor:
    """layer[ids] as [num_seqs, len(ids) / num_seqs * block_size, ...]. One block is contiguous
    memory, so gathering rows of a 2-D view is one memcpy per block."""
    rows = layer.view(layer.shape[0], -1).index_select(0, ids)
    return rows.view(num_seqs, -1, *layer.shape[2:])


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

    def slot_views(self, slot: int) -> tuple[Tensor, ...]:
        # The same size after any number of tokens: a checkpoint copies it whole.
        return self.conv[slot], self.recurrent[slot]

    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        if len(saved) != 2:
            raise ValueError(f"expected (conv, recurrent), got {len(saved)} tensors")
        self.conv[slot].copy_(saved[0])
        self.recurrent[slot].copy_(saved[1])


def build_states(specs: Sequence[LayerSpec], num_slots: int, store: KVStore | None, device: torch.device | str,
                 dtype: torch.dtype) -> list[LayerState]:
    """One state per decoder layer, chosen by its spec: attention layers view `store` (the i-th
    attention layer its layer i), recurrent layers get num_slots fixed-size states."""
    states: list[LayerState] = []
    attn = 0
    for spec in specs:
        if isinstance(spec, AttentionSpec):
            if store is None:
                raise ValueError("attention layers need a KV store")
            states.append(PagedKV(store, attn))
            attn += 1
        elif isinstance(spec, RecurrentStateSpec):
            state_dtype = torch.float32 if spec.state_dtype_bytes == 4 else dtype
            states.append(RecurrentState(num_slots, spec.conv_shape, spec.state_shape, dtype, device, state_dtype))
        else:
            raise TypeError(f"no state kind for spec {spec!r}")
    return states


def kv_store_for(specs: Sequence[LayerSpec], table_rows: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype, quantized_kv: bool = False, segment_bytes: int = 0) -> KVStore | None:
    """An empty KV store shaped for the attention layers of `specs` (None if there are none).
    Every attention layer must have the same KV heads and head dim."""
    attn = [s for s in specs if isinstance(s, AttentionSpec)]
    if not attn:
        return None
    shapes = {(s.num_kv_heads, s.head_dim) for s in attn}
    if len(shapes) != 1:
        raise ValueError(f"attention layers of different KV shapes {sorted(shapes)} are not supported")
    heads, head_dim = shapes.pop()
    dev = torch.device(device)
    layout = plan_layout(len(attn), heads, head_dim, dtype, quantized_kv, table_rows, max_len, dev,
                         segment_bytes=segment_bytes)
    return KVStore(layout, dev)


def allocate_states(
    specs: Sequence[LayerSpec],
    num_slots: int,
    max_len: int,
    device: torch.device | str,
    dtype: torch.dtype,
    quantized_kv: bool = False,
) -> list[LayerState]:
    """States for num_slots sequences of up to max_len tokens with every slot's blocks assigned up
    front (slot s owns blocks s * per_slot ..): for tests, benchmarks and the profiling pass, which
    run a model without the engine's allocator. quantized_kv stores attention KV as int8."""
    store = kv_store_for(specs, num_slots, max_len, device, dtype, quantized_kv)
    if store is not None:
        lay = store.layout
        for seg in range(lay.max_segments):
            store.add_segment(seg)
        per_slot = lay.max_blocks_per_seq
        for slot in range(num_slots):
            store.set_table(slot, 0, list(range(slot * per_slot, (slot + 1) * per_slot)))
    return build_states(specs, num_slots, store, device, dtype)


_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a model dtype (for `layer_specs(kv_dtype_bytes)`)."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unsupported model dtype {dtype}")
    return _DTYPE_BYTES[dtype]
