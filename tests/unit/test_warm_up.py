"""Start-up's warm-up (engine/runner/warm_up.py): the steps it runs meet every size class and kind
a served step can, and running them on the runner leaves no trace (blocks, segments, states)."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.runner.model_runner import ModelRunner
from ballast.engine.runner.warm_up import (
    SHAPES,
    Step,
    full_batch_draw,
    kind,
    model_sizes,
    size_classes,
    steps,
    warm_up,
)
from ballast.engine.step.sampler import Sampler
from ballast.engine.workspace import VerifySize
from ballast.models.arch.builtin import BUILTIN, init_random
from ballast.models.arch.registry import build_model
from ballast.models.layers.state import RecurrentState

CPU = torch.device("cpu")


def triton_kind(n: int) -> object:
    """Triton's own specialization of an integer argument where Triton is here, else the rule."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        return kind(n)
    return native_specialize_impl(BaseBackend, n, False, True, True)


def compiled_per(
    n: int, multiples: tuple[int, ...] = (1,), divisors: tuple[int, ...] = ()
) -> tuple[object, ...]:
    counts = [*(m * n for m in multiples), *(-(-n // d) for d in divisors)]
    return tuple((1 << max(0, (c - 1).bit_length()), triton_kind(c)) for c in counts)


@pytest.mark.parametrize(
    ("top", "multiples", "divisors"),
    [
        (1, (1,), ()),
        (2, (1,), ()),
        (17, (1,), ()),
        (2048 + 15, (1,), ()),
        (300, (1, 10), ()),
        (2048 + 15, (1, 10), (64,)),
    ],
)
def test_every_size_class_and_kind_up_to_the_top_is_met(
    top: int, multiples: tuple[int, ...], divisors: tuple[int, ...]
) -> None:
    sizes = size_classes(top, multiples=multiples, divisors=divisors)
    met = {compiled_per(n, multiples, divisors) for n in sizes}
    assert {compiled_per(n, multiples, divisors) for n in range(1, top + 1)} == met
    assert len(sizes) == len(met)  # one step of each


def test_each_threshold_is_met_on_both_sides() -> None:
    sizes = size_classes(2063, thresholds=(26, 42, 65, 410, 5000))
    for t in (26, 42, 65, 410):
        assert any(n < t for n in sizes) and t in sizes  # the first size at or past it is t
    assert size_classes(2063, thresholds=(5000,)) == size_classes(2063)  # past what a step carries


def test_steps_run_each_size_in_every_shape_within_the_slots() -> None:
    plan = steps(64, 16)
    assert all(p <= c <= 64 and p + d <= 16 for c, p, d in plan)
    by_total: dict[int, set[tuple[int, int]]] = {}
    for chunk, prompts, decodes in plan:
        by_total.setdefault(chunk + decodes, set()).add((prompts, decodes))
    assert set(by_total) == set(size_classes(64 + 15))
    for total, shapes in by_total.items():
        if 16 <= total <= 64:
            assert shapes == set(SHAPES)  # 1, 2 and 16 prompts; beside 0, 1 and 15 decodes
    for total in (n for n in by_total if n > 64):  # past the chunk: beside as many decodes as it needs
        assert min(d for _, d in by_total[total]) == total - 64
    assert steps(64, 1) == [Step(n, 1, 0) for n in reversed(size_classes(64))]  # one slot: one prompt alone
    totals = [c + d for c, _, d in plan]
    assert totals == sorted(totals, reverse=True)  # largest first: later steps reuse its segments
    moe = steps(64, 16, thresholds=(26,), multiples=(10,), divisors=(16,))
    assert set(plan) < set(moe)
    assert all(s.prompts == 1 and (s.decodes == 0 or s.chunk + s.decodes > 64) for s in set(moe) - set(plan))
    rows = Step(11, 2, 3).rows(context=16)
    assert [(slot, len(t), start) for slot, t, start in rows] == [
        (0, 6, 0),
        (1, 5, 0),
        (2, 1, 16),
        (3, 1, 16),
        (4, 1, 16),
    ]


def test_warm_up_runs_its_steps_on_the_runner_and_leaves_no_trace() -> None:
    """The real runner (tiny hybrid MoE: attention KV in the pool, recurrent states per slot):
    after warm-up no slot holds a block, the pool holds what it held, and a prompt's logits equal
    a fresh runner's (every state it touched is reset). Loaded for verify steps, it runs one too
    (its recurrent layers keep per-position states)."""
    model = build_model(BUILTIN["tiny-qwen3-next"])
    init_random(model, 0)

    def runner() -> ModelRunner:
        return ModelRunner(model, CPU, torch.float32, 3, 64, False, 0, verify=VerifySize(2, 3))

    warmed, fresh = runner(), runner()
    assert warmed.kv_manager is not None
    assert warmed.kv is not None and warmed.kv.reserve(1)  # a segment held before: kept
    held = [p.bytes_held for p in warmed.pools]
    assert held[0] > 0
    plan = warm_up(warmed, 2)
    assert plan == steps(2, 3, *model_sizes(model))
    assert max(s.chunk for s in plan) == 2 and {s.prompts for s in plan} == {1, 2}
    assert max(s.decodes for s in plan) >= 1
    assert all(warmed.kv_manager.held(s) == 0 for s in range(3))
    kept = [s.kept_states for s in warmed.states if isinstance(s, RecurrentState)]
    assert kept and all(k[0, :3].any() and not k[1].any() for k in kept)  # one verify row of 3 drafts
    assert [p.bytes_held for p in warmed.pools] == held
    prompt = [(1, list(range(3, 30)), 0)]
    for r in (warmed, fresh):
        assert r.kv is not None and r.kv.ensure(1, 27)
    torch.testing.assert_close(warmed.forward(prompt), fresh.forward(prompt), rtol=0, atol=0)


def test_the_moe_block_names_where_its_kernels_change() -> None:
    """The 80B's routing (512 experts, top-10): the FP8 x FP8 experts from 256 pairs (26 tokens),
    the fused FP8 experts up to 640 (65 from), the routing kernel up to 4,096 (410 from), expert
    tiles 256 wide past 64 rows an expert (3,277 from)."""
    pytest.importorskip("triton")
    from ballast.models.blocks.moe import SparseMoeBlock

    block = SparseMoeBlock(8, 512, 10, 4, 4, normalize=True)
    assert block.token_thresholds() == (26, 65, 410, 3277)
    assert block.token_multiples() == (10,)


def test_the_full_batch_draw_leaves_no_trace() -> None:
    """Start-up's draw for every slot (on CUDA: the sampler's workspace held from the start) leaves
    the slots as a fresh sampler's: nothing drawn, no penalty counts, seeded draws from the first."""
    warmed, fresh = Sampler(4, 300, CPU, seed=3), Sampler(4, 300, CPU, seed=3)
    full_batch_draw(warmed)
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, seed=7, frequency_penalty=0.5)] * 4
    assert not any(warmed.has_drawn(s) for s in range(4))
    for _ in range(3):
        assert warmed.sample(logits, range(4), params) == fresh.sample(logits, range(4), params)
