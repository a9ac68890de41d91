"""A decode step of a gated DeltaNet layer in Triton kernels, in place in the slot-state pools.

The general path (`GatedDeltaNet.forward`) gathers each slot's float32 state out of the pool, runs
the recurrence into a new state and scatters it back: three reads and three writes of 2 MiB a
sequence and layer (Qwen3-Next's 32 value heads of 128 x 128), plus a dozen small kernels for the
gates, q/k norms and head expansion; on an H200 at batch 32 the gather and scatter alone took 3.3 ms
of a 22 ms step of the 6B model. Here one program per (token, value head, block of value columns)
reads its state tile from its slot's pool row, applies the step (gates and L2 norms inside) and
writes it back: the state crosses the memory bus once each way.

The causal conv before it likewise: `conv_decode_in_place` (one token a sequence: the window is the
slot's saved K-1 inputs and the token, shifted back in place) and `conv_in_place` for any other step
(one kernel reads each token's window from the chunk and the saved inputs, a second writes the new
last K-1 back), where torch gathered, widened and multiply-added per tap: on an H200 32 prompts of 2k
of the 6B shape prefilled in 1.95 s with it (and `moe_triton.combine_pairs`) against 3.16 s.

A verify row (a decode and its drafts, engine.spec) takes the same kernel (`rows_in_place`): its
program keeps the state tile in registers across the row's tokens, one decode step's arithmetic
each, and writes the state after each position but the last to the verify workspace, from which
the rollback takes the one after the last accepted token.

Same arithmetic as `delta_rule.recurrent_gated_delta_step`, float32 throughout (the torch path
rounds beta to the model dtype first; here it is not, at most half a bf16 unit of difference).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch path serves
    triton = None

BLOCK_V = 32  # value columns a program holds: a 128 x 32 float32 tile is 32 registers a thread
BLOCK_C = 256  # conv channels a program holds
BLOCK_T = 16  # tokens a prefill conv program holds
L2_EPS = 1e-6  # as `gated_delta.l2norm` and fla's in-kernel normalisation


def available(x: Tensor) -> bool:
    """Whether the in-place kernel runs for tensors like x: CUDA and Triton here."""
    return triton is not None and x.is_cuda


def conv_decode_in_place(x: Tensor, pool: Tensor, weight: Tensor, slots: Tensor, keep: Tensor) -> Tensor:
    """silu(depthwise causal conv) of one token per sequence. x [B, C] (unit last stride); pool
    [S, C, K-1] the slots' last K-1 inputs (oldest first) in x's dtype, rows `slots` [B] read and
    shifted by the token in place; weight [C, K]; keep [B] bool: False starts from zeros.
    Returns [B, C] in x's dtype, accumulated in float32."""
    assert triton is not None
    batch, channels = x.shape
    kernel = weight.shape[-1]
    assert (
        kernel >= 2
        and pool.is_contiguous()
        and pool.shape[1:] == (channels, kernel - 1)
        and x.stride(-1) == 1
    )
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    if batch == 0:
        return out
    grid = (triton.cdiv(channels, BLOCK_C), batch)
    _conv_decode_kernel[grid](
        x,
        pool,
        weight,
        slots,
        keep,
        out,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        C=channels,
        K=kernel,
        BLOCK_C=BLOCK_C,
        BLOCK_K=triton.next_power_of_2(kernel),
        num_warps=4,
    )
    return out


