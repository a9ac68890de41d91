"""The in-place decode kernel of the gated delta rule (`models/kernels/gated_delta_triton.py`) against the
torch rule on the same inputs: outputs, the pool rows it wrote, and the rows it must leave alone.
On CUDA; also under Triton's CPU interpreter (TRITON_INTERPRET=1 with triton installed), where it
runs on the CPU. Skips cleanly otherwise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ballast.models.blocks.gated_delta import recurrent_gated_delta_step
from ballast.models.kernels import gated_delta_triton
from ballast.models.layers.causal_conv import ConvWindows, causal_conv1d_varlen
from triton_kernels import DEVICE, marks

pytestmark = marks(gated_delta_triton)


def _case(batch: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype, slots: list[int]) -> dict:
    """Inputs laid out as the layer has them: q, k, v views into one conv output row, a and b
    views into one projection; a pool with more rows than the batch."""
    gen = torch.Generator().manual_seed(batch * 31 + hv)
    mixed = torch.randn(batch, 2 * hk * dk + hv * dv, generator=gen).to(dtype).to(DEVICE)
    ab = torch.randn(batch, 2 * hv, generator=gen).to(dtype).to(DEVICE)
    return {
        "q": mixed[:, : hk * dk].reshape(batch, hk, dk),
        "k": mixed[:, hk * dk : 2 * hk * dk].reshape(batch, hk, dk),
        "v": mixed[:, 2 * hk * dk :].reshape(batch, hv, dv),
        "a": ab[:, :hv],
        "b": ab[:, hv:],
        "a_log": torch.randn(hv, generator=gen).to(DEVICE),
        "dt_bias": torch.randn(hv, generator=gen).to(DEVICE),
        "pool": (torch.randn(max(slots) + 3, hv, dk, dv, generator=gen) * 0.3).to(DEVICE),
        "slots": torch.tensor(slots, device=DEVICE),
        "keep": torch.tensor([i % 3 != 1 for i in range(batch)], device=DEVICE),
    }


def _reference(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch rule on gathered rows (zero for a fresh one): (o, the pool it should leave)."""
    g = -c["a_log"].float().exp() * F.softplus(c["a"].float() + c["dt_bias"].float())
    beta = c["b"].float().sigmoid()
    rows = torch.where(c["keep"][:, None, None, None], c["pool"][c["slots"]], 0.0)
    o, s = recurrent_gated_delta_step(c["q"], c["k"], c["v"], g, beta, rows)
    pool = c["pool"].clone()
    pool[c["slots"]] = s
    return o, pool


SHAPES = [
    # batch, k heads, v heads, k dim, v dim: Qwen3-Next's per-rank heads (16/32 of 128, and
    # halved under tensor parallel), a batch past one program row, odd dims (masking)
    (1, 16, 32, 128, 128),
    (5, 8, 16, 128, 128),
    (33, 2, 4, 64, 96),
    (3, 3, 3, 40, 40),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"b{s[0]}-hk{s[1]}-hv{s[2]}-d{s[3]}x{s[4]}" for s in SHAPES])
