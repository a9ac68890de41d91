"""On CUDA: a verify step (every row a decode and its k drafts) replayed from a captured graph gives
the logits, kept per-position states and slot states the eager verify step gives, bit for bit where
the batch fills its bucket (the same kernels on the same shapes; compile off, as test_cuda_graphs)
and within float rounding where padding rows make the matrix products taller; the graphs are
really used (their replay counter), leased under the ledger (tag cuda-graphs-verify), and a draft
rejected after a replayed step leaves the slot the states of the run that never drafted. Tiny
models, one engine each. Skips without CUDA."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.engine.runner.model_runner import ModelRunner
from ballast.engine.workspace import VerifySize
from ballast.memory.config import MemoryConfig
from ballast.memory.watch import MemWatch
from ballast.models.base import StepBatch
from ballast.models.layers.state import RecurrentState

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CASES = [("tiny-qwen3-next", "float32"), ("tiny-qwen3-next", "bfloat16"), ("tiny-llama", "float32")]
K = 3  # drafts a row: the graphs' rows are K + 1 tokens
ROWS = 4  # verify rows the engine keeps states for: buckets 1, 2, 4
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{d}" for m, d in CASES])
def loaded(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, MemWatch, str]]:
    model, dtype = request.param
    with MemWatch(MemoryConfig()) as watch:
        cfg = EngineConfig(
            compile=False,  # a replay then runs the very kernels of an eager step
            model=f"builtin:{model}",
            device="cuda",
            dtype=dtype,
            max_num_seqs=ROWS + 1,
            max_model_len=256,
            prefill_chunk_tokens=128,
        )
        engine = Engine.load(cfg, watch, verify=VerifySize(ROWS, K))
        yield engine, watch, dtype
        engine.shutdown()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def keeps(runner: ModelRunner) -> bool:
    return any(s.slot_views(0) for s in runner.states)


def verify_batch(rows: list[tuple[int, list[int], int]], keep: bool) -> StepBatch:
    batch = StepBatch.of(rows, all_logits=(True,) * len(rows))
    batch.verify = (True,) * len(rows) if keep else ()
    return batch


def snapshot(runner: ModelRunner, slots: list[int]) -> dict[int, list[tuple[torch.Tensor, ...]]]:
    """Each slot's per-layer state tensors, copied."""
    return {s: [tuple(t.clone() for t in st.slot_views(s)) for st in runner.states] for s in slots}


def restore(runner: ModelRunner, saved: dict[int, list[tuple[torch.Tensor, ...]]]) -> None:
    for s, per_layer in saved.items():
        for st, tensors in zip(runner.states, per_layer, strict=True):
            if tensors:
                st.load(s, tensors)


def flat(saved: dict[int, list[tuple[torch.Tensor, ...]]]) -> list[torch.Tensor]:
    return [t for per_layer in saved.values() for tensors in per_layer for t in tensors]


def kept(runner: ModelRunner, n: int) -> list[torch.Tensor]:
    return [
        t[:n].clone()
        for s in runner.states
        if isinstance(s, RecurrentState)
        for t in (s.kept_states, s.kept_inputs)
    ]


def test_captured_at_start_and_leased(loaded: tuple[Engine, MemWatch, str]) -> None:
    engine, watch, _ = loaded
    graphs = engine.runner.graph_runner.verify_graphs
    assert graphs is not None and graphs.buckets == (1, 2, 4) and graphs.length == K + 1
    assert graphs.captured == len(graphs.keys) == 5  # one row of 1, 2 or 3 drafts; 2 and 4 rows of 3
    assert graphs.keep == keeps(engine.runner)
    held = dict(watch.ledger.leases(torch.cuda.current_device()))
    assert graphs.held_bytes > 0 and held["cuda-graphs-verify"] == graphs.held_bytes


