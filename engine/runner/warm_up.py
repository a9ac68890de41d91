"""No compile after /ready: at start-up, one step of every size class a served step can meet, so
the kernels' variants for it are compiled (or loaded from the Triton cache) before the first request.
The 80B on an H200 with an empty cache: the first request of each new prompt length after /ready
waited 1.5-2.1 s for its first token.

Triton compiles a kernel once per kind of each integer argument (1, a multiple of 16, any other:
`kind`) and once per constexpr; the launchers pick constexprs by size (the next power of two of
the tokens or of the token x expert pairs), and paths and tilings by thresholds. So a step's
kernels follow, for its token count n and each multiple m x n a module launches over (the MoE
block's pairs) and each count of d-token chunks ceil(n / d) (gated DeltaNet's 64), the power-of-two
class and the kind, and the side of each threshold n is on (`key`). `size_classes` walks every n
up to the most tokens a step carries (a chunk beside a decode per other slot) and keeps the first
of each key. Each of the plain token count's classes
also runs as 2 and 16 prompts and beside 1 and 15 decodes (`SHAPES`: the three kinds of a count of
prompts and of decodes, which kernels that split a step see).

The steps run through the runner's own forward on its real slots: the KV blocks they write come
from the pool under the memory layer's grants (its segments given back after), the states and
activations are the ones leased at start-up. Logged: how many steps, of what, in how long.

They run largest first: CUDA's caching allocator keeps each segment a step took, and a step
larger than every segment cached takes new ones, so ascending sizes left the segments of every
size class reserved (~940 MiB on the 8B shape against a 232 MiB chunk's live peak, s27); from the
largest down, each step reuses the first one's. On CUDA the sampler then draws one full batch on
its widest path, so the workspace start-up leases for it is held from the start (the load
estimate counts it; otherwise the first full batch after /ready allocated it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import NamedTuple

import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.runner.model_runner import ModelRunner
from ballast.engine.step.sampler import Sampler
from ballast.models.base import Row, StepBatch
from torch import nn

log = logging.getLogger(__name__)

# (prompts, decodes) of a step a size is warmed as: each count one of each kind of an integer
# argument (1, other, x16), as the kernels that split a step into its prompts and its decodes see them
SHAPES = ((1, 0), (1, 1), (1, 15), (2, 0), (16, 0))


class Step(NamedTuple):
    """A warm-up step: `chunk` prompt tokens over `prompts` sequences, beside `decodes` tokens."""

    chunk: int
    prompts: int
    decodes: int

    def rows(self, context: int) -> list[Row]:
        """Prompt i in slot i from position 0 (the first takes the remainder of an uneven split),
        then one decode token a slot at position `context`."""
        part, extra = divmod(self.chunk, self.prompts)
        rows: list[Row] = [(i, [0] * (part + (extra if i == 0 else 0)), 0) for i in range(self.prompts)]
        return rows + [(self.prompts + j, [0], context) for j in range(self.decodes)]


PROGRESS_S = 5.0  # a progress line at most this often


def kind(n: int) -> int:
    """Triton's kind of an integer argument: 1 (a constant), a multiple of 16, any other."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 0


