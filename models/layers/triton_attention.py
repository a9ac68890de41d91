"""The CUDA attention backend: a Triton kernel stores this step's K/V rows into their blocks (here),
and the paged attention kernels (models/kernels/paged_triton.py) read every sequence's blocks in place
through the block table.

Segments are separate allocations found through `kv_ptrs`, so the destination of a token is
known only on the device: block = block_table[slot, pos // block_size], then the segment's base
address from the table. One program per token copies its 2 * kv_heads * head_dim values (and, for
int8 blocks, its 2 * kv_heads scales). Nothing here waits on the host or the device: `prepare` and
every layer's calls only queue kernels, so a step is captured whole in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from ballast.models.base import ForwardBatch
from ballast.models.kernels.paged_triton import paged_decode, paged_prefill
from ballast.models.kv_store import KVStore, quantize_rows
from ballast.models.layers.attention import PagedAttentionBackend
from torch import Tensor


class TritonPagedAttention(PagedAttentionBackend):
    """The CUDA backend. Over both stores (`step_stores`) each store is attended with the
    other store's sequences cut to their first position (in the sink), and each token keeps the
    result of its own sequence's store."""

    # The step's split between the stores: (in int8, in main) per sequence and, per token,
    # [T, 1, 1] in int8. None: the step reads the main store only.
    _split: tuple[Tensor, Tensor, Tensor] | None = None
    _stores: Sequence[KVStore] = ()

    def prepare(self, batch: ForwardBatch) -> None:
        self._stores = self.step_stores(batch)
        self._split = None
        if len(self._stores) == 2:
            assert self.int8_slots is not None
            in_int8 = self.int8_slots[batch.slots]
            self._split = (in_int8, ~in_int8, in_int8[batch.seq_of_token].view(-1, 1, 1))

    def write(self, layer: int, batch: ForwardBatch, kv: Tensor) -> None:
        assert self._stores, "the step's first attention layer prepares it"
        for store in self._stores:
            store_rows(store, layer, batch, kv)

    def attend(self, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
        if self._split is None:
            return attend_kernels(self.main, layer, q, batch, None)
        assert self.int8 is not None
        in_int8, in_main, token_in_int8 = self._split
        main = attend_kernels(self.main, layer, q, batch, in_int8)
        return torch.where(token_in_int8, attend_kernels(self.int8, layer, q, batch, in_main), main)


_kernel: Any = None


def _build() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def store_kernel(
        src,
        ptrs,
        block_table,
        slot_of_token,
        positions,
        table_stride,
        layer,
        num_layers,
        seg_blocks,
        BLOCK_SIZE: tl.constexpr,
        ROW: tl.constexpr,
        ROW_POW2: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_of_token + t)
        pos = tl.load(positions + t)
        block = tl.load(block_table + slot * table_stride + pos // BLOCK_SIZE).to(tl.int64)
        seg = block // seg_blocks
        local = block % seg_blocks
        base = tl.load(ptrs + seg).to(src.dtype)
        dst = base + ((local * num_layers + layer) * BLOCK_SIZE + pos % BLOCK_SIZE) * ROW
        cols = tl.arange(0, ROW_POW2)
        mask = cols < ROW
        tl.store(dst + cols, tl.load(src + t * ROW + cols, mask=mask), mask=mask)

    return store_kernel


def _launch(src: Tensor, ptrs: Tensor, store: KVStore, layer: int, batch: ForwardBatch) -> None:
    global _kernel
    if _kernel is None:
        _kernel = _build()
    import triton

    lay = store.layout
    row = src[0].numel()
    _kernel[(src.shape[0],)](
        src,
        ptrs,
        store.block_table,
        batch.slot_of_token,
        batch.positions,
        store.block_table.stride(0),
        layer,
        lay.num_layers,
        lay.seg_blocks,
        BLOCK_SIZE=lay.block_size,
        ROW=row,
        ROW_POW2=triton.next_power_of_2(row),
    )


def store_rows(store: KVStore, layer: int, batch: ForwardBatch, kv: Tensor) -> None:
    """kv [T, 2 * kv_heads, head_dim] of this step's tokens into their blocks of `layer`."""
    cuda = store.cuda
    assert cuda is not None
    if not store.layout.quantized:
        _launch(kv.to(store.layout.dtype).contiguous(), cuda.kv_ptrs, store, layer, batch)
        return
    q, scale = quantize_rows(kv)
    _launch(q.contiguous(), cuda.kv_ptrs, store, layer, batch)
    _launch(scale.to(torch.float32).contiguous(), cuda.scale_ptrs, store, layer, batch)


def attend_kernels(
    store: KVStore, layer: int, q: Tensor, batch: ForwardBatch, foreign: Tensor | None
) -> Tensor:
    """q [T, Hq, D] attended over one store's blocks by the Triton kernels -> [T, Hq, D].
    `foreign` [B] marks sequences that live in the other store: they read only their first
    position (the sink block), and the caller discards their result."""
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
