"""On CUDA with the MTP drafter: decode and verify steps replay graphs (their counters rise), each
replay hands back the hidden states the drafter reads as the eager step leaves them (compile off:
the same kernels, within float rounding where padding rows make products taller), so the drafts after replayed
steps are those after eager ones, and greedy text with MTP drafts is the text without.
tiny-qwen3-next with its MTP layer, float32: one engine with graphs and one without. Skips
without CUDA."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.engine.workspace import VerifySize
from ballast.models.base import StepBatch
from ballast.scheduler.request import GenerationRequest
from engine_steps import graphs_and_eager, serve_drafting

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MODEL = "builtin:tiny-qwen3-next"
K = 3
MTP = f'{{"method": "mtp", "num_speculative_tokens": {K}}}'
GREEDY = SamplingParams(temperature=0.0)


def load(graphs: bool) -> Engine:
    from ballast.bench.checkpoint_dir import write_tokenizer

    tok = Path(tempfile.mkdtemp(prefix="mtp-tok-"))  # the device machine cannot fetch one
    write_tokenizer(tok)
    cfg = EngineConfig(
        compile=False,  # a replay then runs the very kernels of an eager step
        model=MODEL,
        tokenizer=str(tok),
        device="cuda",
        dtype="float32",
        max_num_seqs=4,
        max_model_len=256,
        prefill_chunk_tokens=128,
        cuda_graphs=graphs,
    )
    return Engine.load(cfg, mtp_drafts=K, verify=VerifySize(4, K))


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[Engine, Engine]]:
    yield from graphs_and_eager(load)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_graphs_are_captured_with_mtp(engines: tuple[Engine, Engine]) -> None:
    with_graphs, eager = engines
    runner = with_graphs.runner.graph_runner
    assert runner.graphs is not None and runner.graphs.captured > 0 and runner.graphs.leftover is not None
    assert runner.verify_graphs is not None and runner.verify_graphs.captured > 0
    assert eager.runner.graph_runner.graphs is None


@pytest.mark.parametrize("kind", ["decode", "verify"])
@pytest.mark.parametrize("n", [2, 3])
def test_a_replayed_step_hands_back_the_eager_steps_hidden_states(
    engines: tuple[Engine, Engine], kind: str, n: int
) -> None:
    """n sequences' decode tokens, or verify rows of K drafts, on both engines after the same
    prompts: the replayed step's `last_hidden` is the eager step's (3 rows pad a bucket of 4)."""
    length, slots = (1 if kind == "decode" else K + 1), list(range(n))
    prompts = {s: prompt(9 + 5 * s, s) for s in slots}
    rows = [(s, prompt(length, 100 + s), len(p)) for s, p in prompts.items()]
    hidden = []
    for engine in engines:
        runner = engine.runner
        assert runner.kv is not None
        runner.reset(slots)
        for s, p in prompts.items():
            assert runner.kv.ensure(s, len(p) + length)
        runner.forward([(s, p, 0) for s, p in prompts.items()])
        batch = StepBatch.of(rows, all_logits=(True,) * n if kind == "verify" else ())
        batch.verify = (True,) * n if kind == "verify" else ()
        graphs = runner.graph_runner.graphs if kind == "decode" else runner.graph_runner.verify_graphs
        replays = graphs.replays if graphs is not None else 0
        runner.forward(batch)
        assert graphs is None or graphs.replays == replays + 1
        last = getattr(runner.model, "last_hidden", None)
        assert last is not None and last.shape[0] == n * length
        hidden.append(last.clone())
        for s in slots:  # the blocks back: the tests below serve through the engine's own plans
            runner.kv.release(s)
    replayed, eager = hidden
    print(f"{kind} n={n}: worst |replayed - eager| hidden {(replayed - eager).abs().max():.2e}")
    torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-4)  # identical in practice


def test_the_drafts_after_replayed_steps_are_the_eager_steps(engines: tuple[Engine, Engine]) -> None:
    """Through the engine's plans: two prompts, two decode steps, a verify step of each one's
    drafts, a decode step: each step's tokens and MTP proposals are the eager engine's."""
    prompts = {1: prompt(14, 7), 2: prompt(9, 8)}
    runs = []

    def replays(engine: Engine) -> tuple[int, int]:
        g = engine.runner.graph_runner
        return (g.graphs.replays if g.graphs else 0, g.verify_graphs.replays if g.verify_graphs else 0)

    for engine in engines:
        before = replays(engine)
        seqs = {s: list(p) for s, p in prompts.items()}
        chunks = tuple(PrefillChunk(s, tuple(p), 0, True) for s, p in prompts.items())
        sampling = {s: GREEDY for s in prompts}
        res = engine.step(StepPlan(prefills=chunks, sampling=sampling, release=tuple(prompts)))
        steps = []
        for drafting in (False, False, True, False):
            for o in res.outputs:
                seqs[o.slot].append(o.token_id)
            proposals = {s: d for s, _, d in res.proposals}
            steps.append(([(o.slot, o.token_id) for o in res.outputs], proposals))
            decodes = tuple(
                DecodeToken(s, seq[-1], len(seq) - 1, proposals[s] if drafting else ())
                for s, seq in seqs.items()
            )
            res = engine.step(StepPlan(decodes=decodes, sampling=sampling))
        steps.append(([(o.slot, o.token_id) for o in res.outputs], {s: d for s, _, d in res.proposals}))
        runs.append((steps, before, replays(engine)))
    (replayed, before, after), (eager, _, _) = runs
    assert all(len(p[1]) == 2 and all(len(d) == K for d in p[1].values()) for p in replayed)
    assert replayed == eager
    assert after[0] - before[0] == 3 and after[1] - before[1] == 1  # 3 decode steps, 1 verify step


def test_greedy_text_with_mtp_drafts_is_the_text_without_and_decodes_replay(
    engines: tuple[Engine, Engine],
) -> None:
    engine = engines[0]
    graphs = engine.runner.graph_runner.graphs
    assert graphs is not None
    reqs = [GenerationRequest(f"r{i}", tuple(prompt(20 + 7 * i, i)), GREEDY, max_tokens=32) for i in range(2)]

    off, _ = serve_drafting(engine, reqs, None)
    replays = graphs.replays
    on, stats = serve_drafting(engine, reqs, MTP, tried=True)
    assert on == off and stats.drafted > 0
    assert graphs.replays > replays  # decode steps with MTP on replay graphs
