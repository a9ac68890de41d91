"""Prefill graphs' host side (the capture and replay themselves are in tests/gpu): which sizes are
captured, when the engine asks for them, how a prompt is laid into the static inputs a graph
reads (its real rows exactly as an eager step's batch has them, padding rows at the scratch
slot's padding position), and how their memory is leased from a real VRAM ledger."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.config import PREFILL_GRAPH_TOKENS, EngineConfig
from ballast.engine.graphs.decode import PAD_POSITION, PAD_TOKEN, GraphCaptureError
from ballast.engine.graphs.graph_runner import capture_prefill_graphs
from ballast.engine.graphs.prefill import GRANULE, PrefillGraphs, token_buckets
from ballast.memory.types import GiB, MiB
from ballast.models.base import ForwardBatch
from memfixtures import ledger_watch

SCRATCH = 4


def test_token_buckets() -> None:
    assert token_buckets(512) == (128, 256, 384, 512)
    assert token_buckets(600) == (128, 256, 384, 512)  # rounded down to a granule
    assert token_buckets(100) == ()
    assert token_buckets(64, granule=32) == (32, 64)
    with pytest.raises(ValueError):
        token_buckets(64, granule=0)
    with pytest.raises(GraphCaptureError):
        PrefillGraphs(torch.device("cpu"), SCRATCH, GRANULE - 1)


def test_engine_asks_for_prefill_graphs_on_one_gpu_up_to_the_chunk() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    base = EngineConfig(model="builtin:tiny-llama", max_model_len=8192)
    assert base.prefill_graph_tokens(cuda) == PREFILL_GRAPH_TOKENS == 2048
    assert base.prefill_graph_tokens(cpu) == 0
    cfg = EngineConfig(model="builtin:tiny-llama", max_model_len=8192, prefill_chunk_tokens=512)
    assert cfg.prefill_graph_tokens(cuda) == 512
    for off in (
        EngineConfig(model="builtin:tiny-llama", prefill_graphs=False),
        EngineConfig(model="builtin:tiny-llama", cuda_graphs=False),
        EngineConfig(model="builtin:tiny-llama", tensor_parallel_size=2),
    ):
        assert off.prefill_graph_tokens(cuda) == 0


@pytest.mark.parametrize(("n", "start"), [(2, 0), (127, 0), (128, 0), (129, 40), (300, 1000)])
def test_a_prompt_is_staged_as_its_eager_batch_plus_padding(n: int, start: int) -> None:
    graphs = PrefillGraphs(torch.device("cpu"), SCRATCH, 512)
    tokens = torch.randint(0, 1000, (n,)).tolist()
    bucket = next(b for b in graphs.buckets if b >= n)
    graphs._stage(2, tokens, start, bucket)
    staged = graphs._static_batch(bucket)
    eager = ForwardBatch.build([(2, tokens, start)], "cpu")
    assert staged.num_tokens == bucket and staged.max_len == bucket and not staged.decode_only
    for field in ("token_ids", "positions", "slot_of_token"):
        real, pad = getattr(staged, field)[:n], getattr(staged, field)[n:]
        assert torch.equal(real, getattr(eager, field)), field
        assert torch.equal(
            pad, torch.full_like(pad, {"token_ids": PAD_TOKEN, "positions": PAD_POSITION}.get(field, SCRATCH))
        )
    for field in ("slots", "starts", "lens", "cu_lens", "logit_index"):
        assert torch.equal(getattr(staged, field), getattr(eager, field)), field
    # a shorter prompt staged next leaves nothing of this one in its rows
    graphs._stage(3, [9, 9], 0, bucket)
    again = graphs._static_batch(bucket)
    assert again.token_ids[2:].eq(PAD_TOKEN).all() and again.slot_of_token[2:].eq(SCRATCH).all()
    assert again.lens.tolist() == [2] and again.logit_index.tolist() == [1] and again.slots.tolist() == [3]


def test_nothing_is_served_before_a_capture() -> None:
    graphs = PrefillGraphs(torch.device("cpu"), SCRATCH, 512)
    assert graphs.captured == 0 and graphs.bucket_of(100) is None
    assert not graphs.can_use([(0, list(range(100)), 0)])


class _Runner:
    """What `startup.capture_prefill_graphs` uses of a runner; the capture itself needs CUDA
    (tests/gpu/test_prefill_graphs_cuda.py), so it is given: a held byte count or an error."""

    def __init__(self, held: int | None, error: str | None = None, decode_graphs: bool = True) -> None:
        self.graphs = object() if decode_graphs else None
        self.prefill_graphs: PrefillGraphs | None = None
        self.held, self.error, self.asked = held, error, 0

    def capture_prefill_graphs(self, max_tokens: int) -> int | None:
        self.asked += 1
        if self.error:
            raise GraphCaptureError(self.error)
        if self.held is not None:
            self.prefill_graphs = PrefillGraphs(torch.device("cpu"), SCRATCH, max_tokens)
        return self.held

    def release_prefill_graphs(self) -> None:
        self.prefill_graphs = None


def test_prefill_graphs_are_leased_apart_and_dropped_where_the_ledger_has_no_room() -> None:
    held = 200 * MiB
    watch, runner = ledger_watch(1024 * MiB), _Runner(held)
    leases = capture_prefill_graphs(runner, watch, [0], 2048)  # type: ignore[arg-type]
    assert [(lease.tag, lease.nbytes) for lease in leases] == [("cuda-graphs-prefill", held)]
    assert runner.prefill_graphs is not None and watch.ledger.held(0) == held
    # no room: the graphs go (prefill runs eagerly), nothing stays leased
    watch, runner = ledger_watch(100 * MiB), _Runner(held)
    assert capture_prefill_graphs(runner, watch, [0], 2048) == []  # type: ignore[arg-type]
    assert runner.prefill_graphs is None and watch.ledger.held(0) == 0


def test_no_prefill_graphs_where_they_are_not_asked_for_or_cannot_be_had() -> None:
    for runner, max_tokens in (
        (_Runner(MiB), 0),  # --prefill-graphs false, the CPU, tensor parallel
        (_Runner(MiB, decode_graphs=False), 2048),  # the decode graphs failed: no scratch slot block
    ):
        assert capture_prefill_graphs(runner, ledger_watch(GiB), [0], max_tokens) == []  # type: ignore[arg-type]
        assert runner.asked == 0 and runner.prefill_graphs is None
    for runner in (_Runner(None), _Runner(MiB, error="capture failed")):  # a hybrid model; a failure
        watch = ledger_watch(GiB)
        assert capture_prefill_graphs(runner, watch, [0], 2048) == []  # type: ignore[arg-type]
        assert runner.asked == 1 and runner.prefill_graphs is None and watch.ledger.held(0) == 0
