"""MoE routing of a decode-sized batch in two Triton kernels instead of about fourteen (`moe.route`
and `moe.Routing.sort`'s stable radix argsort): on an H200 the sort alone took 1.3 ms of a 22 ms
batch-32 step of the Qwen3-Next-shaped 6B model, and at batch 1 each kernel is a launch.

- `route_topk`: one program per token: softmax in float32, the top k by k arg-max passes,
  optionally renormalised; weights in the logits' dtype, expert ids int64 (as `torch.topk`).
- `align`: one program for all pairs (at most `MAX_PAIRS`): a histogram of the expert ids gives
  the counts, their running sum each expert's first row, and an atomic counter per expert each
  pair's row. Pairs of one expert keep no particular order among themselves (each row's expert
  output does not depend on it); experts' groups are in id order, as the grouped GEMM wants.

Larger batches (prefill) take the torch path, their sort a small part of a long step, and then
`combine_pairs` after the grouped GEMMs. The experts' fused GEMMs are models/kernels/moe_experts_triton.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

MAX_PAIRS = 4096  # (token, expert) pairs one `align` program holds: 409 tokens of top-10
MAX_EXPERTS = 1024  # router width one `route_topk` program holds


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


def combine_pairs(y: Tensor, back: Tensor, weights: Tensor, kept: Tensor | None) -> Tensor:
    """The grouped GEMM's combine: out[t] = sum_j weights[t, j] * y[back[t * k + j]] in j order,
    float32 until the one rounding to weights' dtype; y [P, H] the expert-grouped outputs, back [P]
    each pair's row there, weights [T, k]; with `kept` (a device scalar), rows from it on count zero
    (no GEMM wrote them). One kernel where the torch form gathers, widens, weights and sums."""
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
