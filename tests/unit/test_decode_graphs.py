"""The decode-graph plumbing that does not need CUDA: buckets, when a graph may serve a step, and
the static padded batch a graph is captured with. The last is checked by running a real model
on CPU: rows padded into a scratch slot must leave the real rows' logits and every real slot's
state exactly as the plain batch does. (Capture and replay themselves: tests/gpu.)"""

from __future__ import annotations

import pytest
import torch
from ballast.engine.graphs.decode import (
    DecodeGraphs,
    GraphCaptureError,
    bucket_for,
    bucket_pairs,
    doubling_buckets,
)
from ballast.engine.runner.model_runner import ModelRunner, planned_state_bytes
from ballast.models.arch.builtin import builtin_config, init_random
from ballast.models.arch.registry import build_model
from ballast.models.base import ForwardBatch
from ballast.models.layers.state import LayerState, PagedKV, allocate_states
from test_state import read_kv

CPU = torch.device("cpu")


def test_buckets_double_up_to_the_limit() -> None:
    assert doubling_buckets(1, 8) == (1, 2, 4, 8)
    assert doubling_buckets(1, 6) == (1, 2, 4, 6)
    assert doubling_buckets(256, 2048) == (256, 512, 1024, 2048)
    assert doubling_buckets(256, 100) == (100,)
    assert doubling_buckets(1, 1) == (1,)
    with pytest.raises(ValueError):
        doubling_buckets(1, 0)
    assert bucket_for((1, 2, 4, 6), 3) == 4 and bucket_for((1, 2, 4, 6), 6) == 6
    assert bucket_for((1, 2, 4, 6), 7) is None


def test_bucket_pairs_largest_first_within_the_read_budget() -> None:
    pairs = bucket_pairs((1, 2, 4), (256, 512), read_bytes_per_position=10, budget_bytes=10 * 1024)
    assert pairs == ((4, 256), (2, 512), (2, 256), (1, 512), (1, 256))  # (4, 512) reads 2048 positions
    assert bucket_pairs((1, 2), (256,), 0, 0) == ((2, 256), (1, 256))  # nothing read: all of them
    assert bucket_pairs((1,), (256,), 10, 100) == ()


def test_a_graph_serves_only_decode_steps_of_a_captured_bucket() -> None:
    graphs = DecodeGraphs(CPU, scratch_slot=4, max_batch=4, max_context=512)
    assert len(graphs.pairs) == 6
    decode = [(0, [5], 10), (2, [7], 300)]  # 2 sequences, 301 positions: the (2, 512) bucket
    assert not graphs.can_use(decode)  # nothing captured yet
    graphs._graphs[(2, 512, False)] = None  # type: ignore[assignment]  # stands for a capture
    assert graphs.can_use(decode)
    assert not graphs.can_use([(0, [5], 10)])  # (1, 256): not captured
    assert not graphs.can_use([(0, [5, 6], 10), (1, [6], 10)])  # a prefill chunk
    assert not graphs.can_use([(0, [5], 511), (1, [6], 512)])  # reads 513 positions
    assert not graphs.can_use([(s, [5], 3) for s in range(5)])  # more sequences than slots
    assert not graphs.can_use([])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next", "tiny-qwen3.5-moe"])
def test_padded_static_batch_gives_the_plain_batch_logits_and_states(name: str) -> None:
    model = build_model(builtin_config(name))
    init_random(model, seed=0)
    slots, scratch, ctx = 3, 3, 64
    padded_states, states = (
        allocate_states(model.layer_specs(4), slots + 1, ctx, CPU, torch.float32) for _ in range(2)
    )
    decode = [(2, [31], 4), (0, [17], 7)]
    with torch.inference_mode():
        for st in (padded_states, states):
            model(ForwardBatch.build([(0, list(range(5, 12)), 0), (2, list(range(20, 24)), 0)], CPU), st)
        graphs = DecodeGraphs(CPU, scratch_slot=scratch, max_batch=4, max_context=ctx)
        graphs._stage(decode, 4)
        padded = model(graphs._static_batch(4, ctx), padded_states)
        plain = model(ForwardBatch.build(decode, CPU, max_ctx=ctx), states)
    torch.testing.assert_close(padded[:2], plain, rtol=1e-5, atol=1e-5)
    real = ForwardBatch.build([(s, [0] * ctx, 0) for s in range(slots)], CPU)
    for mine, theirs in zip(padded_states, states, strict=True):
        if isinstance(mine, PagedKV) and isinstance(theirs, PagedKV):  # every real slot's KV, all positions
            for a, b in zip(read_kv(mine, real), read_kv(theirs, real), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        for a, b in zip(mine.slot_views(0) and _tensors(mine), _tensors(theirs), strict=True):
            torch.testing.assert_close(a[:scratch], b[:scratch], rtol=1e-5, atol=1e-5)  # real slots only


def _tensors(state: LayerState) -> list[torch.Tensor]:
    """The state's per-slot tensors (a recurrent state's verify workspace, `kept_*`, is per row)."""
    items = sorted(vars(state).items())
    return [v for k, v in items if isinstance(v, torch.Tensor) and not k.startswith("kept_")]


@pytest.mark.parametrize("scratch", [False, True])
def test_the_scratch_slot_is_allocated_and_planned_alike(scratch: bool) -> None:
    """The ledger is asked for what the runner allocates, scratch slot included (the slot
    graphs pad into is memory like any other)."""
    model = build_model(builtin_config("tiny-qwen3-next"))
    init_random(model, seed=0)
    runner = ModelRunner(
        model,
        CPU,
        torch.float32,
        num_slots=3,
        max_model_len=32,
        quantized_kv=False,
        seed=0,
        scratch_slot=scratch,
    )
    assert all(t.shape[0] == 3 + scratch for s in runner.states for t in _tensors(s))
    assert runner.kv is not None and runner.kv.layout.table_rows == 3 + scratch
    assert runner.state_bytes == planned_state_bytes(model, torch.float32, 3, scratch_slot=scratch)
    assert runner.graph_runner.graphs is None
    with pytest.raises(GraphCaptureError, match="CUDA"):  # graphs are captured on CUDA only
        runner.graph_runner.capture_graphs()
