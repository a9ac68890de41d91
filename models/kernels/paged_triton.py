"""Triton paged attention over the segmented block pool: decode (one query token per sequence,
flash-decoding splits plus a small reduce) and prefill (causal tiles of query tokens x KV tokens).

Segment s is one tensor `[seg_blocks, num_layers, block_size, 2 * num_kv_heads, head_dim]` (K heads,
then V), global block g its index g % seg_blocks in segment g // seg_blocks; int8 pools add a float32
`[seg_blocks, num_layers, block_size, 2 * num_kv_heads]` scale per row. Segment bases are read from
`kv_ptrs` / `scale_ptrs` at run time, so a captured CUDA graph stays valid while segments come and
go. Every base and `kv_ptrs` itself must be SEGMENT_ALIGN-byte aligned (allocator addresses are):
K/V rows load as 16-byte vectors. The kernels are defined only when Triton imports.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the entry points raise, the rest of ballast never notices
    triton = None
    tl = None

# Each split reads at least this many tokens: below it the reduce kernel's extra pass over the
# partial results costs more than the parallelism the split buys.
MIN_SPLIT_TOKENS = 128
MAX_SPLITS = 64
# Programs per SM the split count aims for (H200, bench/paged_attention.py --sweep): one already
# reads Llama-8B's KV at 90-100% of copy bandwidth from batch 32; Qwen3-Next's (2 KV heads, head dim
# 256) wanted ~6 splits at batch 32 and 2k context (72 -> 51 us a layer), which two per SM gives.
PROGRAMS_PER_SM = 2
# Segment bases (and the kv_ptrs table itself) must sit on this many bytes: 16 elements of fp32.
SEGMENT_ALIGN = 64


def triton_available() -> bool:
    return triton is not None


@dataclass(frozen=True)
class DecodeTiling:
    """How one decode launch is cut: context splits per (sequence, kv head), KV tokens per loop
    step, and the Triton launch knobs. Chosen from host ints only, so it is CUDA-graph safe."""

    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class PrefillTiling:
    """How one prefill launch is cut: query tokens and KV tokens per tile, and the launch knobs."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def choose_prefill_tiling(head_dim: int, dtype: torch.dtype, smem_bytes: int = 228 * 1024) -> PrefillTiling:
    """128 query tokens a tile where shared memory (smem_bytes a multiprocessor) holds it, smaller
    where not, float32 (the tests' reference) 32 x 32. H200, an 8k prompt (bench/paged_prefill.py):
    128 x 64 tiles 3.3x faster than 32 x 32 at head dim 256 (8 warps), 1.4x for Llama-8B."""
    if dtype == torch.float32:
        return PrefillTiling(block_m=32, block_n=32, num_warps=4, num_stages=2)
    wide = head_dim > 128
    for tiling in (
        PrefillTiling(block_m=128, block_n=64, num_warps=8 if wide else 4, num_stages=2),
        PrefillTiling(block_m=64, block_n=64, num_warps=4, num_stages=2),
    ):
        tile_bytes = (tiling.block_m + 2 * tiling.num_stages * tiling.block_n) * head_dim * dtype.itemsize
        if tile_bytes <= smem_bytes * 7 // 8:  # the rest for Triton's own scratch
            return tiling
    return PrefillTiling(block_m=32, block_n=32, num_warps=4, num_stages=2)


@functools.lru_cache(maxsize=8)
def _shared_memory(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).shared_memory_per_multiprocessor)


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_decode_tiling(
    batch: int, num_kv_heads: int, max_ctx: int, kv_dtype: torch.dtype, sm_count: int
) -> DecodeTiling:
    # 128-token steps, head dim 256 too (the sweep above: 64 was slower for it); float32 rows at 64
    # keep two stages of K and V within shared memory
    block_n = 64 if kv_dtype == torch.float32 else 128
    programs = batch * num_kv_heads
    want = math.ceil(PROGRAMS_PER_SM * sm_count / programs)
    most = max(1, math.ceil(max_ctx / MIN_SPLIT_TOKENS))
    return DecodeTiling(
        num_splits=max(1, min(want, most, MAX_SPLITS)), block_n=block_n, num_warps=4, num_stages=2
    )


