"""CPU attention over the KV blocks in place: each sequence's blocks are read as views, never
gathered into a copy.

A CPU store keeps a layer's blocks as one tensor [block, pos, 2 * kv_heads, head_dim], so a run of
consecutive block ids is one strided view. Each sequence's table is cut into such runs (one where
the allocator handed its blocks out in order, as a prompt's are), each run is attended by torch's
CPU flash kernel, and the parts merge by their log-sum-exp (the softmax over all keys, exactly). A
table in more than MAX_RUNS runs is gathered for that sequence: the copy costs less than the calls.
Decode-only steps over float32 blocks go to the C kernel (models/layers/cpu_blocks.py) where it builds;
int8 blocks and steps over both stores take the gathering path (`TorchPagedAttention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ballast.models.base import ForwardBatch
from ballast.models.kernels.cpu_kernel import decode_attention, kernel_fits
from ballast.models.kv_store import KVStore
from ballast.models.layers.attention import (
    PaddedGroup,
    PagedAttentionBackend,
    attend_gathered,
    block_ids,
    gather,
    padded_groups,
    row_index,
    write_rows,
)
from torch import Tensor

# Each sequence's (start, new tokens, runs of its table's blocks) for attention in place.
Runs = list[tuple[int, int, list[tuple[int, int, int]]]]


@dataclass(frozen=True)
class _Step:
    """What every layer of one CPU step shares."""

    batch: ForwardBatch
    rows: list[tuple[Tensor, Tensor]]  # per store of the step: each token's (block, offset)
    runs: Runs | None  # attended in place (one store in the model dtype), else gathered by groups
    groups: tuple[PaddedGroup, ...] = ()
    ids: tuple[list[Tensor], ...] = ()  # per group, per store: the blocks it gathers
    in_int8: tuple[Tensor, ...] = ()  # per group over both stores: [B_g, 1, 1, 1] in the int8 one
    kernel: bool = False  # decode tokens only over float32 blocks: the C kernel's


class TorchPagedAttention(PagedAttentionBackend):
    """The CPU's backend: blocks in the model dtype read in place, int8 blocks (and a step over both
    stores) gathered and attended padded, by groups."""

    _step: _Step | None = None

    def prepare(self, batch: ForwardBatch) -> None:
        stores = self.step_stores(batch)
        rows = [row_index(s, batch) for s in stores]
        if len(stores) == 1 and not self.layout.quantized:
            lay = self.layout
            kernel = batch.decode_only and lay.dtype == torch.float32 and kernel_fits(lay.head_dim)
            self._step = _Step(batch, rows, [] if kernel else table_runs(self.main, batch), kernel=kernel)
            return
        groups = padded_groups(batch)
        ids = tuple([block_ids(s, g.batch) for s in stores] for g in groups)
        in_int8: tuple[Tensor, ...] = ()
        if len(stores) == 2:
            assert self.int8_slots is not None
            in_int8 = tuple(self.int8_slots[g.batch.slots].view(-1, 1, 1, 1) for g in groups)
        self._step = _Step(batch, rows, None, groups, ids, in_int8)

    def _prepared(self, batch: ForwardBatch) -> _Step:
        step = self._step
        assert step is not None and step.batch is batch, "the step's first attention layer prepares it"
        return step

    def write(self, layer: int, batch: ForwardBatch, kv: Tensor) -> None:
        step = self._prepared(batch)
        for store, rows in zip(self.step_stores(batch), step.rows, strict=True):
            write_rows(store, layer, batch, kv, rows)

    def attend(self, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
        step = self._prepared(batch)
        if step.kernel and q.dtype == torch.float32:
            return decode_attention(self.main, layer, q, batch)
        if step.runs is not None:
            return attend_in_place(self.main, layer, q, batch, step.runs)
        q = q.to(self.layout.dtype)  # gathered K/V come in the model dtype (a bf16 prompt's too)
        if len(step.groups) == 1:
            return attend_gathered(q, self._gather(layer, step, 0), step.groups[0])
        out = torch.empty_like(q)
        for i, g in enumerate(step.groups):  # two: the decode tokens, and the prefill chunks
            assert g.token_index is not None
            picked = q.index_select(0, g.token_index)
            out.index_copy_(0, g.token_index, attend_gathered(picked, self._gather(layer, step, i), g))
        return out

    def _gather(self, layer: int, step: _Step, group: int) -> Tensor:
        """Group `group`'s K/V, each sequence's from the store it lives in."""
        sub = step.groups[group].batch
        kv = gather(self.main, layer, sub, step.ids[group][0])
        if step.in_int8:
            assert self.int8 is not None
            kv = torch.where(step.in_int8[group], gather(self.int8, layer, sub, step.ids[group][1]), kv)
        return kv


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


def table_runs(store: KVStore, batch: ForwardBatch) -> Runs:
    """Each sequence's start, new tokens and runs of blocks: the same for every layer of a step."""
    # The tensors, not the host lists: a decode graph's static batch keeps placeholders there.
    starts, lens = batch.starts.tolist(), batch.lens.tolist()
    tables = store.block_table[batch.slots].tolist()
    bs = store.layout.block_size
    return [(st, n, block_runs(t, st + n, bs)) for t, st, n in zip(tables, starts, lens, strict=True)]


