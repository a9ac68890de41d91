"""ForwardBatch layout and the per-layer state objects (KV, int8 KV, recurrent), on CPU."""

from __future__ import annotations

import pytest
import torch
from ballast.memory.specs import AttentionSpec, RecurrentStateSpec, kv_bytes_per_token, state_bytes_per_slot
from ballast.models.base import ForwardBatch
from ballast.models.layers.attention import gather, padded_groups, slot_attention_mask
from ballast.models.layers.state import PagedKV, RecurrentState, allocate_states, attention_spec


def test_forward_batch_flattens_mixed_sequences() -> None:
    b = ForwardBatch.build([(3, [10, 11, 12], 0), (0, [20], 7), (5, [30, 31], 4)], "cpu")
    assert b.token_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert b.positions.tolist() == [0, 1, 2, 7, 4, 5]
    assert b.slots.tolist() == [3, 0, 5] == b.slots_list
    assert b.slot_of_token.tolist() == [3, 3, 3, 0, 5, 5]
    assert b.seq_of_token.tolist() == [0, 0, 0, 1, 2, 2]
    assert b.cu_lens.tolist() == [0, 3, 4, 6]
    assert b.logit_index.tolist() == [2, 3, 5]  # each sequence's last token
    assert b.pad_index.tolist() == [0, 1, 2, 3, 6, 7]  # padded layout [3 seqs, max_len 3]
    assert (b.max_len, b.max_ctx, b.num_seqs, b.num_tokens) == (3, 8, 3, 6)
    assert not b.decode_only
    assert ForwardBatch.build([(0, [1], 4), (1, [2], 9)], "cpu").decode_only


def test_forward_batch_marks_its_tail_of_one_token_sequences() -> None:
    """Prompt chunks then single tokens: the tail (a one-token prompt chunk among them) is what
    CUDA attends with the decode kernel, with its own slots and context lengths."""
    b = ForwardBatch.build([(3, [10, 11, 12], 0), (6, [13], 0), (0, [20], 7), (5, [30], 4)], "cpu")
    assert b.tail_from == 1
    assert b.tail_slots is not None and b.tail_ctx is not None
    assert b.tail_slots.tolist() == [6, 0, 5] and b.tail_ctx.tolist() == [1, 8, 5]
    assert b.tail_max_ctx == 8
    # no tail: decodes only, a chunk last, a lone chunk
    for seqs in ([(0, [1], 4), (1, [2], 9)], [(0, [1], 4), (1, [2, 3], 9)], [(0, [1, 2], 0)]):
        b = ForwardBatch.build(seqs, "cpu")
        assert (b.tail_from, b.tail_slots, b.tail_ctx, b.tail_max_ctx) == (0, None, None, 0)


@pytest.mark.parametrize("seqs", [[], [(0, [1], 0), (0, [2], 3)], [(0, [], 0)], [(0, [1], -1)]])
def test_forward_batch_rejects_bad_input(seqs: list[tuple[int, list[int], int]]) -> None:
    with pytest.raises(ValueError):
        ForwardBatch.build(seqs, "cpu")