_TL_DTYPES: dict[torch.dtype, str] = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.int8: "int8",
}


def _tl_dtype(dtype: torch.dtype) -> Any:
    if dtype not in _TL_DTYPES:
        raise ValueError(f"paged attention does not read {dtype} KV")
    return getattr(tl, _TL_DTYPES[dtype])


def _precision(q_dtype: torch.dtype) -> str:
    # fp32 queries are the reference path (tests, CPU-sized models): no tf32 rounding for them.
    return "ieee" if q_dtype == torch.float32 else "tf32"


def _check(q: Tensor, out: Tensor, kv_ptrs: Tensor, block_size: int, num_kv_heads: int) -> tuple[int, int]:
    if triton is None:
        raise RuntimeError("paged attention kernels need Triton, which is not installed")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    heads, head_dim = q.shape[-2], q.shape[-1]
    if heads % num_kv_heads:
        raise ValueError(f"{heads} query heads do not group onto {num_kv_heads} kv heads")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if q.stride(-1) != 1 or out.stride(-1) != 1 or out.shape != q.shape:
        raise ValueError("q and out must have the same shape and a contiguous last dimension")
    # The kernels address segments as whole 16-element offsets from kv_ptrs' own address
    # (`_kv_rows`): false for a table sliced at an odd index.
    if kv_ptrs.data_ptr() % SEGMENT_ALIGN:
        raise ValueError(f"kv_ptrs must start at a {SEGMENT_ALIGN}-byte aligned address")
    return heads // num_kv_heads, head_dim


def _layout_constexprs(
    q: Tensor, kv_dtype: torch.dtype, num_kv_heads: int, group: int, head_dim: int, block_size: int
) -> dict[str, Any]:
    """The compile-time constants both kernels share: pool layout, dtypes, GQA group."""
    return {
        "KV_DTYPE": _tl_dtype(kv_dtype),
        "KV_BYTES": kv_dtype.itemsize,
        "QUANT": kv_dtype == torch.int8,
        "COMPUTE": _tl_dtype(q.dtype),
        "PRECISION": _precision(q.dtype),
        "HKV": num_kv_heads,
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
    }


