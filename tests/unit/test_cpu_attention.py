"""CPU attention in place (models/layers/cpu_attention.py) against the gathering reference it replaces
(models/layers/attention.py: gather + scaled_dot_product_attention) on one real KV store: tables in
order (one run) and shuffled (a run per block, merged by log-sum-exp), prompt chunks that cross
block boundaries beside decode tokens, grouped-query heads; and the C kernel that serves steps of
decode tokens over float32 blocks (models/layers/cpu_blocks.py) against the same reference."""

from __future__ import annotations

import pytest
import torch
from ballast.memory.specs import AttentionSpec
from ballast.models.base import ForwardBatch
from ballast.models.kernels import cpu_kernel
from ballast.models.kv_store import SINK_BLOCK
from ballast.models.layers.attention import attend_gathered, gather, padded_groups, write_rows
from ballast.models.layers.cpu_attention import attend_in_place, block_runs
from ballast.models.layers.state import PagedKV, allocate_states

HEADS, KV_HEADS, DIM = 6, 2, 16


def test_block_runs_cut_a_table_where_ids_jump() -> None:
    assert block_runs([4, 5, 6, 9, 10, 2], ctx=6 * 32, block_size=32) == [(0, 4, 3), (96, 9, 2), (160, 2, 1)]
    assert block_runs([4, 5, 6, 9], ctx=33, block_size=32) == [(0, 4, 2)]  # only the blocks in use


def reference(store: object, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    out = torch.empty_like(q)
    for g in padded_groups(batch):
        index = g.token_index if g.token_index is not None else torch.arange(q.shape[0])
        out[index] = attend_gathered(q[index], gather(store, 0, g.batch), g)  # type: ignore[arg-type]
    return out


@pytest.mark.parametrize("tables", ["in order", "two runs", "shuffled"])
def test_in_place_equals_the_gathered_reference(tables: str) -> None:
    spec = AttentionSpec(num_kv_heads=KV_HEADS, head_dim=DIM, dtype_bytes=4)
    state = allocate_states([spec], 3, 200, "cpu", torch.float32)[0]
    assert isinstance(state, PagedKV)
    store = state.store
    per = store.layout.max_blocks_per_seq
    if tables == "shuffled":  # a run per block: gathered per sequence (more than MAX_RUNS)
        order = torch.randperm(3 * per, generator=torch.Generator().manual_seed(0)) + SINK_BLOCK + 1
        for slot in range(3):
            store.set_table(slot, 0, order[slot * per : (slot + 1) * per].tolist())
    if tables.startswith("two runs"):  # each sequence's first two blocks in one place, the rest elsewhere
        for slot in range(3):
            rest = SINK_BLOCK + 7 + slot * per
            own = [SINK_BLOCK + 1 + 2 * slot, SINK_BLOCK + 2 + 2 * slot]
            store.set_table(slot, 0, own + list(range(rest, rest + per - 2)))
    gen = torch.Generator().manual_seed(1)
    steps = [
        [(0, 70, 0), (1, 5, 0)],  # chunks crossing block edges
        [(0, 70, 70), (1, 1, 5), (2, 33, 0)],  # a chunk beside a decode token
        [(0, 1, 140), (1, 1, 6), (2, 1, 33)],  # decodes only
    ]
    kernels_run = False
    for step in steps:
        batch = ForwardBatch.build([(s, [1] * n, start) for s, n, start in step], torch.device("cpu"))
        t = batch.token_ids.shape[0]
        write_rows(store, 0, batch, torch.randn(t, 2 * KV_HEADS, DIM, generator=gen))
        q = torch.randn(t, HEADS, DIM, generator=gen)
        got, want = attend_in_place(store, 0, q, batch), reference(store, q, batch)
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), step
        if batch.decode_only and cpu_kernel.kernel_fits(DIM):  # the kernel: blocks in any order
            # q as the projection leaves it: each row's heads inside a wider q/k/v row
            wide = torch.cat((q, torch.randn(t, 2 * KV_HEADS, DIM, generator=gen)), dim=1)[:, :HEADS]
            kernel = cpu_kernel.decode_attention(store, 0, wide, batch)
            assert torch.allclose(kernel, want, atol=1e-5, rtol=1e-5), step
            kernels_run = True
    assert kernels_run or not cpu_kernel.kernel_fits(DIM)
    if tables.startswith("two runs"):
        assert len(block_runs(store.block_table[0].tolist(), 141, store.layout.block_size)) == 2


def test_the_kernel_gives_a_verify_row_what_it_gets_alone() -> None:
    """A verify step's rows (one sequence's consecutive positions) share each tile of keys and values
    in the kernel: each row's output is the reference's, and the one it gets alone, bit for bit (a
    head of 64: one row alone keeps its sums in registers, several go through memory)."""
    if not cpu_kernel.kernel_fits(64):
        pytest.skip("no C kernel here")
    spec = AttentionSpec(num_kv_heads=KV_HEADS, head_dim=64, dtype_bytes=4)
    state = allocate_states([spec], 2, 200, "cpu", torch.float32)[0]
    assert isinstance(state, PagedKV)
    store, gen, cpu = state.store, torch.Generator().manual_seed(2), torch.device("cpu")
    prompt = ForwardBatch.build([(0, [1] * 59, 0), (1, [1] * 20, 0)], cpu)
    step = ForwardBatch.build([(0, [1] * 6, 59), (1, [1], 20)], cpu, all_logits=[True, False])
    for batch in (prompt, step):
        write_rows(store, 0, batch, torch.randn(batch.token_ids.shape[0], 2 * KV_HEADS, 64, generator=gen))
    q = torch.randn(7, HEADS, 64, generator=gen)
    together = cpu_kernel.decode_attention(store, 0, q, step)
    assert torch.allclose(together, reference(store, q, step), atol=1e-5, rtol=1e-5)
    for row, (slot, pos) in enumerate([(0, 59 + i) for i in range(6)] + [(1, 20)]):
        one = ForwardBatch.build([(slot, [1], pos)], cpu)
        alone = cpu_kernel.decode_attention(store, 0, q[row : row + 1], one)
        assert torch.equal(alone[0], together[row]), row
