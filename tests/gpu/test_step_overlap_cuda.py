"""On CUDA: decode graphs cover every batch up to max_num_seqs (128 here, and 100 padded to it),
a step no graph can serve (several prompt chunks beside decodes) runs eagerly, launching a graph
decode step waits for nothing on the device (every sampling option on), and overlapped steps give
the tokens of steps run one at a time. Skips cleanly without CUDA."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import LAST_SAMPLED, DecodeToken, PrefillChunk, SamplingParams, StepPlan
from engine_steps import graphs_and_eager

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SLOTS = 128
PROMPT = 6
GREEDY = SamplingParams(temperature=0.0)
EVERY_OPTION = SamplingParams(
    temperature=0.9,
    top_k=40,
    top_p=0.9,
    min_p=0.05,
    seed=123,
    repetition_penalty=1.2,
    frequency_penalty=0.3,
    presence_penalty=0.3,
    logprobs=3,
    logit_bias=((5, 2.0), (6, -100.0)),
)


def load(graphs: bool) -> Engine:
    cfg = EngineConfig(
        model="builtin:tiny-llama",
        device="cuda",
        dtype="float32",
        max_num_seqs=SLOTS,
        max_model_len=256,
        prefill_chunk_tokens=256,
        cuda_graphs=graphs,
    )
    return Engine.load(cfg)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    yield from graphs_and_eager(load)


def prompt(slot: int) -> tuple[int, ...]:
    return tuple(100 + 7 * slot + i for i in range(PROMPT))


def prefill(engine: Engine, slots: list[int], params: SamplingParams = GREEDY) -> dict[int, int]:
    """Prefill the slots' prompts in chunks of 32 sequences; the first token of each."""
    first: dict[int, int] = {}
    for i in range(0, len(slots), 32):
        group = slots[i : i + 32]
        plan = StepPlan(
            prefills=tuple(PrefillChunk(s, prompt(s), 0, True) for s in group),
            sampling=dict.fromkeys(group, params),
        )
        first.update({o.slot: o.token_id for o in engine.step(plan).outputs})
    return first


def decode(
    engine: Engine, last: dict[int, int], step: int, params: SamplingParams = GREEDY
) -> dict[int, int]:
    plan = StepPlan(
        decodes=tuple(DecodeToken(s, t, PROMPT + step) for s, t in last.items()),
        sampling=dict.fromkeys(last, params),
    )
    return {o.slot: o.token_id for o in engine.step(plan).outputs}


def release(engine: Engine, slots: list[int]) -> None:
    engine.step(StepPlan(release=tuple(slots)))


@pytest.mark.parametrize("batch", [SLOTS, 100])
def test_a_decode_of_every_batch_up_to_max_num_seqs_replays_a_graph(
    engines: tuple[Engine, Engine], batch: int
) -> None:
    with_graphs, eager = engines
    graphs = with_graphs.runner.graph_runner.graphs
    assert graphs is not None and graphs.batch_buckets[-1] == SLOTS
    assert all((SLOTS, c) in graphs.pairs for c in graphs.context_buckets)
    slots = list(range(batch))
    tokens = []
    for engine in (with_graphs, eager):
        last = prefill(engine, slots)
        replays = graphs.replays
        out = [last]
        for step in range(3):
            out.append(decode(engine, out[-1], step))
        if engine is with_graphs:
            assert graphs.replays == replays + 3  # 100 rides the 128 graph, padded
        tokens.append(out)
        release(engine, slots)
    assert tokens[0] == tokens[1]


def test_a_step_no_graph_can_serve_runs_eagerly(engines: tuple[Engine, Engine]) -> None:
    """Two prompt chunks beside a decode replay no graph: a decode graph takes one token per
    sequence, a prefill graph one prompt chunk alone, and the two-graph replay one prompt chunk
    beside decodes (where the times measured at capture say it pays, a lone prompt beside decodes
    replays both: `tests/gpu/test_prefill_graphs_cuda.py`). Such steps are not captured: their
    shape changes with every chunk, and a step carrying prompt chunks is bound by its matrix
    products, not by kernel launches. The step's tokens are the eager engine's."""
    with_graphs, eager = engines
    runner = with_graphs.runner
    graphs, prefill_graphs = runner.graph_runner.graphs, runner.graph_runner.prefill_graphs
    assert graphs is not None and prefill_graphs is not None  # both kinds captured: neither serves it
    tokens = []
    for engine in (with_graphs, eager):
        last = prefill(engine, [0])
        replays = (graphs.replays, prefill_graphs.replays, runner.graph_runner.split_replays)
        plan = StepPlan(
            prefills=(PrefillChunk(1, prompt(1), 0, True), PrefillChunk(2, prompt(2), 0, True)),
            decodes=(DecodeToken(0, last[0], PROMPT),),
            sampling={0: GREEDY, 1: GREEDY, 2: GREEDY},
        )
        out = {o.slot: o.token_id for o in engine.step(plan).outputs}
        assert set(out) == {0, 1, 2}
        if engine is with_graphs:
            assert (graphs.replays, prefill_graphs.replays, runner.graph_runner.split_replays) == replays
        tokens.append((last[0], out))
        release(engine, [0, 1, 2])
    assert tokens[0] == tokens[1]


def test_launching_a_graph_decode_step_waits_for_nothing(engines: tuple[Engine, Engine]) -> None:
    """With CUDA's sync debug mode set to error, any host wait in the launch half of a step
    (a blocking copy, .item(), .tolist(), nonzero) raises; finishing it is the one wait."""
    engine, _ = engines
    graphs = engine.runner.graph_runner.graphs
    assert graphs is not None
    slots = list(range(8))
    prefill(engine, slots, EVERY_OPTION)
    plans = [
        StepPlan(
            decodes=tuple(DecodeToken(s, LAST_SAMPLED, PROMPT + step) for s in slots),
            sampling=dict.fromkeys(slots, EVERY_OPTION),
        )
        for step in range(3)
    ]
    engine.step(plans[0])  # block tables grown, pinned buffers cached
    replays = graphs.replays
    for plan in plans[1:]:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            launched = engine.launch(plan)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        result = engine.finish(launched)
        assert len(result.outputs) == len(slots) and all(len(o.top_logprobs) == 3 for o in result.outputs)
    assert graphs.replays == replays + 2
    release(engine, slots)


def test_overlapped_steps_give_the_tokens_of_steps_run_one_at_a_time(engines: tuple[Engine, Engine]) -> None:
    engine, _ = engines
    slots = [0, 5, 9]
    steps = 12
    last = prefill(engine, slots, EVERY_OPTION)
    calm = [last]
    for step in range(steps):
        calm.append(decode(engine, calm[-1], step, EVERY_OPTION))
    release(engine, slots)

    first = prefill(engine, slots, EVERY_OPTION)
    gate = threading.Event()
    engine._executor.submit(gate.wait)  # every plan queued before the engine thread takes one
    before = engine.overlapped_steps
    futures = [
        engine.submit(
            StepPlan(
                decodes=tuple(DecodeToken(s, LAST_SAMPLED, PROMPT + step) for s in slots),
                sampling=dict.fromkeys(slots, EVERY_OPTION),
            )
        )
        for step in range(steps)
    ]
    gate.set()
    ahead = [first] + [{o.slot: o.token_id for o in f.result(timeout=120).outputs} for f in futures]
    release(engine, slots)
    assert ahead == calm
    assert engine.overlapped_steps - before == steps - 1