def test_mask_lets_each_token_see_its_cache_and_earlier_chunk_tokens() -> None:
    b = ForwardBatch.build([(0, [1, 2, 3], 2), (1, [4], 0)], "cpu")
    mask = slot_attention_mask(b)
    assert mask is not None and mask.shape == (2, 1, 3, 5)
    assert mask[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # The decode token sees position 0 only; its padded rows repeat the last real row (never empty).
    assert mask[1, 0].int().tolist() == [[1, 0, 0, 0, 0]] * 3
    assert slot_attention_mask(ForwardBatch.build([(2, [7], 9)], "cpu")) is None


def read_kv(kv: PagedKV, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [B, max_ctx, n_kv, head_dim] of batch's sequences, gathered from kv's store."""
    both = gather(kv.store, kv.layer, batch)
    return both[:, :, : kv.layout.num_kv_heads], both[:, :, kv.layout.num_kv_heads :]


def _kv(num_slots: int, max_len: int, heads: int, dim: int, quantized: bool = False) -> PagedKV:
    state = allocate_states(
        [attention_spec(heads, dim, 1 if quantized else 4)],
        num_slots,
        max_len,
        "cpu",
        torch.float32,
        quantized_kv=quantized,
    )[0]
    assert isinstance(state, PagedKV)
    return state


def test_kv_write_then_read_by_slot_and_position() -> None:
    kv = _kv(num_slots=4, max_len=16, heads=2, dim=8)
    b = ForwardBatch.build([(2, [1, 2, 3], 5), (0, [4], 1)], "cpu")
    k = torch.randn(4, 2, 8)
    v = torch.randn(4, 2, 8)
    kv.write(b, k, v)
    keys, values = read_kv(kv, b)
    assert keys.shape == (2, 8, 2, 8)  # [B, max_ctx, heads, dim]
    assert torch.equal(keys[0, 5:8], k[:3]) and torch.equal(values[1, 1], v[3])
    others, _ = read_kv(kv, ForwardBatch.build([(1, [0] * 16, 0), (3, [0] * 16, 0)], "cpu"))
    assert others.abs().sum() == 0  # other slots untouched


def test_kv_positions_cross_blocks_through_the_table() -> None:
    """A slot's blocks need not be consecutive: positions map through its table row."""
    kv = _kv(num_slots=2, max_len=96, heads=1, dim=4)
    table = kv.store.block_table
    table[0, :3] = torch.tensor([5, 1, 3], dtype=torch.int32)  # slot 0's positions 0-95 in blocks 5, 1, 3
    b = ForwardBatch.build([(0, list(range(70)), 0)], "cpu")
    k, v = torch.randn(70, 1, 4), torch.randn(70, 1, 4)
    kv.write(b, k, v)
    keys, _ = read_kv(kv, b)
    assert torch.equal(keys[0], k)
    bs = kv.layout.block_size
    host = kv.store.host
    assert host is not None
    assert torch.equal(host.kv[0, 1, 0, 0], k[bs, 0]) and torch.equal(host.kv[0, 3, 0, 0], k[2 * bs, 0])


def test_int8_kv_round_trip_is_close() -> None:
    kv = _kv(2, 8, 3, 16, quantized=True)
    b = ForwardBatch.build([(1, list(range(6)), 0)], "cpu")
    k, v = torch.randn(6, 3, 16) * 5, torch.randn(6, 3, 16)
    kv.write(b, k, v)
    assert kv.store.host is not None and kv.store.host.kv.dtype == torch.int8
    keys, values = read_kv(kv, b)
    assert keys.dtype == torch.float32
    # Symmetric absmax int8: error at most half a step, step = row absmax / 127.
    step = k.abs().amax(-1, keepdim=True) / 127
    assert ((keys[0, :6] - k).abs() <= step / 2 + 1e-6).all()
    assert (values[0, :6] - v).abs().max() < 0.02
    # Per position: 2 * 3 heads of 16 int8 values and a float32 scale each.
    assert kv.layout.block_layer_bytes == kv.layout.block_size * (2 * 3 * 16 + 2 * 3 * 4)


def test_kv_layer_has_no_per_slot_checkpoint_tensors() -> None:
    kv = _kv(2, 8, 1, 4)
    assert kv.slot_views(0) == ()
    kv.load(1, ())
    with pytest.raises(ValueError):
        kv.load(1, (torch.zeros(1),))


def test_recurrent_reset_only_touches_given_slots_and_views_load() -> None:
    st = RecurrentState(4, conv_shape=(6, 3), state_shape=(2, 4, 5), dtype=torch.bfloat16, device="cpu")
    assert st.conv.dtype == torch.bfloat16 and st.recurrent.dtype == torch.float32
    st.conv.fill_(1)
    st.recurrent.fill_(2)
    st.reset(torch.tensor([1, 3]))
    assert st.conv[1].abs().sum() == 0 and st.recurrent[3].abs().sum() == 0
    assert (st.conv[0] == 1).all() and (st.recurrent[2] == 2).all()
    saved = [t.clone() for t in st.slot_views(0)]
    st.conv[0].fill_(7)  # a copy taken from the views: later writes do not reach it
    st.load(3, saved)
    assert (st.conv[3] == 1).all() and (st.recurrent[3] == 2).all()
    conv_view, _ = st.slot_views(3)
    assert conv_view.data_ptr() == st.conv[3].data_ptr()


def test_allocate_states_follows_specs_and_bytes_match() -> None:
    specs = [attention_spec(2, 8, 4), RecurrentStateSpec((6, 3), 4, (2, 4, 5)), attention_spec(2, 8, 4)]
    states = allocate_states(specs, num_slots=3, max_len=10, device="cpu", dtype=torch.float32)
    assert [type(s) for s in states] == [PagedKV, RecurrentState, PagedKV]
    kv = states[0]
    assert isinstance(kv, PagedKV) and kv.store is states[2].store  # one store for every layer
    # A block holds block_size positions of every attention layer.
    assert kv.layout.block_bytes == kv_bytes_per_token(specs) * kv.layout.block_size
    assert kv.layout.capacity_blocks >= 3  # every slot's 10 tokens fit in one block each
    assert states[1].nbytes == state_bytes_per_slot(specs) * 3
    q_specs = [attention_spec(2, 8, 1)]
    assert q_specs[0] == AttentionSpec(2, 8, 1, scale_bytes=4)
    q_states = allocate_states(q_specs, 3, 10, "cpu", torch.float32, quantized_kv=True)
    q = q_states[0]
    assert (
        isinstance(q, PagedKV) and q.layout.block_bytes == kv_bytes_per_token(q_specs) * q.layout.block_size
    )


def test_subset_and_mixed_step_groups() -> None:
    b = ForwardBatch.build([(3, [10, 11, 12], 0), (0, [20], 7), (5, [30, 31], 4), (1, [40], 2)], "cpu")
    sub, token_index = b.subset([2, 0])
    assert token_index.tolist() == [4, 5, 0, 1, 2]
    assert sub.token_ids.tolist() == [30, 31, 10, 11, 12]
    assert sub.positions.tolist() == [4, 5, 0, 1, 2]
    assert sub.slots_list == [5, 3] and (sub.max_len, sub.max_ctx) == (3, 6)
    assert sub.pad_index.tolist() == [0, 1, 3, 4, 5]
    decodes, chunks = padded_groups(b)
    assert decodes.token_index is not None and chunks.token_index is not None
    assert decodes.batch.decode_only and decodes.token_index.tolist() == [3, 6]
    assert chunks.batch.slots_list == [3, 5] and chunks.token_index.tolist() == [0, 1, 2, 4, 5]
    # Decode tokens are not padded to the chunk length: their group's mask has one query row.
    assert decodes.mask is not None and decodes.mask.shape == (2, 1, 1, 8)
    # A step of only chunks, or only decodes, is one padded call.
    (whole,) = padded_groups(ForwardBatch.build([(0, [1, 2], 0), (1, [3, 4, 5], 0)], "cpu"))
    assert whole.token_index is None and whole.mask is not None and whole.mask.shape == (2, 1, 3, 3)


def test_packed_index_tensors_each_start_on_16_bytes() -> None:
    """A batch's index tensors go to the GPU as views of one packed tensor; each must start on a
    16-byte boundary whatever its neighbours' lengths (odd token and sequence counts here), or
    Triton compiles its kernels again for every new alignment while serving."""
    from ballast.models.base import pack_aligned

    parts = [torch.arange(n, dtype=torch.int64) + 100 * n for n in (3, 1, 4, 5, 2)]
    packed, starts = pack_aligned(parts)
    assert [packed[at : at + p.shape[0]].tolist() for p, at in zip(parts, starts, strict=True)] == [
        p.tolist() for p in parts
    ]
    assert all(at * packed.element_size() % 16 == 0 for at in starts)
    assert packed.shape[0] == 4 + 2 + 4 + 6 + 2
