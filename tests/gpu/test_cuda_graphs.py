"""On CUDA: decode steps replayed from captured graphs give the logits an eager forward gives, the
graphs are really used, padding rows disturb no real slot, and the engine's tokens are those of
an engine without graphs. Skips cleanly without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.memory.config import MemoryConfig
from ballast.memory.watch import MemWatch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [
    ("builtin:tiny-llama", "float32"),
    ("builtin:tiny-llama", "bfloat16"),
    ("builtin:tiny-qwen3-next", "bfloat16"),
    ("builtin:tiny-qwen3.5-moe", "bfloat16"),
]
PROMPTS = {0: list(range(5, 40)), 1: list(range(100, 103)), 3: list(range(200, 290))}


def engine(model: str, dtype: str, graphs: bool) -> Engine:
    """compile off: a replay then runs the very kernels of an eager step, so tokens match exactly
    (the compiled pointwise kernels run only in graphs; test_pointwise_cuda checks them)."""
    cfg = EngineConfig(
        compile=False,
        model=model,
        device="cuda",
        dtype=dtype,
        max_num_seqs=4,
        max_model_len=512,
        prefill_chunk_tokens=128,
        cuda_graphs=graphs,
    )
    return Engine.load(cfg)


@pytest.fixture(params=CASES, ids=[f"{m.split(':')[1]}-{d}" for m, d in CASES])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Engine, str]]:
    model, dtype = request.param
    with_graphs, eager = engine(model, dtype, True), engine(model, dtype, False)
    yield with_graphs, eager, dtype
    with_graphs.shutdown()
    eager.shutdown()


def test_replayed_decode_matches_eager(pair: tuple[Engine, Engine, str]) -> None:
    with_graphs, eager, dtype = pair
    graphs = with_graphs.runner.graph_runner.graphs
    assert graphs is not None and graphs.captured == len(graphs.batch_buckets) * len(graphs.context_buckets)
    assert eager.runner.graph_runner.graphs is None
    tol = 1e-4 if dtype == "float32" else 5e-2
    for e in (with_graphs, eager):
        e.runner.reset(list(PROMPTS))
        assert e.runner.kv is not None
        for s, p in PROMPTS.items():  # blocks for the prompt and the 12 decode steps below
            assert e.runner.kv.ensure(s, len(p) + 12)
        e.runner.forward([(s, p, 0) for s, p in PROMPTS.items()])
    pos = {s: len(p) for s, p in PROMPTS.items()}
    token = dict.fromkeys(PROMPTS, 7)
    worst = 0.0
    for step in range(12):
        live = [s for s in PROMPTS if step < 6 or s != 1]  # the batch shrinks from 3 to 2 half way
        seqs = [(s, [token[s]], pos[s]) for s in live]
        before = graphs.replays
        got = with_graphs.runner.forward(seqs).clone()
        want = eager.runner.forward(seqs)
        assert graphs.replays == before + 1
        worst = max(worst, (got - want).abs().max().item())
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)  # identical in practice; bounded here
        for i, s in enumerate(live):  # teacher forcing: both engines are fed the eager choice
            token[s] = int(want[i].argmax())
            pos[s] += 1
    print(f"worst |graph - eager| logit difference: {worst:.2e}")


def test_engine_tokens_equal_with_and_without_graphs(pair: tuple[Engine, Engine, str]) -> None:
    # A replay runs the kernels the eager step runs (observed: identical logits, bf16 included),
    # so greedy tokens are identical too, near-ties and all.
    with_graphs, eager, _ = pair
    greedy = SamplingParams(temperature=0.0)

    def run(e: Engine) -> list[list[int]]:
        sampling = dict.fromkeys(PROMPTS, greedy)
        res = e.step(
            StepPlan(
                prefills=tuple(PrefillChunk(s, tuple(p), 0, True) for s, p in PROMPTS.items()),
                sampling=sampling,
            )
        )
        out = {o.slot: [o.token_id] for o in res.outputs}
        for _ in range(16):
            decodes = tuple(DecodeToken(s, out[s][-1], len(PROMPTS[s]) + len(out[s]) - 1) for s in PROMPTS)
            for o in e.step(StepPlan(decodes=decodes, sampling=sampling)).outputs:
                out[o.slot].append(o.token_id)
        return [out[s] for s in sorted(out)]

    assert run(with_graphs) == run(eager)
    graphs = with_graphs.runner.graph_runner.graphs
    assert graphs is not None and graphs.replays >= 16


def test_steps_with_int8_sequences_replay_their_own_graphs(pair: tuple[Engine, Engine, str]) -> None:
    """Under the ladder's int8 rung a new sequence keeps its KV in the int8 store beside running
    ones in the main store; every layer then visits both stores. Those decode steps replay the
    mixed variant of the graphs (captured at first use), not an eager forward (measured on an
    H200 under a VRAM squeeze: eager steps stalled every stream for a minute), with the tokens of
    the engine without graphs."""
    with_graphs, eager, _ = pair
    greedy = SamplingParams(temperature=0.0)

    def run(e: Engine) -> list[list[int]]:
        sampling = dict.fromkeys(PROMPTS, greedy)
        prefills = tuple(PrefillChunk(s, tuple(p), 0, True, int8_kv=s == 1) for s, p in PROMPTS.items())
        out = {o.slot: [o.token_id] for o in e.step(StepPlan(prefills=prefills, sampling=sampling)).outputs}
        for _ in range(12):
            decodes = tuple(DecodeToken(s, out[s][-1], len(PROMPTS[s]) + len(out[s]) - 1) for s in PROMPTS)
            for o in e.step(StepPlan(decodes=decodes, sampling=sampling)).outputs:
                out[o.slot].append(o.token_id)
        e.step(StepPlan(release=tuple(PROMPTS)))
        return [out[s] for s in sorted(out)]

    graphs = with_graphs.runner.graph_runner.graphs
    assert graphs is not None and with_graphs.runner.kv_int8 is not None
    before = graphs.replays
    assert run(with_graphs) == run(eager)
    assert graphs.replays >= before + 12
    assert any(mixed for _, _, mixed in graphs._graphs)  # the int8 store was in use: its variant


def test_the_int8_variant_is_captured_under_the_ledger() -> None:
    """A late capture asks the memory layer first and then holds what the graphs' pool grew by
    (tag cuda-graphs-int8); shutdown gives it back with the rest."""
    cfg = EngineConfig(
        model="builtin:tiny-llama", device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=512
    )
    with MemWatch(MemoryConfig()) as watch:
        e = Engine.load(cfg, watch)
        die = torch.cuda.current_device()
        try:
            graphs = e.runner.graph_runner.graphs
            assert graphs is not None and graphs.acquire is not None
            plain = graphs.held_bytes
            greedy = SamplingParams(temperature=0.0)
            prefills = tuple(PrefillChunk(s, tuple(p), 0, True, int8_kv=s == 1) for s, p in PROMPTS.items())
            res = e.step(StepPlan(prefills=prefills, sampling=dict.fromkeys(PROMPTS, greedy)))
            out = {o.slot: o.token_id for o in res.outputs}
            decodes = tuple(DecodeToken(s, out[s], len(PROMPTS[s])) for s in PROMPTS)
            e.step(StepPlan(decodes=decodes, sampling=dict.fromkeys(PROMPTS, greedy)))
            assert any(mixed for _, _, mixed in graphs._graphs)
            late = sum(n for tag, n in watch.ledger.leases(die) if tag == "cuda-graphs-int8")
            assert late == graphs.held_bytes - plain  # what the pool grew by, no more, no less
        finally:
            e.shutdown()
        assert not any(tag.startswith("cuda-graphs") for tag, _ in watch.ledger.leases(die))
