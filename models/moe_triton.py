"""MoE routing of a decode-sized batch in two Triton kernels instead of about fourteen.

`moe.route` (softmax, top-k, renormalise, cast) and `moe.Routing.sort` (a stable radix argsort
of the (token, expert) pairs, the counts, the token of each pair) launch about fourteen kernels a
layer; in a decode step of the Qwen3-Next-shaped 6B model on an H200 (48 MoE layers) the sort
alone took 1.3 ms of a 22 ms step at batch 32, and at batch 1 every one of those kernels is a few
microseconds of a launch-bound step. Here:

- `route_topk`: one program per token: softmax in float32, the top k by k arg-max passes,
  optionally renormalised; weights in the logits' dtype, expert ids int64 (as `torch.topk`).
- `align`: one program for all pairs (at most `MAX_PAIRS`): a histogram of the expert ids gives
  the counts, their running sum each expert's first row, and an atomic counter per expert each
  pair's row. Pairs of one expert keep no particular order among themselves (each row's expert
  output does not depend on it); experts' groups are in id order, as the grouped GEMM wants.

Larger batches (prefill) take the torch path: their sort is a small part of a long step. Their
combine after the grouped GEMMs is `combine_pairs`, one kernel reading each pair's row once where
the torch form gathered, widened to float32, weighted and summed [T, k, H].

`experts_mlp` (`FUSED_EXPERTS`, on: see there) runs the experts of a decode-sized batch in three
kernels over the grouped pairs: gate/up GEMMs of each expert's gathered token rows with SwiGLU in
the epilogue; the down GEMM with the routing weight applied and each row written back at its
pair's place; then one ordered sum per token over its k rows. One GEMM program per (expert,
column block): an expert's weights stream from memory once however many of its rows there are,
an expert without pairs costs an early exit, and nothing reads the counts on the host
(graph-safe). A shared expert of the routed experts' shape is one more program of each GEMM
launch (every token is one of its rows, weighted by the sigmoid of its gate) and one more row of
each token's sum; the router and the shared expert's gate are one GEMM before (`SparseMoeBlock`).
It replaces the token gather, two grouped GEMMs, SwiGLU, the combine's gather, weighting and
sum, and the shared expert's two GEMMs, SwiGLU, gate GEMM, sigmoid, product and add: about
eighteen kernels of every MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

MAX_PAIRS = 4096  # (token, expert) pairs one `align` program holds: 409 tokens of top-10
MAX_EXPERTS = 1024  # router width one `route_topk` program holds
# `experts_mlp` serves at most this many pairs (409 tokens of top-10, the `align` limit); more (a
# prefill) take the grouped GEMM. `bench/moe_experts.py` on an H200: fused / grouped time of one
# layer 0.53-0.67 at 128 tokens, 0.69-0.78 at 256 (at 1-32 tokens see FUSED_EXPERTS).
MAX_FUSED_PAIRS = MAX_PAIRS
# Whether `moe.experts_forward` takes `experts_mlp` on CUDA. Measured on an H200 (session 10,
# `decode_profile --models qwen3-next-6b --batch 32 --no-eager --moe-kernel grouped fused`): a
# decode step 13.91 -> 12.21 ms, its experts 3.60 ms of grouped GEMM -> 2.97 ms in the two kernels,
# 672 fewer kernels a step. Tested against the torch path, on CUDA and under Triton's interpreter.
FUSED_EXPERTS = True
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
    (the shared expert's, one row per token, or a routed expert with twice the mean of its
    pairs) streams its weights once, not once per 16 rows, since a launch lasts as long as its
    slowest program. 16 to 64: the accumulators of more rows would spill. On an H200 (session 12,
    `bench/moe_experts.py --sweep`, the 6B cut's layer with its shared expert at 32 tokens): 16 rows
    70.3 us, 32 rows 59.3 us, 64 rows 67.1 us; the decode step at batch 32 9.52 -> 8.76 ms."""
    fullest = max(shared_rows, -(-2 * pairs // experts))
    return min(64, max(16, 1 << (fullest - 1).bit_length()))


class SharedExpert(NamedTuple):
    """A shared expert run as one more program of the expert kernels: every token is its row,
    weighted by sigmoid(gate). gate_up [2I, H] and down [H, I] as a routed expert's; gate [T, 1]."""

    gate_up: Tensor
    down: Tensor
    gate: Tensor


def available(x: Tensor) -> bool:
    return triton is not None and x.is_cuda


def route_topk(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """logits [T, E] -> (weights [T, k] in logits' dtype, expert ids [T, k] int64), the top k of
    softmax(logits) in float32, renormalised to sum 1 when `normalize`."""
    assert triton is not None
    tokens, experts = logits.shape
    assert experts <= MAX_EXPERTS
    weights = torch.empty((tokens, top_k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_topk_kernel[(tokens,)](
            logits,
            weights,
            ids,
            logits.stride(0),
            logits.stride(1),
            E=experts,
            K=top_k,
            BLOCK_E=triton.next_power_of_2(experts),
            BLOCK_K=triton.next_power_of_2(top_k),
            NORMALIZE=normalize,
        )
    return weights, ids


def align(flat: Tensor, bins: int, top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """flat [P] expert id of each pair (P = tokens x top_k, id < bins) -> (order [P]: the pair
    at each row of the expert-grouped order, token [P]: that pair's token, counts [bins] int64)."""
    assert triton is not None
    pairs = flat.shape[0]
    assert pairs <= MAX_PAIRS
    order = torch.empty(pairs, dtype=torch.int64, device=flat.device)
    token = torch.empty(pairs, dtype=torch.int64, device=flat.device)
    counts = torch.empty(bins, dtype=torch.int64, device=flat.device)
    block_bins = triton.next_power_of_2(bins + 1)  # one spare bin for the padding lanes
    scratch = torch.empty(block_bins, dtype=torch.int32, device=flat.device)
    block_p = max(16, triton.next_power_of_2(pairs))
    _align_pairs_kernel[(1,)](
        flat,
        order,
        token,
        counts,
        scratch,
        pairs,
        K=top_k,
        BINS=bins,
        BLOCK_BINS=block_bins,
        BLOCK_P=block_p,
        num_warps=8 if block_p >= 1024 else 4,
    )
    return order, token, counts


def fused_ok(x: Tensor, gate_up: Tensor, pairs: int) -> bool:
    """Whether `experts_mlp` serves this batch: CUDA with Triton, the switch on, a decode-sized
    batch, weights of x's dtype (FP8 experts have their own kernel)."""
    return (
        FUSED_EXPERTS
        and available(x)
        and 0 < pairs <= MAX_FUSED_PAIRS
        and x.dtype in _FUSED_DTYPES
        and gate_up.dtype == x.dtype
    )


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
) -> Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x[t])) * up_e(x[t])) for every token t, e the
    pair's expert; x [T, H], weights [T, k]; (token, order, counts) the expert-grouped pairs of
    `moe.Routing` (counts of the local experts only; with `outside`, the pairs past them, held on
    another rank, add 0). gate_up [E, 2I, H], down [E, H, I] in x's dtype. shared: a shared
    expert, one more program of each launch (its rows: every token, after the P routed pairs),
    its gated output in the same final sum. Returns [T, H] in x's dtype."""
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
    s_gate_up, s_down, s_gate = shared if shared is not None else (gate_up, down, weights)
    programs = experts + (shared is not None)
    block_m = tiling.block_m or rows_per_pass(pairs, experts, tokens if shared is not None else 0)
    common = {
        "E": experts,
        "BLOCK_E": triton.next_power_of_2(experts),
        "BLOCK_M": block_m,
        "COMPUTE": _TL[x.dtype],
        "PRECISION": "ieee" if x.dtype == torch.float32 else "tf32",
    }
    _gate_up_kernel[(programs, triton.cdiv(inter, gu.block_n))](
        x,
        gate_up,
        s_gate_up,
        h,
        token,
        counts,
        x.stride(0),
        gate_up.stride(0),
        gate_up.stride(1),
        inter,
        hidden,
        pairs,
        tokens,
        BLOCK_N=gu.block_n,
        BLOCK_K=gu.block_k,
        num_warps=gu.num_warps,
        num_stages=gu.num_stages,
        **common,
    )
    _down_kernel[(programs, triton.cdiv(hidden, dn.block_n))](
        h,
        down,
        s_down,
        y,
        order,
        counts,
        weights.reshape(-1),
        s_gate,
        s_gate.stride(0),
        down.stride(0),
        down.stride(1),
        inter,
        hidden,
        pairs,
        tokens,
        BLOCK_N=dn.block_n,
        BLOCK_K=dn.block_k,
        num_warps=dn.num_warps,
        num_stages=dn.num_stages,
        **common,
    )
    return _combine(y, tokens, pairs, shared is not None, x.dtype)


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
        y,
        out,
        hidden,
        pairs,
        K=pairs // tokens,
        SHARED=shared,
        BLOCK_H=block,
    )
    return out


def combine_pairs(y: Tensor, back: Tensor, weights: Tensor, kept: Tensor | None) -> Tensor:
    """The grouped GEMM's combine: out[t] = sum_j weights[t, j] * y[back[t * k + j]] in j order,
    float32 until the one rounding to weights' dtype; y [P, H] the pairs' expert outputs in the
    expert-grouped order, back [P] each pair's row there, weights [T, k]; with `kept` (a device
    scalar), rows from it on count zero (no GEMM wrote them). One kernel, reading each row once,
    where the torch form gathers, widens, weights and sums [T, k, H] in float32."""
    assert triton is not None
    tokens, top_k = weights.shape
    hidden = y.shape[1]
    assert y.stride(1) == 1 and back.shape[0] == tokens * top_k and weights.is_contiguous()
    out = torch.empty((tokens, hidden), dtype=weights.dtype, device=y.device)
    if tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_pairs_kernel[(tokens, triton.cdiv(hidden, block))](
        y,
        back,
        weights,
        back if kept is None else kept,  # a pointer the kernel never reads without HAS_KEPT
        out,
        y.stride(0),
        hidden,
        K=top_k,
        HAS_KEPT=kept is not None,
        BLOCK_H=block,
    )
    return out


if triton is not None:
    _TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    @triton.jit
    def _expert_rows(counts, E: tl.constexpr, BLOCK_E: tl.constexpr):
        """(first grouped row, row count) of this program's expert: a running sum of the counts."""
        e = tl.program_id(0)
        b = tl.arange(0, BLOCK_E)
        c = tl.load(counts + b, mask=b < E, other=0)
        return tl.sum(tl.where(b < e, c, 0)), tl.sum(tl.where(b == e, c, 0))

    @triton.jit
    def _program_rows(counts, pairs, tokens, E: tl.constexpr, BLOCK_E: tl.constexpr):
        """(is the shared expert's, first grouped row, row count) of this program: program E (only
        launched with a shared expert) owns rows [pairs, pairs + tokens), one per token."""
        first, count = _expert_rows(counts, E, BLOCK_E)
        shared = tl.program_id(0) == E
        return shared, tl.where(shared, pairs, first), tl.where(shared, tokens, count)

    @triton.jit
    def _gate_up_kernel(
        x,
        w,
        w_shared,
        h,
        token,
        counts,
        sx,
        swe,
        swn,
        inter,
        hidden,
        pairs,
        tokens,
        E: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        COMPUTE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """h[r, n] = silu(x[token[r]] . gate[n]) * (x[token[r]] . up[n]) for the rows r of one
        expert, columns n of one block; gate = w[e, :I], up = w[e, I:] (the shared expert's
        program: w_shared, token r - pairs)."""
        shared, first, count = _program_rows(counts, pairs, tokens, E, BLOCK_E)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        n_ok = n < inter
        base = tl.where(shared, w_shared, w + tl.program_id(0).to(tl.int64) * swe)
        w_gate = base + n[:, None] * swn + k[None, :]
        w_up = w_gate + inter * swn
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
        h,
        w,
        w_shared,
        y,
        order,
        counts,
        weights,
        shared_gate,
        s_gate,
        swe,
        swn,
        inter,
        hidden,
        pairs,
        tokens,
        E: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        COMPUTE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """y[order[r], n] = weights[order[r]] * (h[r] . down[e, n]) for the rows r of one expert,
        columns n of one block: each row lands at its pair's place in float32 (the shared
        expert's program: y[r] = sigmoid(shared_gate[r - pairs]) * (h[r] . w_shared[n]))."""
        shared, first, count = _program_rows(counts, pairs, tokens, E, BLOCK_E)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        n_ok = n < hidden
        base = tl.where(shared, w_shared, w + tl.program_id(0).to(tl.int64) * swe)
        w_rows = base + n[:, None] * swn + k[None, :]
        for m0 in range(0, count, BLOCK_M):
            m = m0 + tl.arange(0, BLOCK_M)
            m_ok = m < count
            rows = (first + m).to(tl.int64)
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                k_ok = k[None, :] < inter - k0
                ht = tl.load(
                    h + rows[:, None] * inter + k0 + k[None, :], mask=m_ok[:, None] & k_ok, other=0.0
                )
                wt = tl.load(w_rows + k0, mask=n_ok[:, None] & k_ok, other=0.0)
                acc = tl.dot(ht.to(COMPUTE), tl.trans(wt.to(COMPUTE)), acc, input_precision=PRECISION)
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
    def _combine_kernel(
        y,
        out,
        hidden,
        pairs,
        K: tl.constexpr,
        SHARED: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            acc += tl.load(y + (t * K + j) * hidden + cols, mask=ok, other=0.0)
        if SHARED:
            acc += tl.load(y + (pairs + t) * hidden + cols, mask=ok, other=0.0)
        tl.store(out + t * hidden + cols, acc.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _combine_pairs_kernel(
        y,
        back,
        weights,
        kept,
        out,
        y_row,
        hidden,
        K: tl.constexpr,
        HAS_KEPT: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        ok = cols < hidden
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(back + t * K + j)
            w = tl.load(weights + t * K + j).to(tl.float32)
            live = ok
            if HAS_KEPT:
                live = ok & (row < tl.load(kept))
            acc += w * tl.load(y + row * y_row + cols, mask=live, other=0.0).to(tl.float32)
        tl.store(out + t * hidden + cols, acc.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _route_topk_kernel(
        logits,
        weights,
        ids,
        row_stride,
        col_stride,
        E: tl.constexpr,
        K: tl.constexpr,
        BLOCK_E: tl.constexpr,
        BLOCK_K: tl.constexpr,
        NORMALIZE: tl.constexpr,
    ):
        t = tl.program_id(0)
        e = tl.arange(0, BLOCK_E)
        x = tl.load(logits + t * row_stride + e * col_stride, mask=e < E, other=-float("inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        # Padding lanes sit below every real one (a picked one is -1, a NaN row's are too: NaN
        # compares false), so an arg-max never lands past the experts: a graph's padding rows
        # carry garbage, and an id out of range would make `align` write out of bounds.
        p = tl.where(e < E, tl.where(p == p, p, -1.0), -2.0)
        j = tl.arange(0, BLOCK_K)
        picked = tl.zeros([BLOCK_K], dtype=tl.float32)
        which = tl.zeros([BLOCK_K], dtype=tl.int64)
        for i in tl.static_range(K):
            best = tl.argmax(p, 0)
            picked = tl.where(j == i, tl.max(p, 0), picked)
            which = tl.where(j == i, best.to(tl.int64), which)
            p = tl.where(e == best, -1.0, p)
        if NORMALIZE:
            picked = picked / tl.sum(picked, 0)  # lanes past K hold 0
        tl.store(weights + t * K + j, picked.to(weights.dtype.element_ty), mask=j < K)
        tl.store(ids + t * K + j, which, mask=j < K)

    @triton.jit
    def _align_pairs_kernel(
        flat,
        order,
        token,
        counts,
        scratch,
        pairs,
        K: tl.constexpr,
        BINS: tl.constexpr,
        BLOCK_BINS: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        i = tl.arange(0, BLOCK_P)
        real = i < pairs
        e = tl.load(flat + i, mask=real, other=BINS).to(tl.int32)  # padding: the spare bin
        e = tl.where(real, tl.minimum(tl.maximum(e, 0), BINS - 1), BINS)  # never out of bounds
        hist = tl.histogram(e, BLOCK_BINS)
        b = tl.arange(0, BLOCK_BINS)
        tl.store(counts + b, hist.to(tl.int64), mask=b < BINS)
        tl.store(scratch + b, tl.cumsum(hist, 0) - hist)  # each expert's first row
        tl.debug_barrier()
        row = tl.atomic_add(scratch + e, 1, mask=real)
        tl.store(order + row, i.to(tl.int64), mask=real)
        tl.store(token + row, (i // K).to(tl.int64), mask=real)
