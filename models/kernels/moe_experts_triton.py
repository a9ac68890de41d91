"""The experts of a decode-sized MoE batch in three Triton kernels, bf16 or float8 weights.

`experts_mlp` runs over the pairs `moe.Routing` grouped by expert: gate/up GEMMs of each expert's
gathered rows with SwiGLU in the epilogue; the down GEMM with the routing weight applied, each row
written at its pair's place; then one ordered sum per token over its k rows. One GEMM program per
(expert holding pairs, column block): an expert's weights stream once however many rows it has,
and no count is read on the host (graph-safe). The grid has min(pairs, experts) program rows, not
one per expert: at one token of the 80B's 512 experts top-10, 11 where it was 513. A shared expert
of the routed shape is one more program row of each GEMM and one more row of each token's sum.

Float8 weights (`Fp8Scales`, the FP8 releases' 128 x 128 blocks) are read as float8, converted in
registers and multiplied in the activations' dtype, each K step's product scaled by its (row block,
K block) scale before it joins the float32 sum: 3 kernels a MoE layer where the torch form took ~45.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
from ballast.models.kernels import moe_triton
from torch import Tensor

triton = moe_triton.triton
if triton is not None:
    import triton.language as tl

FP8 = torch.float8_e4m3fn
# `experts_mlp` serves at most this many pairs (409 tokens of top-10, the `align` limit); more take
# the grouped GEMM (`bench/moe_experts.py`, H200, fused / grouped: 0.53-0.67 at 128 tokens, 0.69-0.78 at 256).
MAX_FUSED_PAIRS = moe_triton.MAX_PAIRS
# Whether `moe.experts_forward` takes `experts_mlp` on CUDA. H200, qwen3-next-6b at batch 32
# (`decode_profile --moe-kernel grouped fused`): a step 13.91 -> 12.21 ms, 672 fewer kernels.
FUSED_EXPERTS = True
# Float8 experts take `experts_mlp` up to this many pairs (64 tokens of top-10), the grouped FP8
# GEMMs (`moe.fp8_experts_forward`) beyond. H200, qwen3-next-80b-a3b-fp8 (`decode_profile`): a step
# at 32 tokens 30.27 -> 27.46 ms, 2,160 fewer kernels outweighing the fused GEMMs' ~3 ms extra (the
# float8 tiles' per-element cost); past 64 tokens the grouped GEMMs stay the safer guess until
# `bench/moe_experts.py --fp8 --tokens 64 128` says otherwise.
MAX_FUSED_FP8_PAIRS = 640
_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class KernelTiling:
    """One expert kernel's launch: output columns and reduction elements per tile, warps, stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ExpertTiling:
    """`experts_mlp`'s two launches. `bench/moe_experts.py --sweep` times others on the GPU."""

    # the sweep's best for the 80B's layer at 1 and 32 tokens (5-9% over 32 x 128 tiles)
    gate_up: KernelTiling = KernelTiling(block_n=64, block_k=128, num_warps=4, num_stages=3)
    down: KernelTiling = KernelTiling(block_n=64, block_k=64, num_warps=4, num_stages=3)
    # rows a program multiplies at once; 0: `rows_per_pass`'s pick for the batch
    block_m: int = 0


