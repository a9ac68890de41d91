"""CPU attention over the KV blocks in place: each sequence's blocks are read as views, never
gathered into a copy.

A CPU store keeps one layer's blocks as one tensor [block, pos, 2 * kv_heads, head_dim], so a
run of consecutive block ids is one strided view of the positions it holds. Each sequence's
table is cut into such runs (one run where the allocator handed its blocks out in order, the
usual case), every run is attended by torch's CPU flash kernel, which also returns each row's
log-sum-exp, and the runs' results are merged by those (the softmax over all keys, exactly).

Grouped-query attention folds each KV head's group of query heads into the query rows, so K and
V are read once per KV head and never expanded to every query head.

The reference it replaces gathered every cached block of the prefix for every chunk and layer:
a 2k-token prompt in 512-token chunks copied 2.5 prefixes' worth of KV per layer.
"""

from __future__ import annotations

import torch
from ballast.models.base import ForwardBatch
from ballast.models.kv_store import KVStore
from torch import Tensor


def block_runs(ids: list[int], ctx: int, block_size: int) -> list[tuple[int, int, int]]:
    """(first position, first block, block count) of each run of consecutive block ids among
    the first ceil(ctx / block_size) entries of a sequence's table."""
    runs: list[tuple[int, int, int]] = []
    for i, block in enumerate(ids[: -(-ctx // block_size)]):
        if runs and runs[-1][1] + runs[-1][2] == block:
            pos, first, n = runs[-1]
            runs[-1] = (pos, first, n + 1)
        else:
            runs.append((i * block_size, block, 1))
    return runs


def attend_in_place(store: KVStore, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
    """q [T, Hq, D] of batch's tokens, each over its own sequence's cache (this step's K/V
    already written) -> [T, Hq, D]. The store holds K/V in the model dtype (not int8)."""
    host = store.host
    assert host is not None and host.scale is None, "in place only over unquantized CPU blocks"
    lay = store.layout
    kv_layer = host.kv[layer]
    tables = store.block_table[batch.slots].tolist()
    out = torch.empty_like(q)
    first = 0
    for b, (start, n) in enumerate(zip(batch.starts_list, batch.lens_list, strict=True)):
        runs = block_runs(tables[b], start + n, lay.block_size)
        out[first : first + n] = _attend_one(kv_layer, q[first : first + n], start, runs, lay.num_kv_heads)
        first += n
    return out


def _attend_one(
    kv_layer: Tensor, q: Tensor, start: int, runs: list[tuple[int, int, int]], n_kv: int
) -> Tensor:
    """One sequence's n tokens (absolute positions start ..) over its runs of blocks."""
    n, heads, dim = q.shape
    group = heads // n_kv
    bs = kv_layer.shape[1]
    ctx = start + n
    # Query heads h = kv * group + j (the order GQA's repeat_interleave implies): row i * group + j
    # of KV head kv's query block holds token i's head j.
    qf = q.view(n, n_kv, group, dim).permute(1, 0, 2, 3).reshape(1, n_kv, n * group, dim)
    row_pos = start + torch.arange(n).repeat_interleave(group)  # [n * group] absolute positions
    outs, lses = [], []
    for pos, block, count in runs:
        length = min(count * bs, ctx - pos)
        kv = kv_layer[block : block + count].view(count * bs, 2 * n_kv, dim)[:length]
        keys = kv[:, :n_kv].permute(1, 0, 2).unsqueeze(0)  # [1, n_kv, S, D], a view
        values = kv[:, n_kv:].permute(1, 0, 2).unsqueeze(0)
        mask = None
        if pos + length - 1 > start:  # some key lies past the first query: causal mask
            hidden = (pos + torch.arange(length))[None, :] > row_pos[:, None]
            # additive, in q's dtype (the kernel takes no boolean mask)
            mask = q.new_zeros(hidden.shape).masked_fill_(hidden, float("-inf"))[None, None]
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qf, keys, values, attn_mask=mask, scale=dim**-0.5
        )
        if pos > start:  # rows before the run's first key see none of it; the kernel gives
            lse = lse.masked_fill(row_pos < pos, float("-inf"))  # them lse 0, not -inf
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        merged = outs[0]
    else:
        # softmax over every key = each run's softmax weighted by exp(its log-sum-exp); a row
        # that sees no key of a run has lse -inf there and weight 0.
        lse = torch.stack(lses)  # [R, 1, n_kv, rows]
        weight = torch.softmax(lse, dim=0)
        stacked = torch.stack(outs).nan_to_num(0.0)  # [R, 1, n_kv, rows, D]
        merged = (stacked * weight[..., None]).sum(0)
    return merged.reshape(n_kv, n, group, dim).permute(1, 0, 2, 3).reshape(n, heads, dim)
