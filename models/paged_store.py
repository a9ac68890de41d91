"""Writing a step's K/V rows into the CUDA KV blocks (Triton).

Segments are separate allocations found through `kv_ptrs`, so the destination of a token is
known only on the device: block = block_table[slot, pos // block_size], then the segment's base
address from the table. One program per token copies its 2 * kv_heads * head_dim values (and, for
int8 blocks, its 2 * kv_heads scales). No host sync, so the write is part of a captured graph.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ballast.models.base import ForwardBatch
    from ballast.models.kv_store import KVStore

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
    from ballast.models.kv_store import quantize_rows

    cuda = store.cuda
    assert cuda is not None
    if not store.layout.quantized:
        _launch(kv.to(store.layout.dtype).contiguous(), cuda.kv_ptrs, store, layer, batch)
        return
    q, scale = quantize_rows(kv)
    _launch(q.contiguous(), cuda.kv_ptrs, store, layer, batch)
    _launch(scale.to(torch.float32).contiguous(), cuda.scale_ptrs, store, layer, batch)