def paged_decode(
    q: Tensor,
    out: Tensor,
    kv_ptrs: Tensor,
    scale_ptrs: Tensor,
    block_table: Tensor,
    slots: Tensor,
    ctx_lens: Tensor,
    *,
    layer: int,
    num_layers: int,
    seg_blocks: int,
    block_size: int,
    num_kv_heads: int,
    kv_dtype: torch.dtype,
    sm_scale: float,
    max_ctx: int,
    tiling: DecodeTiling | None = None,
) -> None:
    """q, out: [B, Hq, D]; sequence b attends to positions 0..ctx_lens[b]-1 of slot slots[b] (this
    step's K/V already written). max_ctx: a host-side bound on ctx_lens (a graph's context bucket)
    that picks the split count; tiling: the chosen one if None (the benchmark sweeps others). No host
    sync, no data-dependent host logic: CUDA-graph capturable."""
    group, head_dim = _check(q, out, kv_ptrs, block_size, num_kv_heads)
    batch, heads = q.shape[0], q.shape[1]
    if batch == 0:
        return
    if tiling is None:
        tiling = choose_decode_tiling(batch, num_kv_heads, max_ctx, kv_dtype, _sm_count(q.device.index or 0))
    splits = tiling.num_splits
    if splits > 1:
        part_out = torch.empty(batch, heads, splits, head_dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(batch, heads, splits, device=q.device, dtype=torch.float32)
    else:  # never read: the kernel writes `out` directly
        part_out = part_lse = out
    _decode_kernel[(batch, num_kv_heads, splits)](
        q,
        out,
        part_out,
        part_lse,
        kv_ptrs,
        scale_ptrs,
        block_table,
        slots,
        ctx_lens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        layer,
        num_layers,
        seg_blocks,
        sm_scale * math.log2(math.e),
        **_layout_constexprs(q, kv_dtype, num_kv_heads, group, head_dim, block_size),
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=tiling.block_n,
        SPLIT=splits > 1,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )
    if splits > 1:
        _reduce_kernel[(batch, heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            splits,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(splits),
            num_warps=4,
        )


def paged_prefill(
    q: Tensor,
    out: Tensor,
    kv_ptrs: Tensor,
    scale_ptrs: Tensor,
    block_table: Tensor,
    slots: Tensor,
    starts: Tensor,
    cu_lens: Tensor,
    *,
    layer: int,
    num_layers: int,
    seg_blocks: int,
    block_size: int,
    num_kv_heads: int,
    kv_dtype: torch.dtype,
    sm_scale: float,
    max_len: int,
    max_ctx: int,
    tiling: PrefillTiling | None = None,
) -> None:
    """q, out: [T, Hq, D]; sequence b owns tokens cu_lens[b]..cu_lens[b+1]-1, token i at position
    starts[b] + i attending causally to positions 0..starts[b]+i of its slot (all already written).
    max_len: longest chunk; max_ctx: longest starts+len (host ints). tiling: the chosen one if None."""
    group, head_dim = _check(q, out, kv_ptrs, block_size, num_kv_heads)
    batch, heads = slots.shape[0], q.shape[1]
    if batch == 0 or q.shape[0] == 0 or max_len == 0:
        return
    if tiling is None:
        smem = _shared_memory(q.device.index or 0) if q.is_cuda else 228 * 1024  # (the interpreter)
        tiling = choose_prefill_tiling(head_dim, q.dtype, smem)
    grid = (heads, batch, triton.cdiv(max_len, tiling.block_m))
    _prefill_kernel[grid](
        q,
        out,
        kv_ptrs,
        scale_ptrs,
        block_table,
        slots,
        starts,
        cu_lens,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        layer,
        num_layers,
        seg_blocks,
        sm_scale * math.log2(math.e),
        **_layout_constexprs(q, kv_dtype, num_kv_heads, group, head_dim, block_size),
        BLOCK_M=tiling.block_m,
        BLOCK_N=tiling.block_n,
        num_warps=tiling.num_warps,
        num_stages=tiling.num_stages,
    )


if triton is not None:
    # `_attend_tile`'s masks
    MASK_NONE: tl.constexpr = tl.constexpr(0)
    MASK_VALID: tl.constexpr = tl.constexpr(1)
    MASK_CAUSAL: tl.constexpr = tl.constexpr(2)

    @triton.jit
    def _kv_rows(
        kv_ptrs,
        scale_ptrs,
        bt_row,
        pos,
        valid,
        layer,
        num_layers,
        seg_blocks,
        kvh,
        KV_DTYPE: tl.constexpr,
        KV_BYTES: tl.constexpr,
        QUANT: tl.constexpr,
        HKV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
    ):
        """K and V rows [N, D] (and their int8 scales [N]) of the positions `pos` of one slot."""
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        seg = blk // seg_blocks
        # the token's row in its segment, in HEAD_DIM elements (int64: a segment passes 2**31)
        row = (((blk % seg_blocks) * num_layers + layer) * BLOCK_SIZE + pos % BLOCK_SIZE) * (2 * HKV) + kvh
        # Segments are addressed as element offsets from one typed pointer (the table's own address),
        # not by casting each loaded address: through a pointer made from an integer Triton loads 2
        # bytes at a time (8% of copy bandwidth, measured), while an offset it is told is a multiple
        # of 16 elements (SEGMENT_ALIGN bases) lets every K/V row load as 16-byte vectors.
        ref = kv_ptrs.to(tl.pointer_type(KV_DTYPE), bitcast=True)
        ref_addr = kv_ptrs.to(tl.int64)
        seg_off = (tl.load(kv_ptrs + seg, mask=valid, other=ref_addr) - ref_addr) // KV_BYTES
        offset = tl.multiple_of(seg_off + row * HEAD_DIM, 16)
        offs_d = tl.arange(0, HEAD_DIM)
        k_ptr = ref + offset[:, None] + offs_d[None, :]
        k = tl.load(k_ptr, mask=valid[:, None], other=0)
        v = tl.load(k_ptr + HKV * HEAD_DIM, mask=valid[:, None], other=0)
        if QUANT:
            sbase = tl.load(scale_ptrs + seg, mask=valid, other=0).to(tl.pointer_type(tl.float32))
            k_scale = tl.load(sbase + row, mask=valid, other=0.0)
            v_scale = tl.load(sbase + row + HKV, mask=valid, other=0.0)
        else:
            k_scale = tl.full(pos.shape, 1.0, tl.float32)
            v_scale = k_scale
        return k, v, k_scale, v_scale

    @triton.jit
    def _decode_kernel(
        q_ptr,
        out_ptr,
        part_out,
        part_lse,
        kv_ptrs,
        scale_ptrs,
        bt_ptr,
        slots_ptr,
        ctx_ptr,
        sqb,
        sqh,
        sob,
        soh,
        sbt,
        layer,
        num_layers,
        seg_blocks,
        qk_scale,
        KV_DTYPE: tl.constexpr,
        KV_BYTES: tl.constexpr,
        QUANT: tl.constexpr,
        COMPUTE: tl.constexpr,
        PRECISION: tl.constexpr,
        HKV: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        """One program: every query head of one kv group of one sequence, over one context split.
        The group's heads are the rows of the tl.dot (padded to BLOCK_H >= 16), so each K/V row is
        read once per group instead of once per query head."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(ctx_ptr + b).to(tl.int32)
        bt_row = bt_ptr + tl.load(slots_ptr + b) * sbt
        # The splits share this sequence's own context in whole loop steps, not the host's max_ctx:
        # a graph's context bucket (up to twice the context) left half the splits idle.
        split_tokens = tl.cdiv(tl.cdiv(ctx, tl.num_programs(2)), BLOCK_N) * BLOCK_N
        lo = split * split_tokens
        hi = tl.minimum(lo + split_tokens, ctx)

        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, HEAD_DIM)
        head_ok = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        q = tl.load(
            q_ptr + b * sqb + heads[:, None] * sqh + offs_d[None, :], mask=head_ok[:, None], other=0.0
        )

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        q = q.to(COMPUTE)
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, 0, start, hi, m_i, l_i, acc, kv_ptrs, scale_ptrs, bt_row, layer, num_layers,
                seg_blocks, kvh, qk_scale, KV_DTYPE, KV_BYTES, QUANT, COMPUTE, PRECISION, HKV,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_VALID,
            )  # fmt: skip

        has = l_i > 0
        o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        if SPLIT:
            splits = tl.num_programs(2)
            row = (b * (HKV * GROUP) + heads) * splits + split
            tl.store(part_out + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=head_ok[:, None])
            tl.store(
                part_lse + row,
                tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")),
                mask=head_ok,
            )
        else:
            tl.store(
                out_ptr + b * sob + heads[:, None] * soh + offs_d[None, :],
                o.to(out_ptr.dtype.element_ty),
                mask=head_ok[:, None],
            )

    @triton.jit
    def _reduce_kernel(
        part_out, part_lse, out_ptr, sob, soh, splits, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr
    ):
        """Merges one (sequence, query head)'s split results by their log-sum-exps (base 2)."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        heads = tl.num_programs(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, HEAD_DIM)
        row = (b * heads + h) * splits + offs_s
        lse = tl.load(part_lse + row, mask=offs_s < splits, other=float("-inf"))
        top = tl.max(lse, 0)
        # An all-empty row (context 0, a padding row) has top = -inf; weigh nothing then.
        w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(top > float("-inf"), top, 0.0)), 0.0)
        parts = tl.load(
            part_out + row[:, None] * HEAD_DIM + offs_d[None, :], mask=(w > 0)[:, None], other=0.0
        )
        total = tl.sum(w, 0)
        o = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(out_ptr + b * sob + h * soh + offs_d, o.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _attend_tile(
        q,
        q_pos,
        k_start,
        hi,
        m_i,
        l_i,
        acc,
        kv_ptrs,
        scale_ptrs,
        bt_row,
        layer,
        num_layers,
        seg_blocks,
        kvh,
        qk_scale,
        KV_DTYPE: tl.constexpr,
        KV_BYTES: tl.constexpr,
        QUANT: tl.constexpr,
        COMPUTE: tl.constexpr,
        PRECISION: tl.constexpr,
        HKV: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        MASK: tl.constexpr,
    ):
        """One KV tile of the online softmax (keys k_start..k_start+BLOCK_N-1), for both kernels.
        MASK: MASK_NONE (every key below hi), MASK_VALID (keys from hi on count nothing: a split's
        ragged last tile), MASK_CAUSAL (also each row only up to its position q_pos). int8 values
        are exact in bf16/fp16, so their scales multiply the scores and the probabilities, once a
        token, rather than K and V element by element."""
        pos = k_start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        k, v, k_scale, v_scale = _kv_rows(
            kv_ptrs, scale_ptrs, bt_row, pos, valid, layer, num_layers, seg_blocks, kvh,
            KV_DTYPE, KV_BYTES, QUANT, HKV, HEAD_DIM, BLOCK_SIZE,
        )  # fmt: skip
        s = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=PRECISION)
        if QUANT:
            s = s * (k_scale * qk_scale)[None, :]
        else:
            s = s * qk_scale
        # The first tile holds position 0, which every row may see, so m_i is finite after it
        # and a later fully-masked row never computes -inf - -inf.
        if MASK == MASK_CAUSAL:
            s = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        elif MASK == MASK_VALID:
            s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if QUANT:
            p = p * v_scale[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v.to(COMPUTE), input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _prefill_kernel(
        q_ptr,
        out_ptr,
        kv_ptrs,
        scale_ptrs,
        bt_ptr,
        slots_ptr,
        starts_ptr,
        cu_ptr,
        sqt,
        sqh,
        sot,
        soh,
        sbt,
        layer,
        num_layers,
        seg_blocks,
        qk_scale,
        KV_DTYPE: tl.constexpr,
        KV_BYTES: tl.constexpr,
        QUANT: tl.constexpr,
        COMPUTE: tl.constexpr,
        PRECISION: tl.constexpr,
        HKV: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program: BLOCK_M query tokens of one sequence and query head, over the KV tiles up to
        its last token's causal limit. Query tiles are the grid's last axis, latest first: the
        programs with the most keys start first, and the short ones fill in behind them."""
        h = tl.program_id(0)
        b = tl.program_id(1)
        m_tile = tl.num_programs(2) - 1 - tl.program_id(2)
        first = tl.load(cu_ptr + b)
        n = (tl.load(cu_ptr + b + 1) - first).to(tl.int32)
        start = tl.load(starts_ptr + b).to(tl.int32)
        bt_row = bt_ptr + tl.load(slots_ptr + b) * sbt
        kvh = h // GROUP

        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < n
        q_pos = start + offs_m
        q = tl.load(
            q_ptr + (first + offs_m)[:, None] * sqt + h * sqh + offs_d[None, :],
            mask=row_ok[:, None],
            other=0.0,
        ).to(COMPUTE)
        # Keys below `hi` are the causal window of this tile's last token; 0 for a tile past the chunk.
        hi = tl.where(m_tile * BLOCK_M < n, start + tl.minimum(n, (m_tile + 1) * BLOCK_M), 0)
        # Keys below `full` are seen by every row of the tile: only tiles across the diagonal mask.
        full = tl.minimum((start + m_tile * BLOCK_M) // BLOCK_N * BLOCK_N, hi)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for k_start in range(0, full, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, q_pos, k_start, hi, m_i, l_i, acc, kv_ptrs, scale_ptrs, bt_row, layer, num_layers,
                seg_blocks, kvh, qk_scale, KV_DTYPE, KV_BYTES, QUANT, COMPUTE, PRECISION, HKV,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_NONE,
            )  # fmt: skip
        for k_start in range(full, hi, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, q_pos, k_start, hi, m_i, l_i, acc, kv_ptrs, scale_ptrs, bt_row, layer, num_layers,
                seg_blocks, kvh, qk_scale, KV_DTYPE, KV_BYTES, QUANT, COMPUTE, PRECISION, HKV,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, MASK_CAUSAL,
            )  # fmt: skip

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + (first + offs_m)[:, None] * sot + h * soh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None],
        )
