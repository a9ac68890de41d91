"""On CUDA with Triton: the paged decode and prefill kernels give what a plain float32 attention over
each sequence's gathered blocks gives, across head dims, GQA ratios, contexts that cross block
boundaries, several segments (one absent), int8 blocks and query dtypes; and a captured decode
replayed with changed inputs (queries, lengths, block tables, segment pointers) matches eager."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")

from ballast.models.kernels.paged_triton import paged_decode, paged_prefill, triton_available  # noqa: E402

CTX_LENS = (1, 31, 32, 33, 1000, 4100)
SHAPES = [(32, 8), (8, 8), (16, 2)]  # (Hq, Hkv): GQA 4, 1, 8
DEVICE = "cuda"
TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@dataclass
class Pool:
    """Segments laid out as the block pool lays them out, with the tables the kernels read."""

    segs: list[Tensor | None]
    scales: list[Tensor | None]
    kv_ptrs: Tensor
    scale_ptrs: Tensor
    block_table: Tensor
    seg_blocks: int
    num_layers: int
    block_size: int
    hkv: int
    kv_dtype: torch.dtype

    def kw(self, layer: int) -> dict[str, Any]:
        return {
            "layer": layer,
            "num_layers": self.num_layers,
            "seg_blocks": self.seg_blocks,
            "block_size": self.block_size,
            "num_kv_heads": self.hkv,
            "kv_dtype": self.kv_dtype,
        }

    def gather(self, slot: int, layer: int, length: int) -> tuple[Tensor, Tensor]:
        """float32 K and V [length, Hkv, D] of a slot, block by block, dequantized."""
        rows = []
        for j in range(math.ceil(length / self.block_size)):
            g = int(self.block_table[slot, j])
            seg, scale = self.segs[g // self.seg_blocks], self.scales[g // self.seg_blocks]
            assert seg is not None
            block = seg[g % self.seg_blocks, layer].float()
            if scale is not None:
                block = block * scale[g % self.seg_blocks, layer][..., None]
            rows.append(block)
        kv = torch.cat(rows)[:length]
        return kv[:, : self.hkv], kv[:, self.hkv :]


def make_pool(
    ctx: list[int],
    *,
    hkv: int,
    head_dim: int,
    kv_dtype: torch.dtype,
    block_size: int = 32,
    num_layers: int = 3,
    seg_blocks: int = 64,
    spare_slots: int = 2,
) -> Pool:
    """Blocks of every slot scattered at random over several segments; segment 1 is absent (ptr 0)
    and the slots are a permuted subset of the table's rows."""
    needed = sum(math.ceil(n / block_size) for n in ctx)
    present = math.ceil(needed / seg_blocks) + 1
    segs: list[Tensor | None] = []
    scales: list[Tensor | None] = []
    ids: list[int] = []
    for s in range(present + 1):
        if s == 1:
            segs.append(None)
            scales.append(None)
            continue
        shape = (seg_blocks, num_layers, block_size, 2 * hkv, head_dim)
        if kv_dtype == torch.int8:
            segs.append(torch.randint(-127, 128, shape, dtype=torch.int8, device=DEVICE))
            scales.append(torch.empty(shape[:-1], device=DEVICE).uniform_(0.002, 0.02))
        else:
            segs.append(torch.randn(shape, device=DEVICE).to(kv_dtype))
            scales.append(None)
        ids.extend(range(s * seg_blocks, (s + 1) * seg_blocks))
    order = torch.randperm(len(ids))
    width = max(math.ceil(n / block_size) for n in ctx) + 1
    table = torch.full((len(ctx) + spare_slots, width), -1, dtype=torch.int32)
    taken = 0
    for slot in range(len(ctx)):
        n = math.ceil(ctx[slot] / block_size)
        table[slot, :n] = torch.tensor([ids[int(i)] for i in order[taken : taken + n]], dtype=torch.int32)
        taken += n

    def ptrs(ts: list[Tensor | None]) -> Tensor:
        return torch.tensor([0 if t is None else t.data_ptr() for t in ts], dtype=torch.int64, device=DEVICE)

    scale_ptrs = ptrs(scales) if kv_dtype == torch.int8 else torch.zeros(1, dtype=torch.int64, device=DEVICE)
    return Pool(
        segs,
        scales,
        ptrs(segs),
        scale_ptrs,
        table.to(DEVICE),
        seg_blocks,
        num_layers,
        block_size,
        hkv,
        kv_dtype,
    )