def key(
    n: int, thresholds: Iterable[int] = (), multiples: Iterable[int] = (1,), divisors: Iterable[int] = ()
) -> tuple[object, ...]:
    """What the kernels of a step of n tokens are compiled per (see the module's docstring)."""
    counts = [*(m * n for m in multiples), *(-(-n // d) for d in divisors)]
    return (*((1 << max(0, (c - 1).bit_length()), kind(c)) for c in counts), *(n >= t for t in thresholds))


def size_classes(
    max_tokens: int,
    thresholds: Iterable[int] = (),
    multiples: Iterable[int] = (1,),
    divisors: Iterable[int] = (),
) -> list[int]:
    """The first token count of each `key` from 1 to max_tokens, ascending."""
    shape = (sorted(set(thresholds)), sorted({1, *multiples}), sorted(set(divisors)))
    seen: set[tuple[object, ...]] = set()
    out = []
    for n in range(1, max_tokens + 1):
        k = key(n, *shape)
        if k not in seen:
            seen.add(k)
            out.append(n)
    return out


def steps(
    max_chunk: int,
    slots: int,
    thresholds: Iterable[int] = (),
    multiples: Iterable[int] = (1,),
    divisors: Iterable[int] = (),
) -> list[Step]:
    """Every warm-up step, up to max_chunk + slots - 1 tokens (a full chunk beside a decode in every
    other slot): each size class of the plain token count in every one of SHAPES the slots hold,
    each further class of the multiples, divisors and thresholds as one prompt (a size past the
    chunk: beside as many decodes as it needs). The largest steps first (the module's docstring)."""
    top = max_chunk + slots - 1
    plain = size_classes(top)
    out: list[Step] = []
    for n in sorted({*plain, *size_classes(top, thresholds, multiples, divisors)}, reverse=True):
        for prompts, beside in SHAPES if n in plain else SHAPES[:1]:
            decodes = max(beside, n - max_chunk)
            step = Step(n - decodes, prompts, decodes)
            if prompts <= step.chunk <= max_chunk and prompts + decodes <= slots and step not in out:
                out.append(step)
    return out


def model_sizes(model: nn.Module) -> tuple[set[int], set[int], set[int]]:
    """What its modules name (each method optional): the token thresholds from which their
    kernels change (`token_thresholds`), the multiples of the token count they launch over
    (`token_multiples`) and the chunk sizes they count the tokens in (`token_divisors`)."""
    named: tuple[set[int], set[int], set[int]] = (set(), {1}, set())
    for m in model.modules():
        for found, method in zip(
            named, ("token_thresholds", "token_multiples", "token_divisors"), strict=True
        ):
            sizes = getattr(m, method, None)
            if callable(sizes):
                found.update(sizes())
    return named


def warm_up(runner: ModelRunner, max_chunk: int, thresholds: Iterable[int] = ()) -> list[Step]:
    """Run `steps` on the runner's slots 0.. (nothing is served yet), then give their blocks and
    states back; the steps run, in order. Raises what a step raises (a start-up that cannot run
    its own steps should not report ready)."""
    slots = min(runner.num_slots, max(p + d for p, d in SHAPES))
    named, multiples, divisors = model_sizes(runner.model)
    plan = steps(max_chunk, slots, {*thresholds, *named}, multiples, divisors)
    context = 16  # each decode token's position: it attends to a few cached ones
    kv = runner.kv_manager
    free = [p.alloc.free_blocks for p in kv.pools] if kv is not None else []  # kept free after
    started = last = time.monotonic()
    try:
        for i, step in enumerate(plan):
            rows = step.rows(context)
            runner.reset([slot for slot, _, _ in rows])
            if kv is not None and not all(kv.main.ensure(s, start + len(t)) for s, t, start in rows):
                log.warning("warm-up: no KV blocks for %s; requests may compile after /ready", step)
                return plan[:i]
            runner.forward(rows)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            now = time.monotonic()
            if now - last >= PROGRESS_S:
                log.info("warm-up: step %d of %d (%s)", i + 1, len(plan), step)
                last = now
        verify_step(runner, context)
        if runner.device.type == "cuda":
            full_batch_draw(runner.sampler)
    finally:
        every = list(range(slots))
        if kv is not None:
            kv.release(every)
            for pool, keep in zip(kv.pools, free, strict=True):
                pool.shrink(keep)  # the segments it added, none it had
        runner.reset(every)
    log.info(
        "warm-up: %d steps (prompt chunks of 1-%d tokens in 1, 2 or 16 prompts, alone and beside up to "
        "%d decodes) in %.1f s: every kernel variant a step can meet is compiled before /ready",
        len(plan),
        max_chunk,
        slots - 1,
        time.monotonic() - started,
    )
    return plan


def full_batch_draw(sampler: Sampler) -> None:
    """One draw for every slot on the sampler's widest path (top-p and top-k, seeded rows,
    penalties, logprobs: every temporary at once), then the slots' sampling state reset."""
    rows = list(range(sampler.num_slots))
    widest = [
        SamplingParams(top_p=0.9, top_k=50, seed=i if i % 2 else None, repetition_penalty=1.1, logprobs=5)
        for i in rows
    ]
    logits = torch.zeros(len(rows), sampler.vocab_size, device=sampler.device)
    sampler.sample(logits, rows, widest)
    sampler.reset(rows)


def verify_step(runner: ModelRunner, context: int) -> None:
    """Where the engine drafts: one verify row of the most drafts alone (a verify graph's step, or
    its kernels' variant where none was captured), then beside a decode (the recurrent layers'
    kernel keeps its states then, a variant of its own); marked as the executor marks them."""
    size = runner.verify
    if not size.rows or runner.num_slots < 2:
        return
    keep = any(s.slot_views(0) for s in runner.states)  # `StateRollback.save`'s rule
    row: Row = (0, [0] * (1 + size.drafts), context)
    for rows in ([row], [row, (1, [0], context)]):
        kv = runner.kv_manager
        if kv is not None and not all(kv.main.ensure(s, start + len(t)) for s, t, start in rows):
            return
        every = (True, False)[: len(rows)]
        batch = StepBatch.of(rows, all_logits=every)
        batch.verify = every if keep else ()
        runner.reset([s for s, _, _ in rows])
        runner.forward(batch)
