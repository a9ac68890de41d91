"""The CUDA attention backend: this step's K/V rows stored by a Triton kernel
(models/paged_store.py), every sequence's blocks read in place by the paged attention kernels
(models/paged_triton.py) through the block table.

Nothing here waits on the host or on the device: `prepare` and every layer's calls only queue
kernels on tensors of the batch and the stores, so a step is captured whole in a CUDA graph and
replays with the addresses it was captured with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ballast.models.attention import PagedAttentionBackend
from ballast.models.base import ForwardBatch
from ballast.models.kv_store import KVStore
from ballast.models.paged_store import store_rows
from ballast.models.paged_triton import paged_decode, paged_prefill
from torch import Tensor


@dataclass(frozen=True)
class _Reads:
    """How one store is attended this step: the prefill chunks' starts and the one-token
    sequences' context lengths (all of them in a decode step, the tail's beside prompt chunks).
    In a step over both stores the other store's sequences read only their first position (in
    the sink block), and their result is discarded."""

    store: KVStore
    starts: Tensor
    decode_ctx: Tensor | None


class TritonPagedAttention(PagedAttentionBackend):
    """The CUDA backend (see the module doc)."""

    _reads: tuple[_Reads, ...] = ()
    _in_int8: Tensor | None = None  # [T, 1, 1] over both stores: the token's sequence is int8

    def prepare(self, batch: ForwardBatch) -> None:
        ctx = batch.positions + 1 if batch.decode_only else batch.tail_ctx
        if not (batch.int8_kv and self.int8 is not None):
            self._reads, self._in_int8 = (_Reads(self.main, batch.starts, ctx),), None
            return
        assert self.int8_slots is not None
        in_int8 = self.int8_slots[batch.slots]
        reads = []
        for store, foreign in ((self.main, in_int8), (self.int8, ~in_int8)):
            starts = batch.starts if batch.decode_only else torch.where(foreign, 0, batch.starts)
            cut = ctx
            if ctx is not None:
                tail = foreign if batch.decode_only else foreign[batch.tail_from :]
                cut = torch.where(tail, torch.ones_like(ctx), ctx)
            reads.append(_Reads(store, starts, cut))
        self._reads = tuple(reads)
        self._in_int8 = in_int8[batch.seq_of_token].view(-1, 1, 1)

    def write(self, layer: int, batch: ForwardBatch, kv: Tensor) -> None:
        assert self._reads, "the step's first attention layer prepares it"
        for reads in self._reads:
            store_rows(reads.store, layer, batch, kv)

    def attend(self, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
        """Over both stores each token keeps the result of its own sequence's store."""
        outs = [_attend(r, layer, q, batch) for r in self._reads]
        if self._in_int8 is None:
            return outs[0]
        return torch.where(self._in_int8, outs[1], outs[0])


def _attend(reads: _Reads, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
    """q [T, Hq, D] attended over one store's blocks by the Triton kernels -> [T, Hq, D]."""
    store = reads.store
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

    def decode(first_token: int, slots: Tensor, ctx: Tensor, max_ctx: int) -> None:
        """The one-token sequences whose tokens start at `first_token`."""
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
        assert reads.decode_ctx is not None
        decode(0, batch.slots, reads.decode_ctx, batch.max_ctx)
        return out
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
        reads.starts[:head],
        batch.cu_lens[: head + 1],
        max_len=batch.max_len,
        max_ctx=batch.max_ctx,
        **common,
    )  # type: ignore[arg-type]
    if head < batch.num_seqs:
        assert batch.tail_slots is not None and reads.decode_ctx is not None
        decode(head_tokens, batch.tail_slots, reads.decode_ctx, batch.tail_max_ctx)
    return out
