"""Attention over the paged KV stores: the interface of its backends (Triton on CUDA,
models/layers/cpu_attention.py on the CPU) and the CPU's gathering helpers. Models never see the layout:
a layer hands its `PagedKV` this step's K/V and queries and gets each token's output back.

A step holding sequences of both KV formats (`ForwardBatch.uses_int8_kv`: the ladder's int8 rung)
writes every token to both stores and attends both: a slot's row in the store it does not use
points at the sink block, and each token keeps its own store's result (`int8_slots` says which).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from ballast.models.base import ForwardBatch
from ballast.models.kv_store import KVStore, quantize_rows
from torch import Tensor


class PagedAttentionBackend(abc.ABC):
    """How the attention layers of one model write and read its KV stores on one kind of device.
    `prepare(batch)` computes once a step what the layers share; the step's first attention layer
    calls it (`PagedKV`), since models run from many places (runner, graph capture, profiling,
    tests) and all of them reach attention through their layers, in order."""

    def __init__(self, main: KVStore, int8: KVStore | None = None, int8_slots: Tensor | None = None) -> None:
        if (int8 is None) != (int8_slots is None):
            raise ValueError("an int8 store comes with the table of the slots that live in it")
        self.main = main
        self.int8 = int8
        self.int8_slots = int8_slots  # [table rows] bool: the slot's sequence lives in `int8`
        self.layout = main.layout
        self._first_layer: int | None = None

    @property
    def stores(self) -> list[KVStore]:
        return [self.main] if self.int8 is None else [self.main, self.int8]

    def step_stores(self, batch: ForwardBatch) -> list[KVStore]:
        """The stores this step writes and reads: both where its batch holds int8 sequences."""
        return self.stores if batch.uses_int8_kv else [self.main]

    def first_layer(self, layer: int) -> bool:
        """Whether `layer` is the first of this backend's layers (the one that prepares a step)."""
        if self._first_layer is None:
            self._first_layer = layer
        return layer == self._first_layer

    @abc.abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """The step `batch` starts: what its layers share is computed now."""

    @abc.abstractmethod
    def write(self, layer: int, batch: ForwardBatch, kv: Tensor) -> None:
        """Store kv [T, 2 * n_kv, head_dim] at (slot, position) of every token of the step."""

    @abc.abstractmethod
    def attend(self, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
        """q [T, Hq, D] over each token's own sequence's cache (this step's K/V written) -> [T, Hq, D]."""


def row_index(store: KVStore, batch: ForwardBatch) -> tuple[Tensor, Tensor]:
    """(block, offset) of every token's row in a CPU store: the same for every layer of a step."""
    bs = store.layout.block_size
    return store.block_table[batch.slot_of_token, batch.positions // bs].long(), batch.positions % bs


def write_rows(
    store: KVStore, layer: int, batch: ForwardBatch, kv: Tensor, index: tuple[Tensor, Tensor] | None = None
) -> None:
    """Store kv [T, 2 * n_kv, head_dim] at every token's (slot, position) in a CPU store."""
    host = store.host
    assert host is not None, "on CUDA a Triton kernel writes the rows"
    index = index if index is not None else row_index(store, batch)
    if host.scale is None:
        host.kv[layer].index_put_(index, kv.to(store.layout.dtype))
        return
    q, scale = quantize_rows(kv)
    host.kv[layer].index_put_(index, q)
    host.scale[layer].index_put_(index, scale)


def block_ids(store: KVStore, batch: ForwardBatch) -> Tensor:
    """The blocks each sequence of batch reads, its table's first ceil(max_ctx / block_size)."""
    return store.block_table[batch.slots, : -(-batch.max_ctx // store.layout.block_size)].reshape(-1).long()


def gather(store: KVStore, layer: int, batch: ForwardBatch, ids: Tensor | None = None) -> Tensor:
    """[B, max_ctx, 2 * n_kv, head_dim] in the model dtype from the store's blocks (`ids`: their
    `block_ids`, if computed already). Positions past a sequence's end are stale; attention masks them."""
    host = store.host
    assert host is not None, "on CUDA attention reads the blocks in place"
    lay, b = store.layout, batch.num_seqs
    ids = ids if ids is not None else block_ids(store, batch)
    kv = _gather_blocks(host.kv[layer], ids, b)[:, : batch.max_ctx]
    if host.scale is not None:
        scale = _gather_blocks(host.scale[layer], ids, b)[:, : batch.max_ctx]
        kv = (kv.float() * scale[..., None]).to(lay.dtype)
    return kv


@dataclass(frozen=True)
class PaddedGroup:
    """Sequences attended in one padded call: their sub-batch, where their tokens sit in the full
    batch (None: the group is the whole batch), and their mask (None: nothing to mask)."""

    batch: ForwardBatch
    token_index: Tensor | None
    mask: Tensor | None


def padded_groups(batch: ForwardBatch) -> tuple[PaddedGroup, ...]:
    """The groups a CPU step attends in: the whole batch, or its decode tokens and prefill chunks
    apart, each padded to its own longest run (a decode token never pays a chunk's padding)."""
    decodes = [i for i, n in enumerate(batch.lens_list) if n == 1]
    if not decodes or len(decodes) == batch.num_seqs:
        return (PaddedGroup(batch, None, slot_attention_mask(batch)),)
    chunks = [i for i, n in enumerate(batch.lens_list) if n > 1]
    groups = []
    for seqs in (decodes, chunks):
        sub, token_index = batch.subset(seqs)
        groups.append(PaddedGroup(sub, token_index, slot_attention_mask(sub)))
    return tuple(groups)


def slot_attention_mask(batch: ForwardBatch) -> Tensor | None:
    """[B, 1, max_len, max_ctx] bool: query i of sequence b (absolute position starts[b] + i) sees
    cache positions <= its own. Padded query rows see position 0 only, so no row is fully masked
    (a fully masked row would give NaN). None when nothing needs masking (one decode token)."""
    if batch.num_seqs == 1 and batch.max_len == 1 and batch.max_ctx == batch.starts_list[0] + 1:
        return None
    dev = batch.device
    i = torch.arange(batch.max_len, device=dev)
    j = torch.arange(batch.max_ctx, device=dev)
    last = (batch.lens - 1)[:, None]
    query_pos = batch.starts[:, None] + torch.minimum(i[None, :], last)  # [B, max_len]
    return (j[None, None, :] <= query_pos[:, :, None])[:, None]


def attend_gathered(q: Tensor, kv: Tensor, group: PaddedGroup) -> Tensor:
    """q [T_g, Hq, D] of one group's tokens over its gathered kv [B_g, max_ctx, 2 * n_kv, D]."""
    batch = group.batch
    b, L = batch.num_seqs, batch.max_len
    heads, dim = q.shape[1], q.shape[2]
    n_kv = kv.shape[2] // 2
    keys, values = kv[:, :, :n_kv], kv[:, :, n_kv:]
    if batch.decode_only:
        qp = q.reshape(b, 1, heads, dim)
    else:
        qp = q.new_zeros(b * L, heads, dim).index_copy_(0, batch.pad_index, q).view(b, L, heads, dim)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=group.mask,
        enable_gqa=n_kv != heads,
    )  # [B, Hq, L, D]
    out = out.transpose(1, 2).reshape(b * L, heads, dim)
    return out if batch.decode_only else out.index_select(0, batch.pad_index)


def _gather_blocks(layer: Tensor, ids: Tensor, num_seqs: int) -> Tensor:
    """layer[ids] as [num_seqs, len(ids) / num_seqs * block_size, ...]. One block is contiguous
    memory, so gathering rows of a 2-D view is one memcpy per block."""
    rows = layer.view(layer.shape[0], -1).index_select(0, ids)
    return rows.view(num_seqs, -1, *layer.shape[2:])
