"""A verify row's per-position states (CPU, float32), the parts the rollback is built from: the rule
keeps the state after each position with a decode step's bits, the conv's inputs give the window
after each position, and the workspace is what the ledger is asked for."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.runner.load_fit import bytes_beside_weights
from ballast.engine.runner.model_runner import ModelRunner, planned_state_bytes
from ballast.engine.workspace import VerifySize
from ballast.models.arch.builtin import builtin_config, init_random
from ballast.models.arch.registry import build_model
from ballast.models.blocks.gated_delta import (
    DeltaPlan,
    gated_delta_varlen,
    recurrent_gated_delta_step,
    rows_only,
)
from ballast.models.layers.causal_conv import ConvWindows, causal_conv1d_varlen
from ballast.models.layers.state import RecurrentState
from triton_kernels import delta_rule_inputs

HK, HV, DK, DV = 2, 4, 16, 8
CPU = torch.device("cpu")


def _flat(tokens: int, batch: int) -> tuple[torch.Tensor, ...]:
    return delta_rule_inputs(tokens, batch, (HK, HV, DK, DV), 1.5, 0.3)


def test_verify_rows_keep_each_positions_state_with_a_decode_steps_bits() -> None:
    """A step of a prompt chunk, a decode and two verify rows of 3 and 2 drafts: each verify row's
    outputs, its state after each position and its final state are bit for bit those of decode
    steps over its tokens one at a time; the other rows are what they are without verify rows."""
    lens, verify = [5, 1, 4, 3], (False, False, True, True)
    q, k, v, g, beta, state = _flat(sum(lens), len(lens))
    plan = DeltaPlan.build(lens, CPU, verify)
    assert plan.verify_seqs is not None and plan.verify_seqs.tolist() == [2, 3] and plan.verify_len == 4
    kept = torch.full((3, 4, HV, DK, DV), float("nan"))  # a workspace of 3 rows of 4 drafts
    out, new = gated_delta_varlen(q, k, v, g, beta, state, plan, use_fla=False, kept=kept)
    plain_out, plain_new = gated_delta_varlen(
        q, k, v, g, beta, state, DeltaPlan.build(lens, CPU), use_fla=False
    )
    for b in (0, 1):  # the chunk and the decode: as without verify rows
        assert torch.equal(new[b], plain_new[b])
    assert torch.equal(out[:6], plain_out[:6])
    cu = [0, 5, 6, 10, 13]
    for row, b in enumerate((2, 3)):
        s = state[b : b + 1]
        for j, t in enumerate(range(cu[b], cu[b + 1])):
            o, s = recurrent_gated_delta_step(
                q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s
            )
            assert torch.equal(out[t], o[0])
            if t < cu[b + 1] - 1:
                assert torch.equal(kept[row, j], s[0])
        assert torch.equal(new[b], s[0])
    # the shorter row's padding passes its state through unchanged; a third row is never written
    assert torch.equal(kept[1, 2], new[3]) and kept[:, 3].isnan().all() and kept[2].isnan().all()


@pytest.mark.parametrize("position", [0, 1, 2])
def test_the_conv_window_after_any_position_is_its_inputs(position: int) -> None:
    """The saved inputs and the drafts' inputs give, for every position, the window that decode
    steps leave there (a copy: bit for bit); the recurrent state comes back from its kept row."""
    channels, kernel, drafts = 6, 4, 3
    st = RecurrentState(
        3, (channels, kernel - 1), (HV, DK, DV), torch.float32, "cpu", verify_rows=2, drafts=drafts
    )
    gen = torch.Generator().manual_seed(position)
    st.conv.copy_(torch.randn(st.conv.shape, generator=gen))
    x = torch.randn(drafts + 1, channels, generator=gen)  # a verify row's conv inputs, slot 2
    weight = torch.randn(channels, kernel, generator=gen)
    st.keep_inputs(torch.tensor([2]), x[None, :drafts])
    window = st.conv[2:3].clone()
    decode = ConvWindows(kernel=kernel, token_taps=None, state_taps=None, decode_only=True)
    for j in range(position + 1):
        _, window = causal_conv1d_varlen(x[j : j + 1], window, weight, decode)
    st.kept_states[0, position] = 7.0
    st.roll_back(2, 0, position)
    assert torch.equal(st.conv[2], window[0])
    assert (st.recurrent[2] == 7.0).all() and not st.recurrent[:2].any()
    with pytest.raises(ValueError, match="workspace holds 2 of 3"):
        st.keep_inputs(torch.tensor([0, 1, 2]), x[None, :drafts].expand(3, -1, -1))


def test_the_verify_workspace_is_what_the_ledger_is_asked_for_and_the_load_fit_counts() -> None:
    hf = builtin_config("tiny-qwen3-next")
    model = build_model(hf)
    init_random(model, seed=0)
    size = VerifySize(rows=2, drafts=3)
    runner = ModelRunner(model, CPU, torch.float32, 3, 32, quantized_kv=False, seed=0, verify=size)
    plain = planned_state_bytes(model, torch.float32, 3)
    assert runner.state_bytes == planned_state_bytes(model, torch.float32, 3, verify=size) > plain
    c = model.config
    per_row = 3 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
    channels = (
        2 * c.linear_num_key_heads * c.linear_key_head_dim
        + c.linear_num_value_heads * c.linear_value_head_dim
    )
    per_row += channels * (c.linear_conv_kernel_dim - 1 + 3) * 4
    layers = sum(t == "linear_attention" for t in c.layer_types)
    assert runner.state_bytes - plain == 2 * layers * per_row
    cfg = EngineConfig(model="builtin:tiny-qwen3-next", device="cpu", max_num_seqs=3, max_model_len=32)
    fixed = bytes_beside_weights(hf, cfg, torch.float32, "cpu", size)[0]
    assert fixed - bytes_beside_weights(hf, cfg, torch.float32, "cpu")[0] == 2 * layers * per_row


def test_only_decode_tokens_and_verify_rows_take_the_in_place_row_kernel() -> None:
    """A prompt chunk goes to the chunked form, verify flags or none (s28 read an empty flag tuple
    as "every row verifies", and a hybrid's GPU prefill ran the gated delta rule token by token)."""
    assert not rows_only([5], ())
    assert not rows_only([5, 1], ())
    assert not rows_only([4, 5], (True, False))
    assert rows_only([1, 1], ())
    assert rows_only([4, 1], (True, False))