def attend_in_place(
    store: KVStore, layer: int, q: Tensor, batch: ForwardBatch, runs_of: Runs | None = None
) -> Tensor:
    """q [T, Hq, D] of batch's tokens, each over its own sequence's cache (this step's K/V already
    written, in the model dtype) -> [T, Hq, D]; `runs_of`: `table_runs`, where computed already."""
    host = store.host
    assert host is not None and host.scale is None, "in place only over unquantized CPU blocks"
    kv_layer = host.kv[layer]
    out = torch.empty_like(q)
    first = 0
    for start, n, runs in runs_of if runs_of is not None else table_runs(store, batch):
        ctx = start + n
        source = kv_layer
        if len(runs) > MAX_RUNS:
            # cheaper than a kernel call per run (bench/cpu_attention.py): gathered, once a layer
            ids = torch.tensor([blk + k for _, blk, count in runs for k in range(count)])
            source, runs = kv_layer.index_select(0, ids), [(0, 0, len(ids))]
        if q.dtype != source.dtype:
            source, runs = _in_dtype(source, runs, q.dtype)
        keys = [_run_view(source, run, ctx) for run in runs]
        out[first : first + n] = _attend_one(keys, q[first : first + n], start, store.layout.num_kv_heads)
        first += n
    return out


# Runs of blocks attended in place, one kernel call each; a table in more pieces is gathered.
MAX_RUNS = 2


def _in_dtype(
    source: Tensor, runs: list[tuple[int, int, int]], dtype: torch.dtype
) -> tuple[Tensor, list[tuple[int, int, int]]]:
    """A sequence's blocks as one copy in `dtype`, for queries of another dtype than the store's
    (bfloat16 prompt chunks, models/blocks/cpu_linear.py): attention computes in its queries' dtype."""
    blocks = [source[blk : blk + count] for _, blk, count in runs]
    copy = (blocks[0] if len(blocks) == 1 else torch.cat(blocks)).to(dtype)
    return copy, [(0, 0, copy.shape[0])]


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


def _attend_one(keys: list[tuple[int, Tensor]], q: Tensor, start: int, n_kv: int) -> Tensor:
    """One sequence's n tokens (positions start ..) over its key runs. Keys below `start` (the
    cached prefix) are visible to every query: no mask, each KV head's group of query heads folded
    into the query rows (row i * group + j: token i's head j), so K/V are read once per KV head.
    The chunk's own keys are attended causally with the KV heads repeated (n rows: a small copy)."""
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
