"""Attention over the paged KV store: the two backends behind `PagedKV.write` / `PagedKV.attend`.

Models never see the layout: they hand over this step's K/V and queries with the step's
`ForwardBatch`, and get each token's attention output back.

- CUDA: a Triton kernel stores each token's K/V row into its block; the attention kernels read
  every sequence's blocks in place through the block table (decode split along the context,
  prefill chunks over the cached blocks plus the chunk, causally). int8 blocks are dequantized
  inside the kernels.
- CPU: blocks in the model dtype are read in place (models/cpu_attention.py); int8 blocks, and
  steps over both stores, are gathered (one index_select per layer and store;
  a block is contiguous, so one memcpy each) and attended by `scaled_dot_product_attention`.
  A step that mixes decode tokens with prefill chunks attends them as two groups, each padded to
  its own longest run, so a decode token never pays for a whole chunk's padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from ballast.models.base import ForwardBatch
from ballast.models.kv_store import KVStore, quantize_rows
from torch import Tensor

# --- writing this step's rows ---------------------------------------------------------------


def write_rows(store: KVStore, layer: int, batch: ForwardBatch, kv: Tensor) -> None:
    """Store kv [T, 2 * n_kv, head_dim] at (slot, position) of every token of batch."""
    if store.cuda is not None:
        from ballast.models.paged_store import store_rows

        store_rows(store, layer, batch, kv)
        return
    host = store.host
    assert host is not None
    index = _step_index(store, batch)[0]
    if host.scale is None:
        host.kv[layer].index_put_(index, kv.to(store.layout.dtype))
        return
    q, scale = quantize_rows(kv)
    host.kv[layer].index_put_(index, q)
    host.scale[layer].index_put_(index, scale)


# --- CUDA: the kernels read the blocks in place ------------------------------------------------


def attend_kernels(
    store: KVStore, layer: int, q: Tensor, batch: ForwardBatch, foreign: Tensor | None
) -> Tensor:
    """q [T, Hq, D] attended over one store's blocks by the Triton kernels -> [T, Hq, D].
    `foreign` [B] marks sequences that live in the other store: they read only their first
    position (the sink block), and the caller discards their result."""
    from ballast.models.paged_triton import paged_decode, paged_prefill

    lay, cuda = store.layout, store.cuda
    assert cuda is not None
    out = torch.empty_like(q)
    common = dict(
        layer=layer,
        num_layers=lay.num_layers,
        seg_blocks=lay.seg_blocks,
        block_size=lay.block_size,
        num_kv_heads=lay.num_kv_heads,
        kv_dtype=lay.storage_dtype,
        sm_scale=q.shape[-1] ** -0.5,
    )

    def decode(first_token: int, first_seq: int, slots: Tensor, ctx: Tensor, max_ctx: int) -> None:
        """The one-token sequences from `first_seq` on (their tokens from `first_token` on)."""
        if foreign is not None:
            ctx = torch.where(foreign[first_seq:], torch.ones_like(ctx), ctx)
        paged_decode(
            q[first_token:],
            out[first_token:],
            cuda.kv_ptrs,
            cuda.scale_ptrs,
            store.block_table,
            slots,
            ctx,
            max_ctx=max_ctx,
            **common,
        )  # type: ignore[arg-type]

    if batch.decode_only:
        decode(0, 0, batch.slots, batch.positions + 1, batch.max_ctx)
        return out
    starts = (
        batch.starts
        if foreign is None
        else torch.where(foreign, torch.zeros_like(batch.starts), batch.starts)
    )
    # Prompt chunks by the prefill kernel; a tail of one-token sequences (decodes beside a prompt)
    # by the decode kernel. In the prefill kernel each of them took a tile of query rows, one real,
    # over its whole context: Llama-8B shape, 32 decodes at 2k context beside a 1k prompt, 29.1 ms
    # of attention a step, now 2.4 + 2.7 (bench/decode_profile.py --mixed).
    head = batch.tail_from or batch.num_seqs
    head_tokens = q.shape[0] - (batch.num_seqs - head)  # the tail's sequences: a token each
    paged_prefill(
        q[:head_tokens],
        out[:head_tokens],
        cuda.kv_ptrs,
        cuda.scale_ptrs,
        store.block_table,
        batch.slots[:head],
        starts[:head],
        batch.cu_lens[: head + 1],
        max_len=batch.max_len,
        max_ctx=batch.max_ctx,
        **common,
    )  # type: ignore[arg-type]
    if head < batch.num_seqs:
        assert batch.tail_slots is not None and batch.tail_ctx is not None
        decode(head_tokens, head, batch.tail_slots, batch.tail_ctx, batch.tail_max_ctx)
    return out


# --- CPU: gather the blocks, then scaled_dot_product_attention --------------------------------


def gather(store: KVStore, layer: int, batch: ForwardBatch) -> Tensor:
    """[B, max_ctx, 2 * n_kv, head_dim] in the model dtype, gathered from the store's blocks.
    Positions past a sequence's own end hold stale data; attention masks them."""
    host = store.host
    assert host is not None, "on CUDA attention reads the blocks in place"
    lay, b = store.layout, batch.num_seqs
    ids = _step_index(store, batch)[1]
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
    """The groups a CPU step attends in: the whole batch, or its decode tokens and its prefill
    chunks apart. The same for every layer of a step (the caller caches them per batch)."""
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
    """q [T_g, Hq, D] of one group's tokens over its gathered kv [B_g, max_ctx, 2 * n_kv, D]
    -> [T_g, Hq, D]."""
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


def _step_index(store: KVStore, batch: ForwardBatch) -> tuple[tuple[Tensor, Tensor], Tensor]:
    """(block, offset) of every token's row and the blocks each sequence reads, for the CPU path:
    the same for every layer of a step, so computed once per step and store."""
    for seen, rows, ids in store.step_index:
        if seen is batch:
            return rows, ids
    bs = store.layout.block_size
    rows = (store.block_table[batch.slot_of_token, batch.positions // bs].long(), batch.positions % bs)
    ids = store.block_table[batch.slots, : -(-batch.max_ctx // bs)].reshape(-1).long()
    # A step's batch and its two attention groups at most; older entries are past steps'.
    store.step_index = [*store.step_index[-2:], (batch, rows, ids)]
    return rows, ids


def _gather_blocks(layer: Tensor, ids: Tensor, num_seqs: int) -> Tensor:
    """layer[ids] as [num_seqs, len(ids) / num_seqs * block_size, ...]. One block is contiguous
    memory, so gathering rows of a 2-D view is one memcpy per block."""
    rows = layer.view(layer.shape[0], -1).index_select(0, ids)
    return rows.view(num_seqs, -1, *layer.shape[2:])
