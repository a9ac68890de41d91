"""CPU attention over the KV blocks in place: each sequence's blocks are read as views, never
gathered into a copy.

A CPU store keeps one layer's blocks as one tensor [block, pos, 2 * kv_heads, head_dim], so a
run of consecutive block ids is one strided view of the positions it holds. Each sequence's
table is cut into such runs (one run where the allocator handed its blocks out in order, as a
prompt's blocks are), every run is attended by torch's CPU flash kernel, which also returns each
row's log-sum-exp, and the parts merge by those (the softmax over all keys, exactly). A table in
more than MAX_RUNS pieces (sequences that grew in turns, block by block) is gathered for that
sequence instead: a kernel call per block costs more than the copy.

The cached prefix is visible to every query of a chunk, so it needs no mask; grouped-query
attention folds each KV head's group of query heads into the query rows there, so K and V are
read once per KV head and never expanded. The chunk's own keys are attended causally.

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
    # The tensors, not the host lists: a decode graph's static batch keeps placeholders there.
    starts, lens = batch.starts.tolist(), batch.lens.tolist()
    if store.step_runs is None or store.step_runs[0] is not batch or store.step_runs[1] != starts:
        tables = store.block_table[batch.slots].tolist()  # once a step, not a layer
        ends = [st + n for st, n in zip(starts, lens, strict=True)]
        runs_of = [block_runs(t, ctx, lay.block_size) for t, ctx in zip(tables, ends, strict=True)]
        store.step_runs = (batch, starts, runs_of)
    runs_of = store.step_runs[2]
    out = torch.empty_like(q)
    first = 0
    for b, (start, n) in enumerate(zip(starts, lens, strict=True)):
        ctx = start + n
        runs = runs_of[b]
        source = kv_layer
        if len(runs) > MAX_RUNS:
            # A table in many pieces: one call per piece costs more than a copy of its blocks
            # (bench/cpu_attention.py), so this sequence's blocks are gathered, once a layer.
            ids = torch.tensor([blk + k for _, blk, count in runs for k in range(count)])
            source, runs = kv_layer.index_select(0, ids), [(0, 0, len(ids))]
        if n == 1 and len(runs) == 1:  # a decode token over blocks in order: no parts to merge
            out[first] = _decode_one(_run_view(source, runs[0], ctx)[1], q[first], lay.num_kv_heads)
        else:
            keys = [_run_view(source, run, ctx) for run in runs]
            out[first : first + n] = _attend_one(keys, q[first : first + n], start, lay.num_kv_heads)
        first += n
    return out


# Runs of blocks attended in place, one kernel call each; a table in more pieces is gathered.
MAX_RUNS = 2


def _run_view(kv_layer: Tensor, run: tuple[int, int, int], ctx: int) -> tuple[int, Tensor]:
    """(first position, [S, 2 * n_kv, D] view) of one run's positions below ctx."""
    pos, block, count = run
    bs = kv_layer.shape[1]
    length = min(count * bs, ctx - pos)
    return pos, kv_layer[block : block + count].view(count * bs, *kv_layer.shape[2:])[:length]


def _flash(q: Tensor, kv: Tensor, n_kv: int, causal: bool) -> tuple[Tensor, Tensor]:
    """torch's CPU flash kernel: (out, log-sum-exp) of q [1, H, L, D] over kv [S, 2 * n_kv, D]
    (K and V heads as H / n_kv folds them: strided views, no copy)."""
    keys = kv[:, :n_kv].permute(1, 0, 2).unsqueeze(0)
    values = kv[:, n_kv:].permute(1, 0, 2).unsqueeze(0)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, keys, values, is_causal=causal, scale=q.shape[-1] ** -0.5
    )
    return out, lse


def _decode_one(kv: Tensor, q: Tensor, n_kv: int) -> Tensor:
    """One decode token's q [Hq, D] over its keys kv [S, 2 * n_kv, D] -> [Hq, D]: one flash
    call, each KV head's group of query heads as its query rows (already in head order for one
    token), no mask. The same maths as `_attend_one` in a third of its ops (30 layers a step)."""
    heads, dim = q.shape
    k, v = kv.permute(1, 0, 2).split(n_kv)  # [n_kv, S, D] views
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.view(1, n_kv, heads // n_kv, dim), k.unsqueeze(0), v.unsqueeze(0), scale=dim**-0.5
    )
    return out.reshape(heads, dim)


def _attend_one(keys: list[tuple[int, Tensor]], q: Tensor, start: int, n_kv: int) -> Tensor:
    """One sequence's n tokens (absolute positions start ..) over its key runs.

    Keys below `start` (the cached prefix) are visible to every query: attended with no mask,
    each KV head's group of query heads folded into the query rows (row i * group + j: token i's
    head j), so K/V are read once per KV head. The chunk's own keys are attended causally with
    the KV heads repeated (n rows: a small copy). The parts merge by their log-sum-exp."""
    n, heads, dim = q.shape
    group = heads // n_kv
    outs, lses = [], []
    folded = q.view(n, n_kv, group, dim).permute(1, 0, 2, 3).reshape(1, n_kv, n * group, dim)
    # A decode token sees every key: the whole context is "prefix".
    prefix_end = start + 1 if n == 1 else start
    for pos, kv in keys:
        if pos < prefix_end:
            o, lse = _flash(folded, kv[: prefix_end - pos], n_kv, causal=False)
            # back to [1, Hq, n, D] / [1, Hq, n]: head kv * group + j, token i (for one token
            # the folded rows are already in head order)
            if n > 1:
                o = o.reshape(n_kv, n, group, dim).permute(0, 2, 1, 3)
                lse = lse.reshape(n_kv, n, group).permute(0, 2, 1)
            outs.append(o.reshape(1, heads, n, dim))
            lses.append(lse.reshape(1, heads, n))
    if n > 1:
        own = torch.cat([kv[max(0, start - pos) :] for pos, kv in keys if pos + kv.shape[0] > start])
        own = torch.cat(
            (own[:, :n_kv].repeat_interleave(group, 1), own[:, n_kv:].repeat_interleave(group, 1)), 1
        )
        o, lse = _flash(q.transpose(0, 1).unsqueeze(0), own, heads, causal=True)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1:
        merged = outs[0]
    else:
        weight = torch.softmax(torch.stack(lses), dim=0)  # [parts, 1, Hq, n]
        merged = (torch.stack(outs) * weight[..., None]).sum(0)
    return merged[0].transpose(0, 1)  # [n, Hq, D]
