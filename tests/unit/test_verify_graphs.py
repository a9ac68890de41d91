"""Verify graphs' host side (the capture and replay themselves are in tests/gpu): the static
buffer's layout, which steps a graph may serve, how a step is laid into the static inputs, and,
on real built-in models on the CPU, that the padded static batch a graph is captured with gives
the real rows' logits, kept per-position states and slot states of the plain eager verify step;
how their memory is leased from a real VRAM ledger, or dropped where it has no room."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.graphs.decode import PAD_POSITION, PAD_TOKEN
from ballast.engine.graphs.graph_runner import capture_verify_graphs
from ballast.engine.graphs.verify import (
    VerifyGraphs,
    buffer_size,
    staged,
    verify_key,
    verify_keys,
    verify_layout,
)
from ballast.engine.workspace import VerifySize
from ballast.memory.types import GiB, MiB
from ballast.models.arch.builtin import builtin_config, init_random
from ballast.models.arch.registry import build_model
from ballast.models.base import StepBatch
from ballast.models.blocks.gated_delta import VerifyRows, rows_only
from ballast.models.layers.state import RecurrentState
from engine_steps import prefilled_runner
from memfixtures import ledger_watch

CPU = torch.device("cpu")
SCRATCH = 4
K = 3


def verify_batch(rows: list[tuple[int, list[int], int]], keep: bool = True) -> StepBatch:
    """A step of verify rows as the executor builds it: logits at every token, rows marked."""
    batch = StepBatch.of(rows, all_logits=(True,) * len(rows))
    batch.verify = (True,) * len(rows) if keep else ()
    return batch


def test_the_layout_puts_every_field_on_16_bytes_without_overlap() -> None:
    for width, length in ((1, 2), (3, 4), (7, 3), (7, 4), (8, 17)):
        layout = verify_layout(width, length)
        spans = sorted(layout.values())
        assert [size for _, size in spans] == [width * length] * 3 + [width] * 2
        assert all(at % 2 == 0 for at, _ in spans)
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:], strict=False))
        assert buffer_size(layout) >= spans[-1][0] + spans[-1][1] and buffer_size(layout) % 2 == 0


def test_one_row_at_every_draft_length_more_rows_at_the_longest_largest_first() -> None:
    assert verify_keys((1, 2, 4, 7), 3) == ((7, 4), (4, 4), (2, 4), (1, 4), (1, 3), (1, 2))
    assert verify_keys((1,), 1) == ((1, 2),)


def test_a_graph_serves_steps_of_verify_rows_of_one_length_alone() -> None:
    buckets = (1, 2, 4, 7)
    row = [5, 6, 7, 8]
    assert verify_key(verify_batch([(0, row, 10)]), buckets, True) == (1, 4)
    assert verify_key(verify_batch([(0, row[:2], 10)]), buckets, True) == (1, 2)  # one draft
    assert verify_key(verify_batch([(s, row, 10) for s in range(3)]), buckets, True) == (4, 4)
    assert verify_key(verify_batch([(s, row[:3], 10) for s in range(2)]), buckets, True) == (2, 3)
    assert verify_key(verify_batch([(s, row, 10) for s in range(7)]), buckets, True) == (7, 4)
    assert verify_key(verify_batch([(s, row, 10) for s in range(8)]), buckets, True) is None
    assert verify_key(verify_batch([(0, row, 10), (1, row[:2], 10)]), buckets, True) is None
    beside = StepBatch.of([(0, row, 10), (1, [9], 4)], all_logits=(True, False))  # a decode beside
    beside.verify = (True, False)
    assert verify_key(beside, buckets, True) is None
    assert verify_key(verify_batch([(0, [9], 10)]), buckets, True) is None  # a decode, no draft
    unmarked = verify_batch([(0, row, 10)], keep=False)  # a hybrid's rows must keep their states
    assert verify_key(unmarked, buckets, True) is None
    # an attention-only model marks nothing: its rows of k + 1 tokens with every logit are served
    assert verify_key(unmarked, buckets, False) == (1, 4)
    assert verify_key(verify_batch([(0, row, 10)]), buckets, False) is None
    last_only = StepBatch.of([(0, row, 10)])  # a prompt chunk of k + 1 tokens, its last logit
    assert verify_key(last_only, buckets, False) is None


def test_nothing_is_served_before_a_capture_nor_a_step_on_the_int8_store() -> None:
    graphs = VerifyGraphs(CPU, SCRATCH, rows=3, drafts=K, max_context=64, keep=True)
    assert graphs.buckets == (1, 2, 3) and graphs.length == K + 1
    assert graphs.keys == ((3, 4), (2, 4), (1, 4), (1, 3), (1, 2))
    batch = verify_batch([(0, [5, 6, 7, 8], 10)])
    assert graphs.key_of(batch) == (1, 4) and not graphs.can_use(batch)
    graphs._graphs[(1, 4)] = None  # type: ignore[assignment]  # stands for a capture
    assert graphs.can_use(batch) and not graphs.can_use(batch, mixed=True)
    assert not graphs.can_use(verify_batch([(0, [5, 6, 7], 10)]))  # (1, 3): not captured
    assert not graphs.can_use([])


def test_a_step_is_staged_as_its_eager_batch_plus_padding_rows() -> None:
    width, length = 4, K  # rows of 2 drafts in a buffer laid out for rows of K
    rows = [(2, [11, 12, 13], 9), (0, [21, 22, 23], 30)]
    layout = verify_layout(width, K + 1)
    host = staged(verify_batch(rows), layout, width, length, SCRATCH)
    eager = StepBatch.build(rows, CPU, all_logits=(True, True))
    fields = {name: host[at : at + n] for name, (at, n) in layout.items()}
    real = len(rows) * length
    for name in ("token_ids", "positions", "slot_of_token"):
        assert torch.equal(fields[name][:real], getattr(eager, name)), name
    assert torch.equal(fields["slots"][:2], eager.slots) and torch.equal(fields["starts"][:2], eager.starts)
    pad = slice(real, width * length)
    assert fields["token_ids"][pad].eq(PAD_TOKEN).all() and fields["slot_of_token"][pad].eq(SCRATCH).all()
    assert fields["positions"][pad].tolist() == [PAD_POSITION + j for j in range(length)] * 2
    assert fields["slots"][2:].eq(SCRATCH).all() and fields["starts"][2:].eq(PAD_POSITION).all()
    # padding alone: what a capture runs over
    alone = staged(None, layout, width, K + 1, SCRATCH)
    assert torch.equal(alone[: width * (K + 1)], torch.full((width * (K + 1),), PAD_TOKEN))


def test_a_step_of_verify_rows_builds_its_kept_rows_on_the_device_as_the_mixed_step_does() -> None:
    """Every row a verify row of one length: the rows' index tensors are made by device ops (a
    graph captures them), the values the general path gives (its inputs: each row's first k)."""
    batch = verify_batch([(2, [1, 2, 3, 4], 9), (0, [5, 6, 7, 8], 30), (1, [9, 9, 9, 9], 4)])
    batch.place(CPU)
    rows = VerifyRows.build(batch)
    assert rows is not None and rows.drafts == K
    assert rows.slots.tolist() == [2, 0, 1] and rows.row_of_seq.tolist() == [0, 1, 2]
    assert rows.inputs.tolist() == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert rows_only([1, 4, 4], (False, True, True)) and rows_only([1, 1], ())
    assert not rows_only([5, 1], ()) and not rows_only([4, 4], (True, False))  # a prompt chunk in it


@pytest.fixture(scope="module", params=["tiny-qwen3-next", "tiny-llama"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    m = build_model(builtin_config(request.param))
    init_random(m, seed=0)
    return m


@pytest.mark.parametrize(("n", "bucket", "length"), [(2, 4, K + 1), (1, 1, 2)])
def test_the_padded_static_batch_gives_the_eager_steps_logits_and_states(
    model: torch.nn.Module, n: int, bucket: int, length: int
) -> None:
    """Two verify rows of K drafts in a graph of 4 (two padding rows in the scratch slot, keeping
    their states in workspace rows 2 and 3), and one row of one draft: the real rows' logits,
    kept states and slot states are the plain eager step's."""
    size, slots, ctx = VerifySize(4, K), 3, 64
    prompts = {0: list(range(5, 14)), 2: list(range(40, 47))}
    rows = [(2, [31, 32, 33, 34][:length], len(prompts[2])), (0, [17, 18, 19, 20][:length], len(prompts[0]))][
        :n
    ]

    padded, plain = (prefilled_runner(model, prompts, slots, ctx, size) for _ in range(2))
    keep = any(s.slot_views(0) for s in plain.states)
    graphs = VerifyGraphs(CPU, slots, size.rows, size.drafts, ctx, keep)
    assert (bucket, length) in graphs.keys
    graphs._stage(verify_batch(rows, keep), length)
    got = padded._run(graphs._static_batch(bucket, length))
    want = plain._run(verify_batch(rows, keep))
    assert got.shape[0] == bucket * length and want.shape[0] == n * length
    torch.testing.assert_close(got[: want.shape[0]], want, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(padded.states, plain.states, strict=True):
        if isinstance(mine, RecurrentState) and isinstance(theirs, RecurrentState):
            for a, b in ((mine.recurrent, theirs.recurrent), (mine.conv, theirs.conv)):
                torch.testing.assert_close(a[:slots], b[:slots], rtol=1e-5, atol=1e-5)
            assert theirs.kept_states[:n, : length - 1].abs().sum() > 0  # the eager step kept them
            for a, b in ((mine.kept_states, theirs.kept_states), (mine.kept_inputs, theirs.kept_inputs)):
                torch.testing.assert_close(a[:n], b[:n], rtol=1e-5, atol=1e-5)
    assert keep == any(isinstance(s, RecurrentState) for s in plain.states)


class _Runner:
    """What `graph_runner.capture_verify_graphs` uses of a runner; the capture itself needs CUDA
    (tests/gpu/test_verify_graphs_cuda.py), so it is given: a held byte count or nothing."""

    def __init__(self, held: int | None) -> None:
        self.verify_graphs: VerifyGraphs | None = None
        self.held = held

    def capture_verify_graphs(self) -> int | None:
        if self.held is not None:
            self.verify_graphs = VerifyGraphs(CPU, SCRATCH, 2, K, 64, True)
        return self.held

    def release_verify_graphs(self) -> None:
        self.verify_graphs = None


def test_verify_graphs_are_leased_apart_and_dropped_where_the_ledger_has_no_room() -> None:
    held = 100 * MiB
    watch, runner = ledger_watch(GiB), _Runner(held)
    leases = capture_verify_graphs(runner, watch, [0])  # type: ignore[arg-type]
    assert [(lease.tag, lease.nbytes) for lease in leases] == [("cuda-graphs-verify", held)]
    assert runner.verify_graphs is not None and watch.ledger.held(0) == held
    watch, runner = ledger_watch(50 * MiB), _Runner(held)  # no room: dropped, verify rows run eagerly
    assert capture_verify_graphs(runner, watch, [0]) == []  # type: ignore[arg-type]
    assert runner.verify_graphs is None and watch.ledger.held(0) == 0
    watch, runner = ledger_watch(GiB), _Runner(None)  # no drafting, or no decode graphs: none asked
    assert capture_verify_graphs(runner, watch, [0]) == [] and watch.ledger.held(0) == 0  # type: ignore[arg-type]