@pytest.mark.parametrize(("n", "drafts"), [(1, K), (2, K), (3, K), (4, K), (1, 1)])
def test_a_replayed_verify_step_gives_the_eager_steps_logits_and_states(
    loaded: tuple[Engine, MemWatch, str], n: int, drafts: int
) -> None:
    engine, _, dtype = loaded
    runner = engine.runner
    graphs = runner.graph_runner.verify_graphs
    assert graphs is not None and runner.kv is not None
    slots, keep = list(range(n)), keeps(runner)
    prompts = {s: prompt(9 + 5 * s, s) for s in slots}
    runner.reset(slots)
    for s, p in prompts.items():
        assert runner.kv.ensure(s, len(p) + drafts + 1)
    runner.forward([(s, p, 0) for s, p in prompts.items()])
    rows = [(s, [7 + s, *prompt(drafts, 100 + s)], len(p)) for s, p in prompts.items()]
    before = snapshot(runner, slots)
    replays = graphs.replays
    got = runner.forward(verify_batch(rows, keep)).clone()
    assert graphs.replays == replays + 1 and got.shape[0] == n * (drafts + 1)
    got_states, got_kept = flat(snapshot(runner, slots)), kept(runner, n)
    restore(runner, before)  # the states before the step, then the same step eagerly
    want = runner._eager(verify_batch(rows, keep))
    want_states, want_kept = flat(snapshot(runner, slots)), kept(runner, n)
    assert not keep or (got_kept and all(t.abs().sum() > 0 for t in want_kept))
    if n in graphs.buckets:  # the same kernels on the same shapes
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(got_states, want_states, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got_kept, want_kept, strict=True))
        return
    tol = 1e-4 if dtype == "float32" else 5e-2  # padding rows: taller matrix products
    print(f"n={n} in a bucket of {graphs.buckets[-1]}: worst |replay - eager| {(got - want).abs().max():.2e}")
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    for a, b in zip([*got_states, *got_kept], [*want_states, *want_kept], strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize(("drafts", "accepted"), [(K, 0), (K, 2), (K, K), (2, 1)])
def test_a_draft_rejected_after_a_replayed_step_leaves_the_plain_runs_states(
    loaded: tuple[Engine, MemWatch, str], drafts: int, accepted: int
) -> None:
    """Through the engine's plans (the executor's verdict and rollback): the same tokens as the
    plain decode steps, and the slot's states theirs (a hybrid's: the state its replayed step kept
    after the last accepted position, copied back)."""
    engine, _, dtype = loaded
    if dtype != "float32":  # a verify row's kernels round unlike a decode step's: bf16 ties
        pytest.skip("greedy identity with the plain run is held in float32")
    slot, p = 1, prompt(12, 7)
    graphs = engine.runner.graph_runner.verify_graphs
    assert graphs is not None

    def step(plan: StepPlan) -> list[int]:
        return [o.token_id for o in engine.submit(plan).result(timeout=120).outputs]

    def start() -> int:
        chunk = PrefillChunk(slot, tuple(p), 0, True)
        return step(StepPlan(prefills=(chunk,), sampling={slot: GREEDY}, release=(slot,)))[0]

    def states() -> list[torch.Tensor]:
        return [t.clone() for s in engine.runner.states for t in s.slot_views(slot)]

    want, after = [start()], []
    for i in range(drafts + 1):
        want += step(StepPlan(decodes=(DecodeToken(slot, want[-1], len(p) + i),), sampling={slot: GREEDY}))
        after.append(states())
    draft = list(want[1 : 1 + drafts])
    if accepted < drafts:
        draft[accepted] = (draft[accepted] + 1) % 250
    first, replays = start(), graphs.replays
    got = step(StepPlan(decodes=(DecodeToken(slot, first, len(p), tuple(draft)),), sampling={slot: GREEDY}))
    assert graphs.replays == replays + 1
    assert got == want[1 : accepted + 2]
    for ours, theirs in zip(states(), after[accepted], strict=True):  # the plain run: decode kernels
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    recurrent = [s for s in engine.runner.states if isinstance(s, RecurrentState)]
    if accepted < drafts:  # the state the replayed step kept after its last accepted position
        assert all(torch.equal(s.recurrent[slot], s.kept_states[0, accepted]) for s in recurrent)