def rows_per_pass(pairs: int, experts: int, shared_rows: int) -> int:
    """Rows of a GEMM program's pass over its expert's weights: enough that the fullest program
    (the shared expert's, a row per token, or a routed one at twice the mean) streams its weights
    once, since a launch lasts as long as its slowest program; 16 to 64 (more rows' accumulators
    spill). H200, the 6B's layer at 32 tokens (`bench/moe_experts.py --sweep`): 16 / 32 / 64 rows
    70.3 / 59.3 / 67.1 us; the decode step at batch 32 9.52 -> 8.76 ms."""
    fullest = max(shared_rows, -(-2 * pairs // experts))
    return min(64, max(16, 1 << (fullest - 1).bit_length()))


class Fp8Scales(NamedTuple):
    """Float8 expert weights' float32 block scales, block = (bn, bk): gate_up [E, ceil(2I / bn),
    ceil(H / bk)], down [E, ceil(H / bn), ceil(I / bk)]."""

    gate_up: Tensor
    down: Tensor
    block: tuple[int, int]


class SharedExpert(NamedTuple):
    """A shared expert, one more program row of the expert kernels: every token its row, weighted by
    sigmoid(gate [T, 1]); gate_up [2I, H], down [H, I] and their scales as a routed expert's."""

    gate_up: Tensor
    down: Tensor
    gate: Tensor
    gate_up_scale: Tensor | None = None
    down_scale: Tensor | None = None


@lru_cache(maxsize=8)
def _converts_fp8(device: torch.device) -> bool:
    """Float8 to bf16 in hardware: compute capability 8.9+ (the CPU only under the interpreter)."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def fused_ok(x: Tensor, gate_up: Tensor, pairs: int, scales: Fp8Scales | None = None) -> bool:
    """Whether `experts_mlp` serves this batch: CUDA with Triton, the switch on, a decode-sized
    batch, weights of x's dtype or float8 with their scales (K blocks of 32 columns or more)."""
    if scales is None:
        weights_ok, most = gate_up.dtype == x.dtype, MAX_FUSED_PAIRS
    else:
        weights_ok = gate_up.dtype == FP8 and scales.block[1] % 32 == 0 and _converts_fp8(x.device)
        most = MAX_FUSED_FP8_PAIRS
    return (
        FUSED_EXPERTS
        and moe_triton.available(x)
        and 0 < pairs <= most
        and x.dtype in _FUSED_DTYPES
        and weights_ok
    )


def _block_k(tile: int, scale_k: int) -> int:
    """A K step within one scale block: the tiling's, or the largest power of two dividing bk."""
    return min(tile, scale_k & -scale_k)


def experts_mlp(
    x: Tensor,
    token: Tensor,
    order: Tensor,
    counts: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    outside: bool,
    tiling: ExpertTiling | None = None,
    shared: SharedExpert | None = None,
    scales: Fp8Scales | None = None,
) -> Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])) for every token t, e the
    pair's expert -> [T, H] in x's dtype; x [T, H], weights [T, k]; (token, order, counts) the
    expert-grouped pairs of `moe.Routing` (counts of the local experts only; with `outside`, the
    pairs held on another rank add 0). gate_up [E, 2I, H], down [E, H, I] in x's dtype, or float8
    with `scales`. shared: a shared expert, its rows every token after the P routed pairs."""
    assert triton is not None
    tiling = tiling or ExpertTiling()
    gu, dn = tiling.gate_up, tiling.down
    tokens, hidden = x.shape
    experts, two_i, _ = gate_up.shape
    inter = two_i // 2
    pairs = order.shape[0]
    assert x.stride(1) == gate_up.stride(2) == down.stride(2) == 1 and down.shape[1] == hidden
    if shared is not None:
        assert shared.gate_up.shape == gate_up.shape[1:] and shared.down.shape == down.shape[1:]
        assert shared.gate_up.stride() == gate_up.stride()[1:] and shared.down.stride() == down.stride()[1:]
    rows = pairs + (tokens if shared is not None else 0)
    h = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    # A row per pair in pair order, then the shared expert's row per token; rows of pairs no
    # local expert computes stay 0.
    y = (torch.zeros if outside else torch.empty)((rows, hidden), dtype=torch.float32, device=x.device)
    # without a shared expert its pointers are the routed ones' (no program reads them)
    s_gate_up, s_down, s_gate = shared[:3] if shared is not None else (gate_up, down, weights)
    gu_scale, dn_scale, ss_gate_up, ss_down, bn, bk = _scale_args(scales, shared, x)
    block_m = tiling.block_m or rows_per_pass(pairs, experts, tokens if shared is not None else 0)
    programs = (int(shared is not None) + min(pairs, experts),)
    common = {
        "E": experts,
        "BLOCK_E": triton.next_power_of_2(experts),
        "BLOCK_M": block_m,
        "SHARED": int(shared is not None),
        "COMPUTE": _TL[x.dtype],
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
        "SCALED": scales is not None,
        "SCALE_N": bn,
        "SCALE_K": bk,
    }
    _gate_up_kernel[(*programs, triton.cdiv(inter, gu.block_n))](
        x, gate_up, s_gate_up, gu_scale, ss_gate_up, h, token, counts,
        x.stride(0), gate_up.stride(0), gate_up.stride(1), gu_scale.stride(0), gu_scale.stride(-2),
        inter, hidden, pairs, tokens,
        BLOCK_N=gu.block_n, BLOCK_K=_block_k(gu.block_k, bk), num_warps=gu.num_warps,
        num_stages=gu.num_stages, **common,
    )  # fmt: skip
    _down_kernel[(*programs, triton.cdiv(hidden, dn.block_n))](
        h, down, s_down, dn_scale, ss_down, y, order, counts, weights.reshape(-1), s_gate,
        s_gate.stride(0), down.stride(0), down.stride(1), dn_scale.stride(0), dn_scale.stride(-2),
        inter, hidden, pairs, tokens,
        BLOCK_N=dn.block_n, BLOCK_K=_block_k(dn.block_k, bk), num_warps=dn.num_warps,
        num_stages=dn.num_stages, **common,
    )  # fmt: skip
    return _combine(y, tokens, pairs, shared is not None, x.dtype)


def _scale_args(
    scales: Fp8Scales | None, shared: SharedExpert | None, x: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, int, int]:
    """(routed gate_up scales, down scales, the shared expert's two, block rows, block cols) as
    the kernels take them; without float8 weights, pointers no program reads and a block of 1 x
    a large power of two (never limiting a K step)."""
    if scales is None:
        return x, x, x, x, 1, 1 << 16
    assert scales.gate_up.stride(-1) == scales.down.stride(-1) == 1
    if shared is None:  # pointers no program reads
        return scales.gate_up, scales.down, scales.gate_up, scales.down, *scales.block
    assert shared.gate_up_scale is not None and shared.down_scale is not None
    assert shared.gate_up_scale.stride() == scales.gate_up.stride()[1:]
    assert shared.down_scale.stride() == scales.down.stride()[1:]
    ss_gate_up, ss_down = shared.gate_up_scale, shared.down_scale
    return scales.gate_up, scales.down, ss_gate_up, ss_down, scales.block[0], scales.block[1]


def _combine(y: Tensor, tokens: int, pairs: int, shared: bool, dtype: torch.dtype) -> Tensor:
    """out[t] = sum_j y[t * k + j] (in j order) [+ y[pairs + t], the shared expert's], float32
    until the one rounding to dtype: one kernel where the torch form is five."""
    assert triton is not None
    hidden = y.shape[1]
    out = torch.empty((tokens, hidden), dtype=dtype, device=y.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block))](
        y, out, hidden, pairs, K=pairs // tokens, SHARED=shared, BLOCK_H=block
    )
    return out


if triton is not None:
    _TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _program_rows(counts, pairs, tokens, E: tl.constexpr, BLOCK_E: tl.constexpr, SHARED: tl.constexpr):
        """(is the shared expert's, its expert, first grouped row, row count) of this program. With
        a shared expert, program row 0 is its (rows [pairs, pairs + tokens)); the next take the
        experts holding pairs, one each in id order (a row past the last gets no rows)."""
        j = tl.program_id(0) - SHARED
        b = tl.arange(0, BLOCK_E)
        c = tl.load(counts + b, mask=b < E, other=0)
        held = c > 0
        mine = held & (tl.cumsum(held.to(tl.int32), 0) - 1 == j)
        e = tl.sum(tl.where(mine, b, 0))
        count = tl.sum(tl.where(mine, c, 0))
        first = tl.sum(tl.where(b < e, c, 0))
        shared = j < 0
        return shared, e, tl.where(shared, pairs, first), tl.where(shared, tokens, count)

    @triton.jit
    def _gate_up_kernel(
        x, w, w_shared, s, s_shared, h, token, counts,
        sx, swe, swn, sse, ssn, inter, hidden, pairs, tokens,
        E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SHARED: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
        SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    ):  # fmt: skip
        """h[r, n] = silu(x[token[r]] . gate[n]) * (x[token[r]] . up[n]) over one expert's rows r
        and a block of columns n; gate = w[e, :I], up = w[e, I:] (shared: w_shared, token r - pairs).
        SCALED: w is float8, each K step's product times its block's scale in s (s_shared)."""
        shared, e, first, count = _program_rows(counts, pairs, tokens, E, BLOCK_E, SHARED)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        n_ok = n < inter
        base = tl.where(shared, w_shared, w + e.to(tl.int64) * swe)
        w_gate = base + n[:, None] * swn + k[None, :]
        w_up = w_gate + inter * swn
        s_base = tl.where(shared, s_shared, s + e.to(tl.int64) * sse)
        s_gate = s_base + (n // SCALE_N) * ssn
        s_up = s_base + ((inter + n) // SCALE_N) * ssn
        for m0 in range(0, count, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            m_ok = m < count
            tok = tl.where(shared, m, tl.load(token + first + m, mask=m_ok & (first + m < pairs), other=0))
            x_rows = x + tok[:, None] * sx + k[None, :]
            gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, hidden, BLOCK_K):
                k_ok = k[None, :] < hidden - k0
                xt = tl.load(x_rows + k0, mask=m_ok[:, None] & k_ok, other=0.0).to(COMPUTE)
                wg = tl.load(w_gate + k0, mask=n_ok[:, None] & k_ok, other=0.0).to(COMPUTE)
                wu = tl.load(w_up + k0, mask=n_ok[:, None] & k_ok, other=0.0).to(COMPUTE)
                if SCALED:
                    sg = tl.load(s_gate + k0 // SCALE_K, mask=n_ok, other=0.0)
                    su = tl.load(s_up + k0 // SCALE_K, mask=n_ok, other=0.0)
                    gate += tl.dot(xt, tl.trans(wg), input_precision=PRECISION) * sg[None, :]
                    up += tl.dot(xt, tl.trans(wu), input_precision=PRECISION) * su[None, :]
                else:
                    gate = tl.dot(xt, tl.trans(wg), gate, input_precision=PRECISION)
                    up = tl.dot(xt, tl.trans(wu), up, input_precision=PRECISION)
            out = gate * tl.sigmoid(gate) * up
            rows = (first + m).to(tl.int64)
            tl.store(
                h + rows[:, None] * inter + n[None, :],
                out.to(h.dtype.element_ty),
                mask=m_ok[:, None] & n_ok[None, :],
            )

    @triton.jit
    def _down_kernel(
        h, w, w_shared, s, s_shared, y, order, counts, weights, shared_gate,
        s_gate, swe, swn, sse, ssn, inter, hidden, pairs, tokens,
        E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, SHARED: tl.constexpr, COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
        SCALED: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    ):  # fmt: skip
        """y[order[r], n] = weights[order[r]] * (h[r] . down[e, n]) in float32, each row at its
        pair's place (shared: y[r] = sigmoid(shared_gate[r - pairs]) * (h[r] . w_shared[n]));
        rows, columns and SCALED as in `_gate_up_kernel`."""
        shared, e, first, count = _program_rows(counts, pairs, tokens, E, BLOCK_E, SHARED)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        n_ok = n < hidden
        base = tl.where(shared, w_shared, w + e.to(tl.int64) * swe)
        w_rows = base + n[:, None] * swn + k[None, :]
        s_rows = tl.where(shared, s_shared, s + e.to(tl.int64) * sse) + (n // SCALE_N) * ssn
        for m0 in range(0, count, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            m_ok = m < count
            rows = (first + m).to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                k_ok = k[None, :] < inter - k0
                ht = tl.load(
                    h + rows[:, None] * inter + k0 + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0
                ).to(COMPUTE)
                wt = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok, other=0.0).to(COMPUTE)
                if SCALED:
                    sd = tl.load(s_rows + k0 // SCALE_K, mask=n_ok, other=0.0)
                    acc += tl.dot(ht, tl.trans(wt), input_precision=PRECISION) * sd[None, :]
                else:
                    acc = tl.dot(ht, tl.trans(wt), acc, input_precision=PRECISION)
            routed_ok = m_ok & (first + m < pairs)  # the shared program's rows start at pairs
            pair = tl.where(shared, rows, tl.load(order + first + m, mask=routed_ok, other=0))
            g = tl.load(shared_gate + m * s_gate, mask=m_ok & (first + m >= pairs), other=0.0).to(tl.float32)
            scale = tl.where(
                shared, tl.sigmoid(g), tl.load(weights + pair, mask=routed_ok, other=0.0).to(tl.float32)
            )
            tl.store(
                y + pair[:, None] * hidden + n[None, :],
                acc * scale[:, None],
                mask=m_ok[:, None] & n_ok[None, :],
            )

    @triton.jit
    def _combine_kernel(y, out, hidden, pairs, K: tl.constexpr, SHARED: tl.constexpr, BLOCK_H: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(y + (t * K + j) * hidden + cols, mask=ok, other=0.0)
        if SHARED:
            acc += tl.load(y + (pairs + t) * hidden + cols, mask=ok, other=0.0)
        tl.store(out + t * hidden + cols, acc.to(out.dtype.element_ty), mask=ok)
