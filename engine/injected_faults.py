"""Faults an operator injects into engine steps (`BALLAST_FAULTS`), to test from outside the
process what the server does when a step hangs, runs out of memory, poisons the device or crawls.

Off unless set; the value is a JSON list of objects (the fields are the flag's help). `hang` and
`slow` sleep `seconds` (default 3600 and 0.1), `oom` raises the device's out-of-memory error,
`device_error` a context-poisoning CUDA error (the engine becomes unsound), `device_hang` spins a
kernel on the GPU for `seconds` (default 3600) and waits for it, so the engine thread is blocked
inside CUDA, not in a host sleep (CUDA only: on the CPU `hang` is the same fault). `after_steps` counts
steps with work; `rank` picks a tensor-parallel rank (a worker's oom or device_error ends it).
Faults fire right before the model's forward, where a stuck kernel or a failed allocation would.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass

import torch

from ballast.settings import ConfigError

log = logging.getLogger(__name__)

KINDS = ("hang", "oom", "device_error", "slow", "device_hang")
WHENS = ("prefill", "decode", "any")
_DEFAULT_SECONDS = {"hang": 3600.0, "slow": 0.1, "device_hang": 3600.0}
# Clock cycles a device_hang's kernel spins per second asked: at or above a GPU's top SM clock
# (an H200's is 1,980 MHz), so it spins at least as long as asked at any clock.
SPIN_HZ = 2.0e9
_FIELDS = {"kind", "after_steps", "count", "when", "seconds", "rank"}
MAX_RANK = 7
_LABEL = "--faults (BALLAST_FAULTS)"


@dataclass(frozen=True)
class FaultSpec:
    kind: str
    after_steps: int = 0
    count: int = 1  # -1: forever
    when: str = "any"
    seconds: float = 0.0
    rank: int = 0

    def matches(self, prefill: bool) -> bool:
        return self.when == "any" or (self.when == "prefill") == prefill


def parse_faults(text: str | None) -> tuple[FaultSpec, ...]:
    """The faults a `BALLAST_FAULTS` value asks for; ConfigError naming the entry when it is not
    a JSON list of fault objects with known fields and values in range."""
    if text is None:
        return ()
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{_LABEL} is not JSON: {exc}") from exc
    if not isinstance(raw, list):
        raise ConfigError(f"{_LABEL} must be a JSON list of fault objects, got {type(raw).__name__}")
    return tuple(_spec(i, entry) for i, entry in enumerate(raw))


def _spec(i: int, entry: object) -> FaultSpec:
    where = f"{_LABEL} entry {i}"
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} must be an object, got {type(entry).__name__}")
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown fields {unknown}; accepted {sorted(_FIELDS)}")
    kind = entry.get("kind")
    if kind not in KINDS:
        raise ConfigError(f"{where}: kind {kind!r} is not one of {', '.join(KINDS)}")
    when = entry.get("when", "any")
    if when not in WHENS:
        raise ConfigError(f"{where}: when {when!r} is not one of {', '.join(WHENS)}")
    after = entry.get("after_steps", 0)
    count = entry.get("count", 1)
    seconds = entry.get("seconds", _DEFAULT_SECONDS.get(kind, 0.0))
    if not _is_int(after) or after < 0:
        raise ConfigError(f"{where}: after_steps must be an integer >= 0, got {after!r}")
    if not _is_int(count) or (count < 1 and count != -1):
        raise ConfigError(f"{where}: count must be an integer >= 1, or -1 for forever; got {count!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not 0 <= seconds <= 86400:
        raise ConfigError(f"{where}: seconds must be a number in 0..86400, got {seconds!r}")
    rank = entry.get("rank", 0)
    if not _is_int(rank) or not 0 <= rank <= MAX_RANK:
        raise ConfigError(f"{where}: rank must be an integer in 0..{MAX_RANK}, got {rank!r}")
    return FaultSpec(kind, after, count, when, float(seconds), rank)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class FaultInjector:
    """Counts the steps with work and fires the faults whose turn it is. Engine thread only."""

    def __init__(self, specs: tuple[FaultSpec, ...], device: torch.device, rank: int = 0) -> None:
        self._specs = tuple(spec for spec in specs if spec.rank == rank)
        self._rank = rank
        self._fired = [0] * len(specs)
        self._on_cuda = device.type == "cuda"
        if not self._on_cuda and any(spec.kind == "device_hang" for spec in self._specs):
            raise ConfigError(
                f"{_LABEL}: device_hang spins a kernel on a GPU and needs a CUDA device; this engine "
                f"runs on {device}, where kind hang (a step that sleeps) is the same fault"
            )
        self.steps = 0  # steps with work seen so far

    def before_forward(self, prefill: bool) -> None:
        """Called before a step's forward; `prefill`: the step carries a prompt chunk."""
        step = self.steps
        self.steps += 1
        for i, spec in enumerate(self._specs):
            if step < spec.after_steps or not spec.matches(prefill):
                continue
            if spec.count != -1 and self._fired[i] >= spec.count:
                continue
            self._fired[i] += 1
            self._fire(spec, step)

    def _fire(self, spec: FaultSpec, step: int) -> None:
        what = f"injected by BALLAST_FAULTS at rank {self._rank}'s step {step}"
        if spec.kind in ("hang", "slow"):
            if spec.kind == "hang":
                log.warning(
                    "fault injection: rank %d's step %d hangs for %.0f s", self._rank, step, spec.seconds
                )
            time.sleep(spec.seconds)
        elif spec.kind == "device_hang":
            log.warning(
                "fault injection: rank %d's step %d spins the GPU for %.0f s", self._rank, step, spec.seconds
            )
            torch.cuda._sleep(int(spec.seconds * SPIN_HZ))
            torch.cuda.current_stream().synchronize()  # the engine thread waits inside CUDA
        elif spec.kind == "oom":
            if self._on_cuda:
                raise torch.cuda.OutOfMemoryError(f"CUDA out of memory ({what})")
            raise MemoryError(f"out of memory ({what})")
        else:  # device_error: the text of a context-poisoning CUDA error (engine.faults sees it)
            raise RuntimeError(f"CUDA error: an illegal memory access was encountered ({what})")