def reference(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, sm_scale: float) -> Tensor:
    """float32 causal softmax attention of q [n, Hq, D] over k, v [t, Hkv, D]; row i sees keys <= q_pos[i]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.float(), k) * sm_scale
    keys = torch.arange(k.shape[0], device=q.device)
    scores = scores.masked_fill(keys[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", scores.softmax(-1), v)


def run_decode(pool: Pool, q: Tensor, slots: list[int], ctx: list[int], layer: int, max_ctx: int) -> Tensor:
    out = torch.empty_like(q)
    paged_decode(
        q,
        out,
        pool.kv_ptrs,
        pool.scale_ptrs,
        pool.block_table,
        torch.tensor(slots, device=DEVICE),
        torch.tensor(ctx, device=DEVICE),
        sm_scale=q.shape[-1] ** -0.5,
        max_ctx=max_ctx,
        **pool.kw(layer),
    )
    return out


def check_decode(pool: Pool, q: Tensor, out: Tensor, slots: list[int], ctx: list[int], layer: int) -> None:
    for b, (slot, n) in enumerate(zip(slots, ctx, strict=True)):
        k, v = pool.gather(slot, layer, n)
        want = reference(q[b : b + 1], k, v, torch.tensor([n - 1], device=DEVICE), q.shape[-1] ** -0.5)[0]
        torch.testing.assert_close(
            out[b].float(),
            want,
            atol=TOL[q.dtype],
            rtol=TOL[q.dtype],
            msg=lambda m, b=b, n=n: f"sequence {b} (ctx {n}): {m}",
        )


def test_triton_is_available() -> None:
    assert triton_available()


def test_misaligned_segment_table_is_refused() -> None:
    pool = make_pool([40], hkv=8, head_dim=128, kv_dtype=torch.bfloat16)
    pool.kv_ptrs = torch.cat([pool.kv_ptrs[:1], pool.kv_ptrs])[1:]  # same entries, 8 bytes off
    q = torch.randn(1, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="aligned"):
        run_decode(pool, q, [0], [40], layer=0, max_ctx=40)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("hq", "hkv"), SHAPES)
def test_decode_matches_reference(head_dim: int, hq: int, hkv: int) -> None:
    torch.manual_seed(head_dim + hq)
    ctx = list(CTX_LENS)
    pool = make_pool(ctx, hkv=hkv, head_dim=head_dim, kv_dtype=torch.bfloat16)
    slots = [4, 0, 2, 5, 1, 3]  # not in table order: the kernel must follow slots[b]
    ctx_by_b = [ctx[s] for s in slots]
    q = torch.randn(len(slots), hq, head_dim, device=DEVICE, dtype=torch.bfloat16)
    out = run_decode(pool, q, slots, ctx_by_b, layer=1, max_ctx=max(ctx))
    check_decode(pool, q, out, slots, ctx_by_b, layer=1)


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.int8),
        (torch.float16, torch.int8),
        (torch.float32, torch.int8),
    ],
)
def test_decode_dtypes(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    torch.manual_seed(7)
    ctx = list(CTX_LENS)
    pool = make_pool(ctx, hkv=8, head_dim=128, kv_dtype=kv_dtype)
    q = torch.randn(len(ctx), 32, 128, device=DEVICE, dtype=q_dtype)
    slots = list(range(len(ctx)))
    out = run_decode(pool, q, slots, ctx, layer=2, max_ctx=max(ctx))
    check_decode(pool, q, out, slots, ctx, layer=2)


@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("max_ctx", [200, 8192])  # one split (direct write) / many, some past every context
def test_decode_block_sizes_and_splits(block_size: int, max_ctx: int) -> None:
    torch.manual_seed(block_size)
    ctx = [1, 15, 16, 17, 100, 200]
    pool = make_pool(
        ctx, hkv=4, head_dim=64, kv_dtype=torch.bfloat16, block_size=block_size, num_layers=1, seg_blocks=8
    )
    q = torch.randn(len(ctx), 16, 64, device=DEVICE, dtype=torch.bfloat16)
    slots = list(range(len(ctx)))
    out = run_decode(pool, q, slots, ctx, layer=0, max_ctx=max_ctx)
    check_decode(pool, q, out, slots, ctx, layer=0)


def run_prefill(
    pool: Pool, q: Tensor, slots: list[int], starts: list[int], lens: list[int], layer: int
) -> Tensor:
    out = torch.empty_like(q)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE)
    paged_prefill(
        q,
        out,
        pool.kv_ptrs,
        pool.scale_ptrs,
        pool.block_table,
        torch.tensor(slots, device=DEVICE),
        torch.tensor(starts, device=DEVICE),
        cu,
        sm_scale=q.shape[-1] ** -0.5,
        max_len=max(lens),
        max_ctx=max(s + n for s, n in zip(starts, lens, strict=True)),
        **pool.kw(layer),
    )
    return out


def check_prefill(
    pool: Pool, q: Tensor, out: Tensor, slots: list[int], starts: list[int], lens: list[int], layer: int
) -> None:
    first = 0
    for slot, start, n in zip(slots, starts, lens, strict=True):
        k, v = pool.gather(slot, layer, start + n)
        pos = torch.arange(start, start + n, device=DEVICE)
        want = reference(q[first : first + n], k, v, pos, q.shape[-1] ** -0.5)
        torch.testing.assert_close(
            out[first : first + n].float(),
            want,
            atol=TOL[q.dtype],
            rtol=TOL[q.dtype],
            msg=lambda m, s=start, n=n: f"chunk at {s} of {n} tokens: {m}",
        )
        first += n


# (start, len): fresh prompts, chunks that start mid-block, a long cached prefix.
CHUNKS = [(0, 1), (0, 33), (31, 70), (0, 130), (1000, 100), (4000, 100)]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("hq", "hkv"), SHAPES)
def test_prefill_matches_reference(head_dim: int, hq: int, hkv: int) -> None:
    torch.manual_seed(head_dim * hq)
    starts, lens = [s for s, _ in CHUNKS], [n for _, n in CHUNKS]
    pool = make_pool([s + n for s, n in CHUNKS], hkv=hkv, head_dim=head_dim, kv_dtype=torch.bfloat16)
    q = torch.randn(sum(lens), hq, head_dim, device=DEVICE, dtype=torch.bfloat16)
    slots = list(range(len(CHUNKS)))
    out = run_prefill(pool, q, slots, starts, lens, layer=1)
    check_prefill(pool, q, out, slots, starts, lens, layer=1)


@pytest.mark.parametrize(
    ("q_dtype", "kv_dtype"),
    [
        (torch.float16, torch.float16),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.int8),
        (torch.float32, torch.int8),
    ],
)
def test_prefill_dtypes(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    torch.manual_seed(11)
    starts, lens = [s for s, _ in CHUNKS], [n for _, n in CHUNKS]
    slots = list(reversed(range(len(CHUNKS))))  # chunk i lives in slot len-1-i
    pool = make_pool(
        [s + n for s, n in reversed(CHUNKS)], hkv=8, head_dim=128, kv_dtype=kv_dtype, block_size=16
    )
    q = torch.randn(sum(lens), 32, 128, device=DEVICE, dtype=q_dtype)
    out = run_prefill(pool, q, slots, starts, lens, layer=0)
    check_prefill(pool, q, out, slots, starts, lens, layer=0)


def test_decode_graph_replay_matches_eager() -> None:
    """Capture once, then change every input in place, including a segment swapped for a new one:
    replay must read the new pointers and lengths, not what capture saw."""
    torch.manual_seed(3)
    ctx = [40, 300, 1000, 2000]
    pool = make_pool(ctx, hkv=8, head_dim=128, kv_dtype=torch.bfloat16, seg_blocks=16)
    batch, bucket = 4, 2048
    q = torch.randn(batch, 32, 128, device=DEVICE, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    slots = torch.tensor([0, 1, 2, 3], device=DEVICE)
    lens = torch.tensor(ctx, device=DEVICE)

    def step() -> None:
        paged_decode(
            q,
            out,
            pool.kv_ptrs,
            pool.scale_ptrs,
            pool.block_table,
            slots,
            lens,
            sm_scale=128**-0.5,
            max_ctx=bucket,
            **pool.kw(1),
        )

    step()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    # New contents for every input: slot rows permuted (so each b reads other blocks), new lengths,
    # and segment 0 replaced by a fresh tensor at another address.
    q.copy_(torch.randn_like(q))
    pool.block_table[:4] = pool.block_table[[3, 2, 1, 0]].clone()  # rows now hold 2000, 1000, 300, 40
    slots.copy_(torch.tensor([1, 0, 3, 2]))
    new_ctx = [777, 2000, 33, 1]
    lens.copy_(torch.tensor(new_ctx))
    seg0 = pool.segs[0]
    assert seg0 is not None
    fresh = torch.randn(seg0.shape, device=DEVICE).to(seg0.dtype)
    pool.segs[0] = fresh
    pool.kv_ptrs[0] = fresh.data_ptr()

    graph.replay()
    replayed = out.clone()
    step()
    torch.testing.assert_close(replayed, out, atol=0, rtol=0)
    check_decode(pool, q, out, [1, 0, 3, 2], new_ctx, layer=1)