def conv_in_place(
    x: Tensor,
    pool: Tensor,
    weight: Tensor,
    slots: Tensor,
    keep: Tensor,
    cu_lens: Tensor,
    seq_of_token: Tensor,
) -> Tensor:
    """`conv_decode_in_place` for a flat batch of sequences of any lengths: x [T, C], sequence b's
    tokens rows [cu_lens[b], cu_lens[b+1]), seq_of_token [T] each row's b; the slots' pool rows
    are then replaced by each sequence's last K-1 inputs. Accumulated in float32 over the taps
    oldest first (as `causal_conv.causal_conv1d_varlen`); a decode step takes the one kernel."""
    assert triton is not None
    tokens, channels = x.shape
    batch = slots.shape[0]
    if tokens == batch:  # every sequence has at least one token, so each has exactly one
        return conv_decode_in_place(x, pool, weight, slots, keep)
    kernel = weight.shape[-1]
    assert (
        kernel >= 2
        and pool.is_contiguous()
        and pool.shape[1:] == (channels, kernel - 1)
        and pool.dtype == x.dtype
        and x.stride(-1) == 1
    )
    out = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    common = {"C": channels, "K": kernel, "BLOCK_C": BLOCK_C, "num_warps": 4}
    _conv_prefill_kernel[(triton.cdiv(tokens, BLOCK_T), triton.cdiv(channels, BLOCK_C))](
        x,
        pool,
        weight,
        slots,
        keep,
        cu_lens,
        seq_of_token,
        out,
        tokens,
        x.stride(0),
        weight.stride(0),
        weight.stride(1),
        BLOCK_T=BLOCK_T,
        **common,
    )
    # after every output has read the saved inputs (the launches run in order on the stream)
    _conv_state_kernel[(batch, triton.cdiv(channels, BLOCK_C))](
        x,
        pool,
        slots,
        keep,
        cu_lens,
        x.stride(0),
        BLOCK_K=triton.next_power_of_2(kernel - 1),
        **common,
    )
    return out


