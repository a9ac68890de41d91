"""The gated delta rule and the causal conv against the reference torch implementations in
transformers (their own fallbacks), and the varlen batching against one-sequence-at-a-time runs."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from ballast.models.blocks.gated_delta import (
    DeltaPlan,
    chunk_gated_delta,
    gated_delta_varlen,
    recurrent_gated_delta_step,
)
from ballast.models.layers.causal_conv import ConvWindows, causal_conv1d_varlen
from transformers.models.qwen3_next import modeling_qwen3_next as ref

HK, HV, DK, DV = 2, 4, 16, 8
# transformers swaps in fla's CUDA kernels when fla is installed; the reference here is its own
# pure-torch fallback, which the decorator keeps as __wrapped__.
REF_CHUNK = inspect.unwrap(ref.torch_chunk_gated_delta_rule)
REF_RECURRENT = inspect.unwrap(ref.torch_recurrent_gated_delta_rule)
REF_CONV_UPDATE = inspect.unwrap(ref.causal_conv1d_update)


def _inputs(batch: int, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, HK, DK, generator=gen)
    k = torch.randn(batch, length, HK, DK, generator=gen)
    v = torch.randn(batch, length, HV, DV, generator=gen)
    g = -torch.rand(batch, length, HV, generator=gen) * 1.5  # log decay, <= 0
    beta = torch.rand(batch, length, HV, generator=gen)
    state = torch.randn(batch, HV, DK, DV, generator=gen) * 0.3
    return q, k, v, g, beta, state


def _reference_chunk(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    # transformers 5.17's fallback expects q/k already expanded to the value heads; 5.24's expands
    # them itself. Expanding here works with both.
    r = HV // HK
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    return REF_CHUNK(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


def _reference_recurrent(q, k, v, g, beta, state):  # type: ignore[no-untyped-def]
    r = HV // HK
    q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    return REF_RECURRENT(
        q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )


@pytest.mark.parametrize("length", [1, 37, 64, 150])
def test_chunked_form_matches_reference(length: int) -> None:
    q, k, v, g, beta, state = _inputs(3, length)
    want_o, want_s = _reference_chunk(q, k, v, g, beta, state)
    o, s = chunk_gated_delta(q, k, v, g, beta, state)
    assert s.dtype == torch.float32
    torch.testing.assert_close(o, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, want_s, atol=1e-5, rtol=1e-5)


def test_recurrent_step_matches_reference_and_chunked_form() -> None:
    q, k, v, g, beta, state = _inputs(2, 90, seed=1)
    want_o, want_s = _reference_recurrent(q, k, v, g, beta, state)
    s, outs = state, []
    for t in range(q.shape[1]):
        o, s = recurrent_gated_delta_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(o)
    torch.testing.assert_close(torch.stack(outs, 1), want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, want_s, atol=1e-5, rtol=1e-5)
    # The two forms are the same function of the inputs.
    chunk_o, chunk_s = chunk_gated_delta(q, k, v, g, beta, state)
    torch.testing.assert_close(chunk_o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(chunk_s, want_s, atol=1e-4, rtol=1e-4)


def test_state_stays_float32_for_bf16_inputs() -> None:
    q, k, v, g, beta, state = _inputs(2, 20, seed=2)
    o, s = chunk_gated_delta(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), state)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    o1, s1 = recurrent_gated_delta_step(
        q[:, 0].bfloat16(), k[:, 0].bfloat16(), v[:, 0].bfloat16(), g[:, 0], beta[:, 0].bfloat16(), state
    )
    assert o1.dtype == torch.bfloat16 and s1.dtype == torch.float32
    want_o, want_s = chunk_gated_delta(q, k, v, g, beta, state)
    torch.testing.assert_close(s, want_s, atol=0.05, rtol=0.05)


def test_varlen_batch_equals_each_sequence_alone() -> None:
    """Decode tokens (recurrent form) and prefill chunks of different lengths (chunked form,
    padded together) in one call give what each sequence gives on its own."""
    lens = [1, 70, 5, 1, 33]
    seqs = [_inputs(1, n, seed=10 + i) for i, n in enumerate(lens)]
    flat = [torch.cat([s[j][0] for s in seqs]) for j in range(5)]
    state = torch.cat([s[5] for s in seqs])
    plan = DeltaPlan.build(lens, torch.device("cpu"))
    out, new_state = gated_delta_varlen(*flat, state, plan, use_fla=False)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    for i, (q, k, v, g, beta, s0) in enumerate(seqs):
        want_o, want_s = _reference_chunk(q, k, v, g, beta, s0)
        torch.testing.assert_close(out[cu[i] : cu[i + 1]], want_o[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(new_state[i], want_s[0], atol=1e-5, rtol=1e-5)


def test_delta_plan_groups_sequences() -> None:
    plan = DeltaPlan.build([3, 1, 1, 4], torch.device("cpu"))
    assert plan.decode_seqs.tolist() == [1, 2]
    assert plan.decode_tokens.tolist() == [3, 4]
    assert plan.prefill_seqs.tolist() == [0, 3]
    assert plan.prefill_tokens.tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert plan.prefill_len == 4
    assert plan.prefill_padded.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert plan.prefill_cu_lens.tolist() == [0, 3, 7]
    assert not plan.all_decode and not plan.all_prefill
    chunks = DeltaPlan.build([3, 2, 4], torch.device("cpu"))  # prompt chunks alone: already in order
    assert chunks.all_prefill and chunks.prefill_tokens.tolist() == list(range(9))
    assert chunks.prefill_seqs.tolist() == [0, 1, 2]
    decode = DeltaPlan.build([1, 1, 1], torch.device("cpu"))
    assert (
        decode.all_decode
        and decode.decode_seqs.tolist() == [0, 1, 2]
        and decode.decode_tokens.tolist() == [0, 1, 2]
    )
    assert decode.prefill_seqs.numel() == 0 and decode.prefill_len == 0 and not decode.all_prefill


def test_a_step_of_prompt_chunks_alone_equals_them_beside_a_decode() -> None:
    """The all-prefill shortcut (no regrouping) gives what the regrouping path gives."""
    lens = [40, 7, 19]
    seqs = [_inputs(1, n, seed=30 + i) for i, n in enumerate(lens)]
    flat = [torch.cat([s[j][0] for s in seqs]) for j in range(5)]
    state = torch.cat([s[5] for s in seqs])
    plan = DeltaPlan.build(lens, torch.device("cpu"))
    assert plan.all_prefill
    out, new_state = gated_delta_varlen(*flat, state, plan, use_fla=False)
    one = _inputs(1, 1, seed=29)  # the same chunks with a decode token in front: regrouped
    both = [torch.cat([one[j][0], flat[j]]) for j in range(5)]
    mixed = DeltaPlan.build([1, *lens], torch.device("cpu"))
    assert not mixed.all_prefill
    want_o, want_s = gated_delta_varlen(*both, torch.cat([one[5], state]), mixed, use_fla=False)
    torch.testing.assert_close(out, want_o[1:], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_state, want_s[1:], atol=1e-6, rtol=1e-6)


def _conv_case(lens: list[int], history: list[int], channels: int, kernel: int):  # type: ignore[no-untyped-def]
    """Random sequences; each has `history` earlier inputs already folded into its state."""
    gen = torch.Generator().manual_seed(sum(lens))
    weight = torch.randn(channels, kernel, generator=gen)
    xs, states, want_out, want_state = [], [], [], []
    for n, h in zip(lens, history, strict=True):
        full = F.pad(torch.randn(channels, h + n, generator=gen), (kernel - 1, 0))  # zeros before position 0
        conv = F.silu(F.conv1d(full.unsqueeze(0), weight.unsqueeze(1), groups=channels))[0]
        xs.append(full[:, kernel - 1 + h :].T)
        states.append(full[:, h : h + kernel - 1])
        want_out.append(conv[:, h:].T)
        want_state.append(full[:, h + n : h + n + kernel - 1])
    return weight, torch.cat(xs), torch.stack(states), torch.cat(want_out), torch.stack(want_state)


@pytest.mark.parametrize("kernel", [2, 4])
def test_varlen_conv_matches_per_sequence_conv(kernel: int) -> None:
    lens, history = [5, 1, 3, 1, 9, 2], [2, 4, 0, 0, 1, 7]
    weight, x, state, want_out, want_state = _conv_case(lens, history, channels=6, kernel=kernel)
    lt = torch.tensor(lens)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lt.cumsum(0)])
    windows = ConvWindows.build(cu, lt, torch.repeat_interleave(torch.arange(len(lens)), lt), kernel)
    out, new_state = causal_conv1d_varlen(x, state, weight, windows)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_state, want_state)


def test_conv_decode_matches_reference_update() -> None:
    """A decode token through the varlen conv equals transformers' causal_conv1d_update."""
    gen = torch.Generator().manual_seed(3)
    channels, kernel, batch = 8, 4, 3
    weight = torch.randn(channels, kernel, generator=gen)
    state = torch.randn(batch, channels, kernel - 1, generator=gen)
    x = torch.randn(batch, channels, generator=gen)
    ref_state = state.clone()
    want = REF_CONV_UPDATE(x.unsqueeze(-1), ref_state, weight, None, "silu")[..., 0]
    ones = torch.ones(batch, dtype=torch.int64)
    windows = ConvWindows.build(torch.arange(batch + 1), ones, torch.arange(batch), kernel)
    out, new_state = causal_conv1d_varlen(x, state, weight, windows)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(new_state, ref_state)