def test_a_decode_step_in_place_matches_the_torch_rule(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    batch, hk, hv, dk, dv = shape
    # scattered rows of a pool larger than the batch, no repeats
    slots = torch.randperm(batch + 4, generator=torch.Generator().manual_seed(batch))[:batch].tolist()
    c = _case(batch, hk, hv, dk, dv, dtype, slots)
    want_o, want_pool = _reference(c)
    untouched = [r for r in range(c["pool"].shape[0]) if r not in slots]
    before = c["pool"][untouched].clone()
    o = gated_delta_triton.rows_in_place(**c)
    assert o.dtype == dtype and o.shape == (batch, hv, dv)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.float(), want_o.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(c["pool"], want_pool, atol=1e-4, rtol=1e-4)
    assert torch.equal(c["pool"][untouched], before)  # rows of other slots are not written


def test_a_fresh_row_ignores_what_its_slot_held() -> None:
    """keep False: the row starts from zero state, so garbage (even NaN) left in the slot by an
    earlier sequence does not leak into the new one."""
    c = _case(3, 2, 4, 64, 64, torch.float32, [0, 1, 2])
    c["pool"][1] = float("nan")  # row 1 is fresh (keep[1] is False)
    want_o, want_pool = _reference({**c, "pool": torch.nan_to_num(c["pool"])})
    o = gated_delta_triton.rows_in_place(**c)
    assert torch.isfinite(o).all() and torch.isfinite(c["pool"][1]).all()
    torch.testing.assert_close(o, want_o, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(c["pool"], want_pool, atol=1e-4, rtol=1e-4)


def test_verify_rows_keep_the_state_after_each_position() -> None:
    """A step of verify rows (a decode and its drafts) beside a plain decode, in the one kernel:
    each row runs token by token from its slot's state, as that many decode steps would, and a
    verify row leaves the state after each of its positions but the last in its workspace row;
    what the rollback copies back. Against the torch rule, token by token."""
    lens, rows = [3, 1, 4], [0, -1, 1]  # a verify row of 2 drafts, a decode, one of 3 drafts
    c = _case(sum(lens), 2, 4, 16, 40, torch.float32, [5, 0, 2, 3, 4, 1, 6, 7])  # v past one block
    c["slots"], c["keep"] = (
        torch.tensor([2, 0, 5], device=DEVICE),
        torch.ones(3, dtype=torch.bool, device=DEVICE),
    )
    kept = torch.full((2, 3, 4, 16, 40), float("nan"), device=DEVICE)  # unwritten places stay NaN
    pool = c["pool"].clone()
    cu = torch.tensor([0, 3, 4, 8], device=DEVICE)
    o = gated_delta_triton.rows_in_place(**c, cu_lens=cu, kept=(kept, torch.tensor(rows, device=DEVICE)))
    g = -c["a_log"].float().exp() * F.softplus(c["a"].float() + c["dt_bias"].float())
    beta = c["b"].float().sigmoid()
    for i, (n, row) in enumerate(zip(lens, rows, strict=True)):
        s = pool[c["slots"][i]][None]
        for j, t in enumerate(range(int(cu[i]), int(cu[i]) + n)):
            want, s = recurrent_gated_delta_step(
                c["q"][t : t + 1], c["k"][t : t + 1], c["v"][t : t + 1], g[t : t + 1], beta[t : t + 1], s
            )
            torch.testing.assert_close(o[t : t + 1], want, atol=1e-5, rtol=1e-5)
            if row >= 0 and j < n - 1:
                torch.testing.assert_close(kept[row, j], s[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c["pool"][c["slots"][i]], s[0], atol=1e-5, rtol=1e-5)
    assert kept[0, 2].isnan().all()  # the 2-draft row keeps two states, no more


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("batch", "channels", "kernel"), [(1, 8192, 4), (6, 300, 4), (4, 64, 2), (3, 33, 3)])
def test_conv_decode_in_place_matches_the_torch_conv(
    batch: int, channels: int, kernel: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(channels + kernel)
    x = torch.randn(batch, channels + 5, generator=gen).to(dtype).to(DEVICE)[:, 5:]  # a strided view
    slots = torch.randperm(batch + 3, generator=gen)[:batch].to(DEVICE)
    pool = torch.randn(batch + 3, channels, kernel - 1, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(channels, kernel, generator=gen).to(dtype).to(DEVICE)
    keep = torch.tensor([i % 3 != 1 for i in range(batch)], device=DEVICE)
    before = pool[slots].clone()
    decode = ConvWindows(kernel=kernel, token_taps=None, state_taps=None, decode_only=True)
    want_out, want_state = causal_conv1d_varlen(
        x, torch.where(keep[:, None, None], before, 0), weight, decode
    )
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    others = pool[untouched].clone()
    out = gated_delta_triton.conv_decode_in_place(x, pool, weight, slots, keep)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    assert torch.equal(pool[slots], want_state)  # the window shifted by the token, bit for bit
    assert torch.equal(pool[untouched], others)


CHUNKS = [
    # sequence lengths of one step: prompt chunks, decode tokens, chunks shorter than the window,
    # a step past one program's tokens
    [5, 1, 2, 17, 1],
    [40],
    [1, 3, 1, 1],
    [2, 2],
    [1, 1, 1],  # a decode step: the one-kernel form
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("lens", CHUNKS, ids=["-".join(map(str, c)) for c in CHUNKS])
@pytest.mark.parametrize(("channels", "kernel"), [(300, 4), (64, 2), (33, 3)])
def test_conv_in_place_matches_the_torch_conv_over_a_step_of_chunks(
    lens: list[int], channels: int, kernel: int, dtype: torch.dtype
) -> None:
    """The prefill form (`conv_in_place`): each sequence's outputs from its saved inputs and its
    chunk (zeros for a fresh one), and its slot's saved inputs replaced by its last K-1 (reaching
    back into the old ones for a chunk shorter than that); other slots untouched."""
    batch, tokens = len(lens), sum(lens)
    gen = torch.Generator().manual_seed(channels + kernel + tokens)
    x = torch.randn(tokens, channels + 5, generator=gen).to(dtype).to(DEVICE)[:, 5:]  # a strided view
    slots = torch.randperm(batch + 3, generator=gen)[:batch].to(DEVICE)
    pool = torch.randn(batch + 3, channels, kernel - 1, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(channels, kernel, generator=gen).to(dtype).to(DEVICE)
    keep = torch.tensor([i % 3 != 1 for i in range(batch)], device=DEVICE)
    lens_t = torch.tensor(lens, device=DEVICE)
    cu_lens = torch.zeros(batch + 1, dtype=torch.int64, device=DEVICE)
    cu_lens[1:] = lens_t.cumsum(0)
    seq_of_token = torch.repeat_interleave(torch.arange(batch, device=DEVICE), lens_t)
    windows = ConvWindows.build(cu_lens, lens_t, seq_of_token, kernel)
    want_out, want_state = causal_conv1d_varlen(
        x, torch.where(keep[:, None, None], pool[slots], 0), weight, windows
    )
    untouched = torch.ones(pool.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    others = pool[untouched].clone()
    out = gated_delta_triton.conv_in_place(x, pool, weight, slots, keep, cu_lens, seq_of_token)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    assert torch.equal(pool[slots], want_state)  # the last K-1 inputs, bit for bit
    assert torch.equal(pool[untouched], others)


def test_a_verify_row_through_the_model_keeps_what_decode_steps_reach(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The layer's CUDA path end to end (the conv in place, the rule in place, the workspace):
    tiny Qwen3-Next, a prompt, then its next three tokens either as three decode steps or as one
    verify row; the verify row's kept states after each position are the decode steps' states
    (the recurrent state, and the conv window its kept inputs give), which the rollback copies."""
    from ballast.engine.runner.model_runner import ModelRunner
    from ballast.engine.workspace import VerifySize
    from ballast.models.arch.builtin import builtin_config, init_random
    from ballast.models.arch.registry import build_model
    from ballast.models.base import StepBatch
    from ballast.models.layers.state import RecurrentState

    monkeypatch.setattr(gated_delta_triton, "available", lambda x: True)  # the interpreter's CPU too
    model = build_model(builtin_config("tiny-qwen3-next"))
    init_random(model, seed=0)
    model.to(DEVICE)
    prompt, nexts = list(range(3, 12)), [40, 41, 42]

    def runner() -> tuple[ModelRunner, list[RecurrentState]]:
        r = ModelRunner(model, DEVICE, torch.float32, 2, 32, False, 0, verify=VerifySize(1, len(nexts)))
        assert r.kv is not None and r.kv.ensure(0, 16)
        r.forward([(0, prompt, 0)])
        return r, [s for s in r.states if isinstance(s, RecurrentState)]

    plain, plain_states = runner()
    after = []
    for j, token in enumerate([7, *nexts[:-1]]):
        plain.forward([(0, [token], len(prompt) + j)])
        after.append([(s.recurrent[0].clone(), s.conv[0].clone()) for s in plain_states])
    drafting, kept = runner()
    batch = StepBatch.of([(0, [7, *nexts], len(prompt))], all_logits=(True,))
    batch.verify = (True,)
    drafting.forward(batch)
    hist = kept[0].conv.shape[-1]
    for j in range(len(nexts)):
        for s, (recurrent, conv) in zip(kept, after[j], strict=True):
            torch.testing.assert_close(s.kept_states[0, j], recurrent, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s.kept_inputs[0, :, j + 1 : j + 1 + hist], conv, atol=1e-5, rtol=1e-5)