def rows_in_place(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    a_log: Tensor,
    dt_bias: Tensor,
    pool: Tensor,
    slots: Tensor,
    keep: Tensor,
    cu_lens: Tensor | None = None,
    kept: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """A step of decode and verify rows -> o [T, Hv, Dv] in v's dtype. q, k [T, Hk, Dk], v [T, Hv,
    Dv]: the conv's output before the L2 norm (unit last stride); a, b [T, Hv]: the gate
    projections before their activations; a_log, dt_bias [Hv]; pool [S, Hv, Dk, Dv] float32, rows
    `slots` [B] read and written in place; keep [B] bool: False starts that row from zero state.
    Sequence i's tokens are rows [cu_lens[i], cu_lens[i+1]) (None: one each), run token by token.
    kept (states [R, D, Hv, Dk, Dv] float32, row_of_seq [B]): sequence i with r = row_of_seq[i] >= 0
    leaves the state after each of its positions but the last in states[r, 0 .. len - 2]."""
    assert triton is not None
    tokens, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    batch = slots.shape[0]
    assert pool.dtype == torch.float32 and pool.is_contiguous() and pool.shape[1:] == (hv, dk, dv)
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1 and hv % hk == 0
    assert cu_lens is not None or tokens == batch
    out = torch.empty((tokens, hv, dv), dtype=v.dtype, device=v.device)
    if batch == 0:
        return out
    states, row_of_seq = kept if kept is not None else (pool[:, None], slots)  # (unread without kept)
    assert states.dtype == torch.float32 and states.is_contiguous() and states.shape[2:] == (hv, dk, dv)
    grid = (triton.cdiv(dv, BLOCK_V), batch * hv)
    _gated_delta_rows_kernel[grid](
        q,
        k,
        v,
        a,
        b,
        a_log,
        dt_bias,
        pool,
        slots,
        keep,
        cu_lens if cu_lens is not None else slots,
        states,
        row_of_seq,
        out,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        dk**-0.5,
        L2_EPS,
        HV=hv,
        GROUP=hv // hk,
        DK=dk,
        DV=dv,
        BLOCK_K=triton.next_power_of_2(dk),
        BLOCK_V=BLOCK_V,
        ONE_TOKEN=cu_lens is None,
        KEEP=kept is not None,
        KEPT_LEN=states.shape[1],
        num_warps=4,
    )
    return out


if triton is not None:

    @triton.jit
    def _conv_decode_kernel(
        x,
        pool,
        weight,
        slots,
        keep,
        out,
        x_tok,
        w_chan,
        w_tap,
        C: tl.constexpr,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        chan = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        t = tl.program_id(1)
        taps = tl.arange(0, BLOCK_K)
        in_c = chan < C
        saved = in_c[:, None] & (taps[None, :] < K - 1)
        rows = pool + tl.load(slots + t).to(tl.int64) * (C * (K - 1)) + chan[:, None] * (K - 1)
        window = tl.load(rows + taps[None, :], mask=saved, other=0.0).to(tl.float32)
        window = tl.where(tl.load(keep + t) != 0, window, 0.0)
        token = tl.load(x + t * x_tok + chan, mask=in_c, other=0.0)
        window = tl.where(taps[None, :] == K - 1, token.to(tl.float32)[:, None], window)  # [C, K]
        w = tl.load(
            weight + chan[:, None] * w_chan + taps[None, :] * w_tap,
            mask=in_c[:, None] & (taps[None, :] < K),
            other=0.0,
        )
        acc = tl.sum(window * w.to(tl.float32), 1)
        acc = acc * tl.sigmoid(acc)
        tl.store(out + t * C + chan, acc.to(out.dtype.element_ty), mask=in_c)
        # the new saved inputs: window columns 1..K-1, written back as columns 0..K-2
        older = in_c[:, None] & (taps[None, :] < K - 2)
        shifted = tl.load(rows + taps[None, :] + 1, mask=older, other=0.0)
        shifted = tl.where(tl.load(keep + t) != 0, shifted, 0.0)
        shifted = tl.where(taps[None, :] == K - 2, token[:, None], shifted)
        tl.store(rows + taps[None, :], shifted.to(pool.dtype.element_ty), mask=saved)

    @triton.jit
    def _conv_prefill_kernel(
        x,
        pool,
        weight,
        slots,
        keep,
        cu_lens,
        seq_of_token,
        out,
        tokens,
        x_tok,
        w_chan,
        w_tap,
        C: tl.constexpr,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_T: tl.constexpr,
    ):
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        chan = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        in_t = t < tokens
        in_c = chan < C
        seq = tl.load(seq_of_token + t, mask=in_t, other=0)
        offset = t - tl.load(cu_lens + seq, mask=in_t, other=0)  # the token's place in its chunk
        row = tl.load(slots + seq, mask=in_t, other=0).to(tl.int64) * (C * (K - 1))
        kept = in_t & (tl.load(keep + seq, mask=in_t, other=0) != 0)
        acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        for j in tl.static_range(K):  # the taps, oldest first
            rel = offset - (K - 1) + j  # < 0: an input from before the chunk, in the saved ones
            mine = rel >= 0
            from_x = tl.load(
                x + (t - (K - 1) + j).to(tl.int64)[:, None] * x_tok + chan[None, :],
                mask=(in_t & mine)[:, None] & in_c[None, :],
                other=0.0,
            )
            saved = tl.load(
                pool + row[:, None] + chan[None, :] * (K - 1) + (K - 1 + rel)[:, None],
                mask=(kept & (rel < 0))[:, None] & in_c[None, :],
                other=0.0,
            )
            w = tl.load(weight + chan * w_chan + j * w_tap, mask=in_c, other=0.0).to(tl.float32)
            acc += tl.where(mine[:, None], from_x, saved).to(tl.float32) * w[None, :]
        acc = acc * tl.sigmoid(acc)
        tl.store(
            out + t.to(tl.int64)[:, None] * C + chan[None, :],
            acc.to(out.dtype.element_ty),
            mask=in_t[:, None] & in_c[None, :],
        )

    @triton.jit
    def _conv_state_kernel(
        x,
        pool,
        slots,
        keep,
        cu_lens,
        x_tok,
        C: tl.constexpr,
        K: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        b = tl.program_id(0)
        chan = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cols = tl.arange(0, BLOCK_K)
        in_c = chan < C
        first = tl.load(cu_lens + b)
        length = tl.load(cu_lens + b + 1) - first
        rows = pool + tl.load(slots + b).to(tl.int64) * (C * (K - 1)) + chan[:, None] * (K - 1)
        ok = in_c[:, None] & (cols[None, :] < K - 1)
        rel = length - (K - 1) + cols  # new column j holds the input rel places into the chunk
        mine = rel >= 0
        from_x = tl.load(
            x + (first + rel).to(tl.int64)[None, :] * x_tok + chan[:, None],
            mask=ok & mine[None, :],
            other=0.0,
        )
        saved = tl.load(
            rows + (K - 1 + rel)[None, :],
            mask=ok & (~mine)[None, :] & (tl.load(keep + b) != 0),
            other=0.0,
        )
        new = tl.where(mine[None, :], from_x, saved)
        tl.debug_barrier()  # a column read above may be one another thread writes below
        tl.store(rows + cols[None, :], new.to(pool.dtype.element_ty), mask=ok)

    @triton.jit
    def _gated_delta_rows_kernel(
        q,
        k,
        v,
        a,
        b,
        a_log,
        dt_bias,
        pool,
        slots,
        keep,
        cu_lens,
        kept,
        kept_row,
        out,
        q_tok,
        q_head,
        k_tok,
        k_head,
        v_tok,
        v_head,
        a_tok,
        a_head,
        b_tok,
        b_head,
        scale,
        eps,
        HV: tl.constexpr,
        GROUP: tl.constexpr,
        DK: tl.constexpr,
        DV: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr,
        ONE_TOKEN: tl.constexpr,
        KEEP: tl.constexpr,
        KEPT_LEN: tl.constexpr,
    ):
        col = tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V)
        row = tl.program_id(1)
        seq = row // HV
        h = row % HV
        kh = h // GROUP
        dims = tl.arange(0, BLOCK_K)
        in_k = dims < DK
        in_v = col < DV
        inside = in_k[:, None] & in_v[None, :]
        if ONE_TOKEN:
            first = seq
            last = seq + 1
        else:
            first = tl.load(cu_lens + seq)
            last = tl.load(cu_lens + seq + 1)

        tile = pool + tl.load(slots + seq).to(tl.int64) * (HV * DK * DV) + h * (DK * DV)
        tile = tile + dims[:, None] * DV + col[None, :]
        s = tl.load(tile, mask=inside, other=0.0)
        s = tl.where(tl.load(keep + seq) != 0, s, 0.0)
        if KEEP:  # this sequence's verify row (-1: none): the state after each position but the last
            kept_at = tl.load(kept_row + seq)
            kept_tile = kept + tl.maximum(kept_at, 0).to(tl.int64) * (KEPT_LEN * HV * DK * DV)
            kept_tile = kept_tile + h * (DK * DV) + dims[:, None] * DV + col[None, :]
        for t in range(first, last):
            bq = tl.load(q + t * q_tok + kh * q_head + dims, mask=in_k, other=0.0).to(tl.float32)
            bk = tl.load(k + t * k_tok + kh * k_head + dims, mask=in_k, other=0.0).to(tl.float32)
            bq = bq / tl.sqrt(tl.sum(bq * bq) + eps) * scale
            bk = bk / tl.sqrt(tl.sum(bk * bk) + eps)
            bv = tl.load(v + t * v_tok + h * v_head + col, mask=in_v, other=0.0).to(tl.float32)

            x = tl.load(a + t * a_tok + h * a_head).to(tl.float32) + tl.load(dt_bias + h).to(tl.float32)
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
            decay = tl.exp(-tl.exp(tl.load(a_log + h).to(tl.float32)) * softplus)
            beta = tl.sigmoid(tl.load(b + t * b_tok + h * b_head).to(tl.float32))

            s = s * decay
            delta = (bv - tl.sum(s * bk[:, None], 0)) * beta
            s = s + bk[:, None] * delta[None, :]
            o = tl.sum(s * bq[:, None], 0)
            tl.store(out + (t * HV + h) * DV + col, o.to(out.dtype.element_ty), mask=in_v)
            if KEEP:
                at = kept_tile + (t - first).to(tl.int64) * (HV * DK * DV)
                tl.store(at, s, mask=inside & (kept_at >= 0) & (t < last - 1))
        tl.store(tile, s, mask=inside)
