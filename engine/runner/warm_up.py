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
also runs beside one decode and beside 15 (1, 2, 16 sequences: the three kinds of a count).

The steps run through the runner's own forward on its real slots: the KV blocks they write come
from the pool under the memory layer's grants (its segments given back after), the states and
activations are the ones leased at start-up. Logged: how many steps, of what, in how long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import torch
from ballast.engine.runner.model_runner import ModelRunner
from ballast.models.base import Row
from torch import nn

log = logging.getLogger(__name__)

# Sequence counts a step is warmed at: one of each kind of an integer argument (1, other, x16).
SEQUENCE_KINDS = (1, 2, 16)
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
    max_decodes: int,
    thresholds: Iterable[int] = (),
    multiples: Iterable[int] = (1,),
    divisors: Iterable[int] = (),
) -> list[tuple[int, int]]:
    """(prompt chunk tokens, decode tokens beside it) of every warm-up step, up to max_chunk +
    max_decodes tokens: each size class of the plain token count alone and beside 1 and 15 decodes
    where the slots allow, each further class of the multiples, divisors and thresholds alone (a
    size past the chunk: beside as many decodes as it needs)."""
    top = max_chunk + max_decodes
    plain = size_classes(top)
    out: list[tuple[int, int]] = []
    for n in sorted({*plain, *size_classes(top, thresholds, multiples, divisors)}):
        for seqs in SEQUENCE_KINDS if n in plain else SEQUENCE_KINDS[:1]:
            decodes = max(min(seqs - 1, max_decodes), n - max_chunk)  # as many as the slots hold
            chunk = n - decodes
            if 1 <= chunk <= max_chunk and decodes <= max_decodes and (chunk, decodes) not in out:
                out.append((chunk, decodes))
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


def warm_up(runner: ModelRunner, max_chunk: int, thresholds: Iterable[int] = ()) -> list[tuple[int, int]]:
    """Run `steps` on the runner's slots 0.. (nothing is served yet), then give their blocks and
    states back; the steps run, in order. Raises what a step raises (a start-up that cannot run
    its own steps should not report ready)."""
    max_decodes = min(runner.num_slots - 1, max(SEQUENCE_KINDS) - 1)
    named, multiples, divisors = model_sizes(runner.model)
    plan = steps(max_chunk, max_decodes, {*thresholds, *named}, multiples, divisors)
    slots = list(range(1 + max_decodes))
    context = 16  # each decode token's position: it attends to a few cached ones
    kv = runner.kv_manager
    free = [p.alloc.free_blocks for p in kv.pools] if kv is not None else []  # kept free after
    started = last = time.monotonic()
    try:
        if kv is not None:
            pool = kv.main
            ok = pool.ensure(0, max_chunk) and all(pool.ensure(s, context + 1) for s in slots[1:])
            if not ok:
                log.warning(
                    "warm-up: no KV blocks for a %d-token prompt; first requests may compile", max_chunk
                )
                return []
        for i, (chunk, decodes) in enumerate(plan):
            runner.reset(slots[: 1 + decodes])
            rows: list[Row] = [(0, [0] * chunk, 0)]
            rows += [(s, [0], context) for s in slots[1 : 1 + decodes]]
            runner.forward(rows)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            now = time.monotonic()
            if now - last >= PROGRESS_S:
                log.info(
                    "warm-up: step %d of %d (%d prompt + %d decode tokens)", i + 1, len(plan), chunk, decodes
                )
                last = now
    finally:
        if kv is not None:
            kv.release(slots)
            for pool, keep in zip(kv.pools, free, strict=True):
                pool.shrink(keep)  # the segments it added, none it had
        runner.reset(slots)
    log.info(
        "warm-up: %d steps (prompt chunks of 1-%d tokens alone and beside up to %d decodes) in %.1f s: "
        "every kernel variant a step can meet is compiled before /ready",
        len(plan),
        max_chunk,
        max_decodes,
        time.monotonic() - started,
    )
    return plan
