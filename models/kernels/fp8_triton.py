"""Weight-only Triton GEMMs over block-scaled float8 weights (CUDA, compute capability 8.9+); the
FP8 x FP8 ones for prefill-sized batches are in `w8a8_triton`.

Weight-only FP8: activations stay in the model's dtype; each weight tile is read as float8 (half
the bytes of bf16, which decode is bound by), converted in registers, and its (column block, K
block) scale multiplies that K step's partial product: x @ dequantized(W).T with float32 sums.
One kernel serves a dense linear and MoE experts (rows sorted by expert, each BLOCK_M tile within
one): the tile table is built on the device from the per-expert counts, sized by a host-side bound,
so nothing syncs and a CUDA graph can capture it. Tile shapes follow a fixed rule: autotuning would
benchmark inside a graph capture.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _block_fp8_gemm(
    a_ptr,
    w_ptr,
    s_ptr,
    c_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    M,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_cm,
    GROUPED: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    W_NK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    if GROUPED:
        expert = tl.load(tile_expert_ptr + pid_m)
        if expert < 0:
            return
        row0 = tl.load(tile_start_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
        w_ptr += expert.to(tl.int64) * stride_we
        s_ptr += expert.to(tl.int64) * stride_se
    else:
        row0 = pid_m * BLOCK_M
        row_end = M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # SPLIT_K programs share a tile's K range, whole BLOCK_Ks each, and add into a float32 output.
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_first = pid_k * k_per
    ks = k_first + tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    col_ok = cols < N
    a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + ks[None, :]
    if W_NK:  # the tile read as [BLOCK_N, BLOCK_K]: K contiguous, as the weight is stored
        w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    else:
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]
    s_ptrs = s_ptr + (cols // SCALE_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_first, tl.minimum(k_first + k_per, K), BLOCK_K):
        k_ok = (k0 - k_first + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        s = tl.load(s_ptrs + k0 // SCALE_K, mask=col_ok, other=0.0)
        if W_NK:
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(a, tl.trans(w.to(a.dtype))) * s[None, :]
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.dot(a, w.to(a.dtype)) * s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    if SPLIT_K == 1:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    else:
        tl.atomic_add(c_ptrs, acc, mask=row_ok[:, None] & col_ok[None, :])


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int = 3
    split_k: int = 1
    w_nk: bool = False


def tiles_for(rows_per_group: float, block: tuple[int, int]) -> Tiles:
    """Tilings measured on an H200 (bench/fp8_gemm.py, Llama-8B's projections): up to 32 rows,
    narrow column tiles with K split four ways, so a decode step spreads its weight read over every
    SM; more rows, taller tiles for reuse."""
    block_k = 128 if block[1] % 128 == 0 else 64 if block[1] % 64 == 0 else 32
    if rows_per_group <= 16:
        return Tiles(16, 64, block_k, 4, 4, 4, True)
    if rows_per_group <= 32:
        return Tiles(32, 64, block_k, 4, 4, 4, True)
    if rows_per_group <= 64:
        return Tiles(64, 64, block_k, 4, 3, 2, True)
    return Tiles(128, 64, block_k, 4, 3, 1, True)


# From this many rows a dense FP8 linear dequantizes its weight and runs cuBLAS: prefill is bound by
# the multiply (H200, 2,048 x 6,144 x 4,096: cuBLAS 149 us plus 20 to dequantize, this kernel 446).
DEQUANTIZE_FROM_ROWS = 256


@triton.jit
def _dequantize(w_ptr, s_ptr, out_ptr, N, K, stride_sn, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    ok = (rows[:, None] < N) & (cols[None, :] < K)
    offs = rows[:, None].to(tl.int64) * K + cols[None, :]
    w = tl.load(w_ptr + offs, mask=ok, other=0.0)
    s = tl.load(
        s_ptr + (rows // SCALE_N)[:, None] * stride_sn + (cols // SCALE_K)[None, :], mask=ok, other=0.0
    )
    tl.store(out_ptr + offs, (w.to(tl.float32) * s).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(w: Tensor, scale_inv: Tensor, block: tuple[int, int], dtype: torch.dtype) -> Tensor:
    """A float8 weight [N, K] with block scales, in dtype (exact in float32, then rounded once)."""
    n, k = w.shape
    out = torch.empty((n, k), dtype=dtype, device=w.device)
    grid = (triton.cdiv(n, 64), triton.cdiv(k, 128))
    _dequantize[grid](w, scale_inv, out, n, k, scale_inv.stride(0), SCALE_N=block[0], SCALE_K=block[1],
                      BLOCK_N=64, BLOCK_K=128)  # fmt: skip
    return out


def _check(a: Tensor, w: Tensor, block: tuple[int, int]) -> None:
    if block[1] % 32 or block[0] % 16:
        raise ValueError(f"FP8 block {block} is not a multiple of (16, 32)")
    if a.shape[-1] != w.shape[-1]:
        raise ValueError(f"activations have {a.shape[-1]} columns, the weight {w.shape[-1]}")


def block_fp8_matmul(
    a: Tensor, w: Tensor, scale_inv: Tensor, block: tuple[int, int], tiles: Tiles | None = None
) -> Tensor:
    """a [M, K] (bf16/fp16/fp32) @ dequantized(w [N, K] float8, scale_inv [N/bn, K/bk]).T -> [M, N]."""
    _check(a, w, block)
    a = a.contiguous()
    m, k = a.shape
    n = w.shape[0]
    if tiles is None and m >= DEQUANTIZE_FROM_ROWS and a.dtype != torch.float32:
        return a @ dequantize(w, scale_inv, block, a.dtype).T
    t = tiles or tiles_for(m, block)
    out = (
        torch.empty((m, n), dtype=a.dtype, device=a.device)
        if t.split_k == 1
        else a.new_zeros((m, n), dtype=torch.float32)
    )
    if m == 0:
        return out
    grid = (triton.cdiv(m, t.block_m), triton.cdiv(n, t.block_n), t.split_k)
    _block_fp8_gemm[grid](
        a, w, scale_inv, out, a, a, a, m, n, k,
        a.stride(0), 0, w.stride(0), 0, scale_inv.stride(0), out.stride(0),
        GROUPED=False, SCALE_N=block[0], SCALE_K=block[1],
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, W_NK=t.w_nk,
        num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
    return out if t.split_k == 1 else out.to(a.dtype)


def _tile_table(counts: Tensor, block_m: int, max_tiles: int) -> tuple[Tensor, Tensor, Tensor]:
    """For each of max_tiles tiles: its expert (-1: unused), first row and end row, from the rows
    per expert (rows sorted by expert). No host sync."""
    tiles = (counts + block_m - 1) // block_m
    last_tile = tiles.cumsum(0)
    first_row = counts.cumsum(0) - counts
    t = torch.arange(max_tiles, device=counts.device)
    expert = torch.searchsorted(last_tile, t, right=True)
    used = expert < counts.numel()
    expert = expert.clamp(max=counts.numel() - 1)
    start = first_row[expert] + (t - (last_tile[expert] - tiles[expert])) * block_m
    end = first_row[expert] + counts[expert]
    return torch.where(used, expert, -1).to(torch.int32), start.to(torch.int32), end.to(torch.int32)


class Groups(NamedTuple):
    """How rows sorted by expert split into tiles: the tiling and the device tile table. Both of an
    expert layer's GEMMs share one (same rows, same experts), so it is built once per layer."""

    tiles: Tiles
    expert: Tensor  # [max_tiles] the tile's expert, -1 for an unused tile
    start: Tensor  # first row
    end: Tensor  # end row (exclusive) of the tile's expert

    @classmethod
    def plan(cls, counts: Tensor, rows: int, block: tuple[int, int], tiles: Tiles | None = None) -> Groups:
        """counts [E]: rows per expert, `rows` of them in all."""
        experts = counts.numel()
        t = tiles or tiles_for(rows / max(1, min(experts, rows)), block)
        # Each used expert has at most one partial tile: sum(ceil(c_e / bm)) <= R / bm + min(E, R).
        max_tiles = triton.cdiv(rows, t.block_m) + min(experts, rows)
        return cls(t, *_tile_table(counts, t.block_m, max_tiles))


def grouped_fp8_matmul(
    rows: Tensor, groups: Groups, w: Tensor, scale_inv: Tensor, block: tuple[int, int]
) -> Tensor:
    """rows [R, K] sorted by expert as `groups` tiles them; w [E, N, K] float8, scale_inv
    [E, N/bn, K/bk]. Row r of expert e -> rows[r] @ dequantized(w[e]).T; returns [R, N]."""
    _check(rows, w, block)
    rows = rows.contiguous()
    r, k = rows.shape
    n, t = w.shape[1], groups.tiles
    if r == 0:
        return torch.empty((r, n), dtype=rows.dtype, device=rows.device)
    out = (
        torch.empty((r, n), dtype=rows.dtype, device=rows.device)
        if t.split_k == 1
        else rows.new_zeros((r, n), dtype=torch.float32)
    )
    grid = (groups.expert.numel(), triton.cdiv(n, t.block_n), t.split_k)
    _block_fp8_gemm[grid](
        rows, w, scale_inv, out, groups.expert, groups.start, groups.end, r, n, k,
        rows.stride(0), w.stride(0), w.stride(1), scale_inv.stride(0), scale_inv.stride(1), out.stride(0),
        GROUPED=True, SCALE_N=block[0], SCALE_K=block[1],
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SPLIT_K=t.split_k, W_NK=t.w_nk,
        num_warps=t.warps, num_stages=t.stages,
    )  # fmt: skip
    return out if t.split_k == 1 else out.to(rows.dtype)
