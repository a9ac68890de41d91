"""FP8 x FP8 GEMMs for prefill-sized batches (CUDA, compute capability 8.9+; Hopper's FP8 tensor
cores): the FP8 releases' block-scaled float8 weights times activations quantized on the fly, per
row and per K block (the weight's 128 columns), as those releases were trained to be served.

Each K step multiplies a float8 activation block by a float8 weight block on the tensor cores and
scales the float32 partial product by the rows' activation scales and the weight block's scale
before it joins the float32 sum. One kernel serves a dense linear and the MoE experts: for experts,
rows sorted by expert tile as `fp8_triton.Groups` plans them (a tile within one expert, the tile
table on the device: nothing syncs, a graph can capture it), and each tile streams only its
expert's weight tiles; no expert is ever dequantized. The experts' gate/up GEMM reads its rows
through the routing's token index from the T quantized tokens (the T x k rows are neither gathered
nor quantized k times), and the down GEMM's input, silu(gate) * up, is made and quantized in one
kernel. The weight-only kernel (`fp8_triton`) stays for decode-sized batches, which are bound by
the weight bytes, not the multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from ballast.models.kernels.fp8_triton import Groups, Tiles
from torch import Tensor

FP8 = torch.float8_e4m3fn
# Whether FP8 experts take these kernels from `FROM_ROWS` token x expert pairs on (CUDA 8.9+; below
# 641 pairs the fused expert kernels serve them first); off, the weight-only grouped kernel as
# before. H200, the 80B's expert layer (`bench/fp8_prefill.py`), weight-only -> FP8 x FP8: 128
# tokens 737 -> 473 us, 1,024 tokens 1,632 -> 564 us, 8,192 tokens 5,132 -> 1,530 us.
# Dense FP8 linears keep dequantize + cuBLAS: at the 80B's shapes this kernel was within 8% of it at
# 1,024 rows and 13-170% slower at 8,192 rows or 64-1,024 columns (`w8a8_matmul` stays for the bench).
ENABLED = True
FROM_ROWS = 256
EXPERT_TILE_ROWS = 64  # rows per expert from which an expert tile is 256 columns wide


# Row counts are not specialized on (Triton would compile a variant for counts divisible by 16 and
# one for the rest): a prompt of a new length after start-up must not wait for a compile.
@triton.jit(do_not_specialize=["M"])
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, GROUPS,
    SILU: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """q[r, c] = x[r, c] / s[r, c // GROUP] rounded to float8, s = the group's largest magnitude /
    448 (e4m3's largest value). SILU: x holds [gate | up] rows of 2K columns and the value
    quantized is silu(gate) * up, computed in float32."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    ok = (rows < M)[:, None] & (cols < K)[None, :]
    src = x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :]
    x = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        x = x * tl.sigmoid(x) * tl.load(src + K, mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-12) / 448.0
    q = (x / scale[:, None]).to(q_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # not truncation
    tl.store(q_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], q, mask=ok)
    tl.store(s_ptr + rows.to(tl.int64) * GROUPS + tl.program_id(1), scale, mask=rows < M)


def _quantize(x: Tensor, width: int, group: int, silu: bool) -> tuple[Tensor, Tensor]:
    m = x.shape[0]
    groups = triton.cdiv(width, group)
    q = torch.empty((m, width), dtype=FP8, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        rows = 16
        _quantize_kernel[(triton.cdiv(m, rows), groups)](
            x, q, s, m, width, x.stride(0), groups, SILU=silu, ROWS=rows, GROUP=group
        )
    return q, s


def quantize_rows(x: Tensor, group: int = 128) -> tuple[Tensor, Tensor]:
    """x [M, K] -> float8 values [M, K] and float32 scales [M, ceil(K / group)] (x ~ value * scale)."""
    assert x.stride(1) == 1
    return _quantize(x, x.shape[1], group, silu=False)


def silu_mul_quantize(gate_up: Tensor, group: int = 128) -> tuple[Tensor, Tensor]:
    """A fused [R, 2I] gate|up projection -> silu(gate) * up quantized as `quantize_rows` does."""
    assert gate_up.stride(1) == 1 and gate_up.shape[1] % 2 == 0
    return _quantize(gate_up, gate_up.shape[1] // 2, group, silu=True)


@triton.jit(do_not_specialize=["M"])
def _w8a8_gemm(
    q_ptr, qs_ptr, gather_ptr, w_ptr, ws_ptr, c_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
    M, N, K, QS_GROUPS, stride_we, stride_wn, stride_se, stride_sn, stride_cm,
    GROUPED: tl.constexpr, GATHER: tl.constexpr, SCALE_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """c[r, n] = sum_kb qs[src, kb] * ws[n // SCALE_N, kb] * (q[src, kb-block] . w[n, kb-block]),
    src = gather[r] (GATHER) or r; GROUPED: this program's rows are one tile of one expert (the
    tile table), w and ws that expert's. BLOCK_K is both the activations' quantization group and
    the weight's K block."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        expert = tl.load(tile_expert_ptr + pid_m)
        if expert < 0:
            return
        row0 = tl.load(tile_start_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
        w_ptr += expert.to(tl.int64) * stride_we
        ws_ptr += expert.to(tl.int64) * stride_se
    else:
        row0 = pid_m * BLOCK_M
        row_end = M
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < row_end
    col_ok = cols < N
    if GATHER:
        src = tl.load(gather_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    else:
        src = rows.to(tl.int64)
    a_ptrs = q_ptr + src[:, None] * K + ks[None, :]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]
    as_ptrs = qs_ptr + src * QS_GROUPS
    ws_ptrs = ws_ptr + (cols // SCALE_N) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = (kb * BLOCK_K + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        w_s = tl.load(ws_ptrs + kb, mask=col_ok, other=0.0)
        acc += tl.dot(a, tl.trans(w)) * a_s[:, None] * w_s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    c_ptrs = c_ptr + rows[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check(k: int, w: Tensor, block: tuple[int, int]) -> None:
    if block[1] not in (32, 64, 128):
        raise ValueError(f"FP8 x FP8 needs weight blocks of 32, 64 or 128 columns, got {block}")
    if k != w.shape[-1]:
        raise ValueError(f"activations have {k} columns, the weight {w.shape[-1]}")


def tiles_for(rows: int, block: tuple[int, int]) -> Tiles:
    """A dense GEMM's tiles: 64 rows (one warp group's multiply) for few rows, else 128 x 128 (the
    best of three tilings at the 80B's shapes, `bench/fp8_prefill.py`); K steps of one scale block."""
    return Tiles(64, 128, block[1], 4, 4) if rows <= 64 else Tiles(128, 128, block[1], 8, 3)


def expert_tiles(rows_per_expert: float, block: tuple[int, int]) -> Tiles:
    """An expert tile's rows stay 64 (an expert holds ~20 rows at a 1k prompt of the 80B); beyond
    64 rows an expert, 256 columns a tile. H200, the 80B's expert layer (`bench/fp8_prefill.py`):
    at 1,024 tokens 64 x 128 564 us, 64 x 256 602, 128 x 128 869; at 8,192 1,821 / 1,530 / 1,791."""
    if rows_per_expert <= EXPERT_TILE_ROWS:
        return Tiles(64, 128, block[1], 4, 4)
    return Tiles(64, 256, block[1], 8, 3)


def _launch(
    q: Tensor, qs: Tensor, w: Tensor, scale_inv: Tensor, out: Tensor, block: tuple[int, int],
    t: Tensor | None, tiles: Tiles, groups: Groups | None,
) -> Tensor:  # fmt: skip
    """out = the GEMM of quantized rows q (read through t where given), dense or grouped."""
    rows, k = out.shape[0], q.shape[1]
    n = w.shape[-2]
    if rows == 0:
        return out
    if groups is None:
        grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(n, tiles.block_n))
        table, strides = (q, q, q), (0, w.stride(0), 0, scale_inv.stride(0))
    else:
        grid = (groups.expert.numel(), triton.cdiv(n, tiles.block_n))
        table = (groups.expert, groups.start, groups.end)
        strides = (w.stride(0), w.stride(1), scale_inv.stride(0), scale_inv.stride(1))
    _w8a8_gemm[grid](
        q, qs, q if t is None else t, w, scale_inv, out, *table, rows, n, k, qs.shape[1], *strides,
        out.stride(0), GROUPED=groups is not None, GATHER=t is not None, SCALE_N=block[0],
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=block[1],
        num_warps=tiles.warps, num_stages=tiles.stages,
    )  # fmt: skip
    return out


def w8a8_matmul(
    a: Tensor, w: Tensor, scale_inv: Tensor, block: tuple[int, int], tiles: Tiles | None = None
) -> Tensor:
    """a [M, K] @ dequantized(w [N, K] float8, scale_inv [N/bn, K/bk]).T -> [M, N] in a's dtype,
    a quantized per row and bk columns first."""
    _check(a.shape[-1], w, block)
    q, qs = quantize_rows(a.contiguous(), block[1])
    out = torch.empty((a.shape[0], w.shape[0]), dtype=a.dtype, device=a.device)
    return _launch(q, qs, w, scale_inv, out, block, None, tiles or tiles_for(a.shape[0], block), None)


def grouped_w8a8_matmul(
    q: Tensor,
    qs: Tensor,
    groups: Groups,
    w: Tensor,
    scale_inv: Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    token: Tensor | None = None,
) -> Tensor:
    """Rows sorted by expert as `groups` tiles them: row r of expert e -> q[src] @ w[e].T with the
    block scales, src = token[r] (rows read through the routing's token index) or r; q [*, K]
    float8 and qs its scales (`quantize_rows`), w [E, N, K] float8, scale_inv [E, N/bn, K/bk].
    Returns [R, N] in dtype, R = len(token) or len(q)."""
    _check(q.shape[1], w, block)
    rows = q.shape[0] if token is None else token.shape[0]
    out = torch.empty((rows, w.shape[1]), dtype=dtype, device=q.device)
    return _launch(q, qs, w, scale_inv, out, block, token, groups.tiles, groups)


def experts_w8a8(
    x: Tensor,
    token: Tensor,
    counts: Tensor,
    gate_up: Tensor,
    gate_up_scale: Tensor,
    down: Tensor,
    down_scale: Tensor,
    block: tuple[int, int],
    tiles: Tiles | None = None,
) -> Tensor:
    """down_e(silu(gate_e(x[t])) * up_e(x[t])) of every expert-grouped pair (token[r], e) -> [R, H]
    in x's dtype, rows in the grouped order; x [T, H]; counts [E] pairs per expert (pairs past
    their sum, held by another rank, are not written). Four kernels: quantize x, gate/up, silu *
    up quantized, down."""
    rows = token.shape[0]
    tiles = tiles or expert_tiles(rows / max(1, min(counts.numel(), rows)), block)
    groups = Groups.plan(counts, rows, block, tiles)
    q, qs = quantize_rows(x.contiguous(), block[1])
    h = grouped_w8a8_matmul(q, qs, groups, gate_up, gate_up_scale, block, x.dtype, token)
    act, act_s = silu_mul_quantize(h, block[1])
    return grouped_w8a8_matmul(act, act_s, groups, down, down_scale, block, x.dtype)


def serves(x: Tensor, w: Tensor, block: tuple[int, int], rows: int) -> bool:
    """Whether these kernels take an expert layer of `rows` token x expert pairs on float8 w: on,
    prefill-sized, blocks they handle, activations bf16 or fp16."""
    return (
        ENABLED
        and rows >= FROM_ROWS
        and w.dtype == FP8
        and block[1] in (32, 64, 128)
        and x.dtype in (torch.bfloat16, torch.float16)
    )
