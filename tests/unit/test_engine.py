"""The Engine on the built-in tiny Llama (random init, CPU, float32): batching invariance, mixed
prefill + decode steps, chunked prefill, releases, capacity, failures, seeds, quantized KV."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import (
    DecodeToken,
    EngineUnhealthy,
    PlanError,
    PrefillChunk,
    SamplingParams,
    StepFailed,
    StepPlan,
    StepResult,
)
from ballast.engine.runner.loading import ModelLoadRefused, ModelSpecError, resolve
from ballast.engine.runner.model_runner import planned_state_bytes
from ballast.memory.config import MemoryConfig
from ballast.memory.device import StaticDeviceReader
from ballast.memory.types import GiB, MiB
from ballast.memory.watch import MemWatch
from ballast.models.base import UnsupportedModel
from memfixtures import limited_grants, write_tree

from ballast.settings import ConfigError

GREEDY = SamplingParams(temperature=0.0)
MAX_LEN = 48


def config(**kw: object) -> EngineConfig:
    base: dict[str, object] = {
        "model": "builtin:tiny-llama",
        "device": "cpu",
        "max_num_seqs": 4,
        "max_model_len": MAX_LEN,
        "prefill_chunk_tokens": 16,
    }
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.load(config())
    yield eng
    eng.shutdown()


def run(engine: Engine, plan: StepPlan) -> StepResult:
    return engine.submit(plan).result(timeout=60)


def prompt(seed: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def generate_alone(
    engine: Engine, slot: int, ids: tuple[int, ...], steps: int, chunk: int | None = None
) -> list[int]:
    """Greedy tokens of one sequence run by itself (optionally prefilled in chunks)."""
    chunk = chunk or len(ids)
    out: list[int] = []
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        last = start + len(part) == len(ids)
        res = run(
            engine, StepPlan(prefills=(PrefillChunk(slot, part, start, last),), sampling={slot: GREEDY})
        )
        out += [o.token_id for o in res.outputs]
    pos = len(ids)
    for _ in range(steps - 1):
        res = run(engine, StepPlan(decodes=(DecodeToken(slot, out[-1], pos),), sampling={slot: GREEDY}))
        out.append(res.outputs[0].token_id)
        pos += 1
    return out


def test_batched_slots_match_each_alone(engine: Engine) -> None:
    prompts = {0: prompt(1, 5), 1: prompt(2, 11), 2: prompt(3, 2), 3: prompt(4, 17)}
    alone = {s: generate_alone(engine, s, p, steps=6) for s, p in prompts.items()}
    # All four prefill in one step, then decode together, each at its own position.
    res = run(
        engine,
        StepPlan(
            prefills=tuple(PrefillChunk(s, p, 0, True) for s, p in prompts.items()),
            sampling=dict.fromkeys(prompts, GREEDY),
        ),
    )
    assert res.prefill_tokens == sum(len(p) for p in prompts.values())
    got = {o.slot: [o.token_id] for o in res.outputs}
    pos = {s: len(p) for s, p in prompts.items()}
    for _ in range(5):
        plan = StepPlan(
            decodes=tuple(DecodeToken(s, got[s][-1], pos[s]) for s in prompts),
            sampling=dict.fromkeys(prompts, GREEDY),
        )
        res = run(engine, plan)
        assert res.decode_tokens == 4
        for o in res.outputs:
            got[o.slot].append(o.token_id)
            pos[o.slot] += 1
    assert got == alone


def test_mixed_prefill_and_decode_in_one_step(engine: Engine) -> None:
    a, b = prompt(10, 9), prompt(11, 13)
    alone_a = generate_alone(engine, 0, a, steps=4)
    alone_b = generate_alone(engine, 1, b, steps=3)
    # slot 0 starts; slot 1 joins later in two prefill chunks while slot 0 decodes.
    first = run(engine, StepPlan(prefills=(PrefillChunk(0, a, 0, True),), sampling={0: GREEDY}))
    ga = [first.outputs[0].token_id]
    step = run(
        engine,
        StepPlan(
            prefills=(PrefillChunk(1, b[:6], 0, False),),
            decodes=(DecodeToken(0, ga[-1], 9),),
            sampling={0: GREEDY, 1: GREEDY},
        ),
    )
    assert [o.slot for o in step.outputs] == [0]  # a non-final chunk samples nothing
    ga.append(step.outputs[0].token_id)
    step = run(
        engine,
        StepPlan(
            prefills=(PrefillChunk(1, b[6:], 6, True),),
            decodes=(DecodeToken(0, ga[-1], 10),),
            sampling={0: GREEDY, 1: GREEDY},
        ),
    )
    by_slot = {o.slot: o.token_id for o in step.outputs}
    ga.append(by_slot[0])
    gb = [by_slot[1]]
    step = run(
        engine,
        StepPlan(
            decodes=(DecodeToken(0, ga[-1], 11), DecodeToken(1, gb[-1], 13)), sampling={0: GREEDY, 1: GREEDY}
        ),
    )
    by_slot = {o.slot: o.token_id for o in step.outputs}
    ga.append(by_slot[0])
    gb.append(by_slot[1])
    step = run(engine, StepPlan(decodes=(DecodeToken(1, gb[-1], 14),), sampling={1: GREEDY}))
    gb.append(step.outputs[0].token_id)
    assert ga == alone_a
    assert gb == alone_b


def test_chunked_prefill_equals_one_shot(engine: Engine) -> None:
    ids = prompt(20, 23)
    assert generate_alone(engine, 2, ids, steps=4, chunk=5) == generate_alone(engine, 2, ids, steps=4)


def test_release_and_reuse_of_a_slot(engine: Engine) -> None:
    old, new = prompt(30, 20), prompt(31, 4)
    fresh = generate_alone(engine, 3, new, steps=4)
    generate_alone(engine, 3, old, steps=3)  # leaves a longer sequence's KV in slot 3
    assert run(engine, StepPlan(release=(3,))).outputs == ()
    assert generate_alone(engine, 3, new, steps=4) == fresh


def test_at_capacity_when_the_next_position_reaches_max_len(engine: Engine) -> None:
    ids = prompt(40, MAX_LEN - 2)
    res = run(engine, StepPlan(prefills=(PrefillChunk(0, ids, 0, True),), sampling={0: GREEDY}))
    assert not res.outputs[0].at_capacity  # its token goes to position MAX_LEN - 2
    res = run(
        engine,
        StepPlan(decodes=(DecodeToken(0, res.outputs[0].token_id, MAX_LEN - 2),), sampling={0: GREEDY}),
    )
    assert not res.outputs[0].at_capacity
    res = run(
        engine,
        StepPlan(decodes=(DecodeToken(0, res.outputs[0].token_id, MAX_LEN - 1),), sampling={0: GREEDY}),
    )
    assert res.outputs[0].at_capacity  # the next token would sit at MAX_LEN


def test_seeded_request_is_independent_of_its_batch(engine: Engine) -> None:
    seeded = SamplingParams(temperature=1.0, seed=77)
    other = SamplingParams(temperature=1.0)
    ids = prompt(50, 6)

    def draw(slot: int, companions: dict[int, tuple[int, ...]]) -> list[int]:
        res = run(
            engine,
            StepPlan(
                prefills=(
                    PrefillChunk(slot, ids, 0, True),
                    *(PrefillChunk(s, p, 0, True) for s, p in companions.items()),
                ),
                sampling={slot: seeded, **dict.fromkeys(companions, other)},
            ),
        )
        out = {o.slot: o.token_id for o in res.outputs}
        toks = [out[slot]]
        pos = {slot: len(ids), **{s: len(p) for s, p in companions.items()}}
        for _ in range(7):
            plan = StepPlan(
                decodes=tuple(DecodeToken(s, out[s], pos[s]) for s in out),
                sampling={slot: seeded, **dict.fromkeys(companions, other)},
            )
            out = {o.slot: o.token_id for o in run(engine, plan).outputs}
            pos = {s: p + 1 for s, p in pos.items()}
            toks.append(out[slot])
        return toks

    assert draw(0, {}) == draw(2, {0: prompt(51, 3), 3: prompt(52, 8)})


def test_logprobs_through_the_engine(engine: Engine) -> None:
    res = run(
        engine,
        StepPlan(
            prefills=(PrefillChunk(1, prompt(60, 5), 0, True),),
            sampling={1: SamplingParams(temperature=0.0, logprobs=3)},
        ),
    )
    out = res.outputs[0]
    assert out.logprob is not None and out.logprob <= 0
    assert len(out.top_logprobs) == 3 and out.top_logprobs[0] == (out.token_id, pytest.approx(out.logprob))


def test_cost_model_comes_from_specs_and_profile(engine: Engine) -> None:
    cm = engine.cost_model
    # tiny-llama: 2 layers, 2 KV heads of 16 dims, K and V, float32
    assert cm.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert cm.quantized_kv_bytes_per_token == 2 * 2 * 2 * (16 + 4)  # int8 + a float32 scale per head
    assert cm.state_bytes_per_slot == 0
    assert cm.weights_bytes == sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    assert cm.activation_bytes_per_prefill_token > 0
    assert engine.load_report.profile.chunk_tokens == cm.prefill_chunk_tokens == 16


def test_quantized_kv_when_the_operator_asks() -> None:
    eng = Engine.load(config(max_num_seqs=2, kv_quant="int8"))
    try:
        assert eng.runner.quantized_kv
        ids = prompt(70, 8)
        toks = generate_alone(eng, 0, ids, steps=3)
        assert len(toks) == 3
        assert eng.runner.kv is not None and eng.runner.kv.layout.storage_dtype == torch.int8
        assert eng.runner.kv.figures().used_blocks == 1  # 8 + 3 tokens: one block of 32
    finally:
        eng.shutdown()


def test_a_failed_step_costs_only_its_sequences_and_a_device_fault_makes_the_engine_unhealthy() -> None:
    eng = Engine.load(config(max_num_seqs=2))
    try:
        with pytest.raises(StepFailed) as failed:  # a Python error (here a plan it cannot run)
            run(eng, StepPlan(decodes=(DecodeToken(0, 5, MAX_LEN),), sampling={0: GREEDY}))
        assert failed.value.slots == {0} and isinstance(failed.value.cause, PlanError) and eng.healthy
        forward = eng.runner.forward

        def poisoned(seqs, all_logits=()):  # type: ignore[no-untyped-def]
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        eng.runner.forward = poisoned  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="illegal memory access"):
            run(eng, StepPlan(prefills=(PrefillChunk(0, (5, 6), 0, True),), sampling={0: GREEDY}))
        eng.runner.forward = forward  # type: ignore[method-assign]
        assert not eng.healthy
        with pytest.raises(EngineUnhealthy):
            run(eng, StepPlan(decodes=(DecodeToken(0, 5, 1),), sampling={0: GREEDY}))
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "fault", [MemoryError("host allocation failed"), torch.cuda.OutOfMemoryError("CUDA out of memory")]
)
def test_an_out_of_memory_error_in_a_prefill_loses_only_that_steps_sequences(fault: Exception) -> None:
    eng = Engine.load(config(max_num_seqs=3))
    try:
        steady, doomed = prompt(40, 9), prompt(41, 12)
        calm = generate_alone(eng, 0, steady, steps=8)
        run(eng, StepPlan(release=(0,)))
        idle_used = eng.kv_figures().used_blocks  # type: ignore[union-attr]
        # Slot 0 runs alone for a while; slot 1's prefill then fails in a step of its own.
        got = generate_alone(eng, 0, steady, steps=4)
        forward = eng.runner.forward
        eng.runner.forward = lambda seqs, all_logits=(): (_ for _ in ()).throw(fault)  # type: ignore[method-assign]
        with pytest.raises(StepFailed) as failed:
            run(eng, StepPlan(prefills=(PrefillChunk(1, doomed, 0, True),), sampling={1: GREEDY}))
        eng.runner.forward = forward  # type: ignore[method-assign]
        assert failed.value.slots == {1} and failed.value.cause is fault and eng.healthy
        assert eng.kv_figures().used_blocks == -(-(len(steady) + 3) // eng.kv_figures().block_size)  # type: ignore[union-attr]
        pos = len(steady) + len(got) - 1  # slot 0 goes on exactly as in the calm run
        for _ in range(4):
            res = run(eng, StepPlan(decodes=(DecodeToken(0, got[-1], pos),), sampling={0: GREEDY}))
            got.append(res.outputs[0].token_id)
            pos += 1
        assert got == calm
        run(eng, StepPlan(release=(0, 1)))  # slot 1's release after the failure is a no-op
        assert eng.kv_figures().used_blocks == idle_used  # type: ignore[union-attr]
        assert generate_alone(eng, 1, steady, steps=8) == calm  # the failed slot serves again
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "plan",
    [
        StepPlan(decodes=(DecodeToken(9, 5, 1),), sampling={9: GREEDY}),  # slot out of range
        StepPlan(decodes=(DecodeToken(0, 5, 1),)),  # no sampling params for a sampled slot
        StepPlan(prefills=(PrefillChunk(0, tuple(range(MAX_LEN + 1)), 0, True),), sampling={0: GREEDY}),
        StepPlan(
            prefills=(PrefillChunk(0, (5, 49152), 0, True),), sampling={0: GREEDY}
        ),  # token id past the vocabulary
        StepPlan(decodes=(DecodeToken(0, -1, 3),), sampling={0: GREEDY}),
        StepPlan(prefills=(PrefillChunk(0, (), 0, True),), sampling={0: GREEDY}),  # a chunk of no tokens
    ],
)
def test_impossible_plans_are_refused(plan: StepPlan) -> None:
    eng = Engine.load(config(max_num_seqs=2))
    try:
        with pytest.raises(StepFailed) as failed:  # refused, and the engine serves on
            run(eng, plan)
        assert isinstance(failed.value.cause, PlanError) and eng.healthy
    finally:
        eng.shutdown()


def test_empty_plan_and_config_validation(engine: Engine) -> None:
    assert replace(run(engine, StepPlan()), kv=None, kv_int8=None) == StepResult()
    with pytest.raises(ConfigError):
        config(kv_quant="fp4")
    with pytest.raises(ConfigError):
        config(device="tpu")


@pytest.mark.parametrize("model", ["builtin:tiny-qwen3-next", "builtin:tiny-qwen3.5-moe"])
def test_hybrid_models_run_through_the_same_engine(model: str) -> None:
    """Recurrent-state layers behind the same runner: slots reused for a second sequence start
    from a clean state, chunked prefill equals one shot, and batching changes nothing."""
    eng = Engine.load(config(model=model))
    try:
        prompts = {0: prompt(80, 3), 1: prompt(81, 9), 2: prompt(82, 14)}
        alone = {s: generate_alone(eng, s, p, steps=4) for s, p in prompts.items()}
        chunked = {s: generate_alone(eng, s, p, steps=4, chunk=4) for s, p in prompts.items()}
        assert chunked == alone
        res = run(
            eng,
            StepPlan(
                prefills=tuple(PrefillChunk(s, p, 0, True) for s, p in prompts.items()),
                sampling=dict.fromkeys(prompts, GREEDY),
            ),
        )
        got = {o.slot: [o.token_id] for o in res.outputs}
        for step in range(3):
            plan = StepPlan(
                decodes=tuple(DecodeToken(s, got[s][-1], len(p) + step) for s, p in prompts.items()),
                sampling=dict.fromkeys(prompts, GREEDY),
            )
            for o in run(eng, plan).outputs:
                got[o.slot].append(o.token_id)
        assert got == alone
        assert eng.cost_model.state_bytes_per_slot > 0
    finally:
        eng.shutdown()


def test_the_memory_layer_gates_the_load(tmp_path: Path) -> None:
    """16 GiB host, reserve 2.4 GiB: 1 MiB above the reserve cannot hold the weights and one short
    sequence, and the refusal says what would fit; 8 GiB above it can, and the engine then loads."""
    config_mem = MemoryConfig(root=str(tmp_path))
    watch = MemWatch(config_mem, device_reader=StaticDeviceReader())
    reserve = int(0.15 * 16 * GiB)
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=reserve + 1 * MiB)
    with pytest.raises(ModelLoadRefused) as refused:
        Engine.load(config(max_num_seqs=1), watch=watch)
    assert "would fit with" in str(refused.value) and refused.value.verdict.kind.value == "reject"
    write_tree(tmp_path, mem_total=16 * GiB, mem_available=reserve + 8 * GiB)
    eng = Engine.load(config(max_num_seqs=1), watch=watch)
    try:
        assert eng.healthy and eng.load_report.weights_bytes > 0
    finally:
        eng.shutdown()


def test_model_specs_resolve_or_fail_clearly(tmp_path: Path) -> None:
    assert resolve("builtin:tiny-llama").kind == "builtin"
    with pytest.raises(UnsupportedModel, match="tiny-llama"):
        resolve("builtin:no-such-model")  # the message lists what is built in
    with pytest.raises(ModelSpecError):
        resolve(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelSpecError):
        resolve(str(tmp_path))  # a directory without config.json


def test_generate_cli_reports_load_errors_without_a_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from ballast.engine.generate import main

    assert main(["--model", "builtin:no-such-model", "--prompt", "hi", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "built in: " in err and "builtin:tiny-llama" in err
    assert main(["--model", "builtin:tiny-llama", "--prompt", "hi", "--max-tokens", "0"]) == 2


@pytest.mark.parametrize("model", ["builtin:tiny-llama", "builtin:tiny-qwen3-next"])
@pytest.mark.parametrize("quantized", [False, True])
def test_planned_state_bytes_equal_what_is_allocated(model: str, quantized: bool) -> None:
    """The ledger is asked for the planned figure before allocation; it must be the real one. The
    KV pool holds nothing until a sequence needs blocks."""
    eng = Engine.load(config(model=model, max_num_seqs=3, kv_quant="int8" if quantized else "none"))
    try:
        planned = planned_state_bytes(eng.runner.model, eng.dtype, 3)
        assert planned == eng.runner.fixed_bytes == eng.runner.state_bytes
    finally:
        eng.shutdown()


@pytest.mark.parametrize("model", ["builtin:tiny-llama", "builtin:tiny-qwen3-next"])
def test_int8_and_main_pool_sequences_run_side_by_side(model: str) -> None:
    """A sequence started with int8_kv (the ladder's WATCH rung) lives in the int8 pool while one
    started before it keeps the model dtype; in mixed steps each gets exactly the tokens it gets
    alone in an engine of its own format."""

    def alone(kv_quant: str, ids: tuple[int, ...]) -> list[int]:
        eng = Engine.load(config(model=model, kv_quant=kv_quant))
        try:
            return generate_alone(eng, 0, ids, steps=6)
        finally:
            eng.shutdown()

    a, b = prompt(11, 20), prompt(12, 37)
    eng = Engine.load(config(model=model))
    try:
        res = run(
            eng,
            StepPlan(
                prefills=(PrefillChunk(0, a, 0, True), PrefillChunk(1, b, 0, True, int8_kv=True)),
                sampling={0: GREEDY, 1: GREEDY},
            ),
        )
        out = {o.slot: [o.token_id] for o in res.outputs}
        assert res.kv is not None and res.kv_int8 is not None
        assert res.kv.used_blocks == 1 and res.kv_int8.used_blocks == 2  # 20 tokens in main, 37 in int8
        for step in range(5):
            decodes = (DecodeToken(0, out[0][-1], len(a) + step), DecodeToken(1, out[1][-1], len(b) + step))
            for o in run(eng, StepPlan(decodes=decodes, sampling={0: GREEDY, 1: GREEDY})).outputs:
                out[o.slot].append(o.token_id)
        res = run(eng, StepPlan(release=(0, 1)))
        assert res.kv_int8 is not None and res.kv_int8.used_blocks == 0
    finally:
        eng.shutdown()
    assert out[0] == alone("none", a)
    assert out[1] == alone("int8", b)


def test_the_default_prefill_chunk_follows_the_device() -> None:
    """0 (the default) is 2048 tokens a step, never past max_model_len; beside decodes 512 on the
    CPU (its steps are compute-bound: a chunk stalls the streams), the whole chunk on CUDA; a
    chunk that is set is kept for both."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert EngineConfig().resolved_prefill_chunk(cuda) == 2048
    assert EngineConfig().resolved_prefill_chunk(cpu) == 2048
    assert EngineConfig().resolved_busy_prefill_chunk(cuda) == 2048
    assert EngineConfig().resolved_busy_prefill_chunk(cpu) == 512
    assert EngineConfig(max_model_len=300).resolved_prefill_chunk(cuda) == 300
    assert EngineConfig(max_model_len=300).resolved_busy_prefill_chunk(cpu) == 300
    assert EngineConfig(prefill_chunk_tokens=700).resolved_prefill_chunk(cpu) == 700
    assert EngineConfig(prefill_chunk_tokens=700).resolved_busy_prefill_chunk(cpu) == 700


def test_a_preempted_decode_counts_no_token() -> None:
    """Two sequences of one full block each, a pool of three blocks that may not grow: at the
    next decode both need a block, the younger is preempted, and the step reports the one token it
    ran (its figures match its outputs)."""
    eng = Engine.load(
        config(max_num_seqs=2, max_model_len=128, prefill_chunk_tokens=64, kv_segment_bytes=64 << 10)
    )
    try:
        kv = eng.runner.kv
        assert kv is not None
        kv._acquire = limited_grants(1)
        n = kv.layout.block_size
        prompts = {0: prompt(40, n), 1: prompt(41, n)}
        res = eng.step(
            StepPlan(
                prefills=tuple(PrefillChunk(s, p, 0, True) for s, p in prompts.items()),
                sampling=dict.fromkeys(prompts, GREEDY),
            )
        )
        assert not res.preempted and kv.figures().free_blocks == 1
        last = {o.slot: o.token_id for o in res.outputs}
        res = eng.step(
            StepPlan(
                decodes=tuple(DecodeToken(s, last[s], n) for s in prompts),
                sampling=dict.fromkeys(prompts, GREEDY),
            )
        )
        assert res.preempted == (1,) and [o.slot for o in res.outputs] == [0]
        assert res.decode_tokens == 1 and res.prefill_tokens == 0
    finally:
        eng.shutdown()


def test_the_ladders_slot_limit_bounds_where_sequences_start() -> None:
    """A plan's max_slots (the ladder's rung) is applied before the step: a sequence running past
    it keeps decoding, a new one may not start there (the plan is refused, the engine serves on),
    and raising the limit again lets it."""
    eng = Engine.load(config(max_num_seqs=4))
    try:
        run(eng, StepPlan(prefills=(PrefillChunk(3, prompt(90, 5), 0, True),), sampling={3: GREEDY}))
        run(eng, StepPlan(max_slots=2))
        assert eng._steps.slot_limit == 2
        out = run(eng, StepPlan(decodes=(DecodeToken(3, 7, 5),), sampling={3: GREEDY}))
        assert [o.slot for o in out.outputs] == [3]
        with pytest.raises(StepFailed) as failed:
            run(eng, StepPlan(prefills=(PrefillChunk(2, prompt(91, 4), 0, True),), sampling={2: GREEDY}))
        assert isinstance(failed.value.cause, PlanError) and "slot limit 2" in str(failed.value.cause)
        assert eng.healthy
        out = run(
            eng,
            StepPlan(prefills=(PrefillChunk(2, prompt(91, 4), 0, True),), sampling={2: GREEDY}, max_slots=4),
        )
        assert [o.slot for o in out.outputs] == [2] and eng._steps.slot_limit == 4
    finally:
        eng.shutdown()
