"""The plain data that crosses the scheduler/engine boundary: a frozen `StepPlan` in, a
`StepResult` out. Neither side reaches into the other's state, which is what lets scheduler tests
run on CPU against a fake engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ballast.engine.text.grammar import Constraint


class EngineError(RuntimeError):
    """Base of the engine's errors (the step's own classification of failures is in `faults`)."""


class PlanError(EngineError):
    """A StepPlan asks for something impossible (a slot out of range, a position past capacity)."""


class EngineUnhealthy(EngineError):
    """A previous step failed; the engine's device state can no longer be trusted."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same seed + prompt -> same tokens
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: int | None = None  # None = none; 0 = the sampled token only; n = also the top n
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    constraint: Constraint | None = None  # the output must follow this grammar

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            # A torch generator takes at most 64 bits: a larger seed would fail the engine step.
            raise ValueError("seed must fit in 64 bits")
        if self.repetition_penalty <= 0:
            raise ValueError("repetition_penalty must be > 0")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in [0, 20]")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


@dataclass(frozen=True)
class PrefillChunk:
    """Feed prompt tokens [start_pos, start_pos + len(token_ids)) of a slot. start_pos 0 starts a
    new sequence in the slot (its caches are reset). Sample a token only after the last chunk."""

    slot: int
    token_ids: tuple[int, ...]
    start_pos: int
    sample: bool
    int8_kv: bool = False  # a new sequence (start_pos 0) keeps its KV in int8 (the ladder at WATCH+)
    # Prompt logprobs (completions' echo with logprobs): the prompt token each position of the
    # chunk predicts (tokens start_pos + 1 ..; one fewer than the chunk at the prompt's end), and
    # how many most likely alternatives to report with each.
    logprob_targets: tuple[int, ...] = ()
    top_logprobs: int = 0


# A decode's token_id on the wire when the plan was built before the slot's previous step returned
# its token (`DecodeToken.from_device`): no token id is negative, so it cannot be mistaken for one.
LAST_SAMPLED = -1


@dataclass(frozen=True)
class DecodeToken:
    """Feed one token at position pos of a slot and sample the next: the last sampled one, or for
    a decode planned `ahead`, the one the slot's previous step is sampling, taken on the device."""

    slot: int
    token_id: int
    pos: int
    # Speculative tokens for positions pos + 1 ..: the step feeds them too and verifies them (each
    # position sampled as if decoded alone); the result then carries one output per emitted token.
    draft: tuple[int, ...] = ()

    @classmethod
    def ahead(cls, slot: int, pos: int) -> DecodeToken:
        """A decode planned before the slot's previous step returned its token."""
        return cls(slot, LAST_SAMPLED, pos)

    @property
    def from_device(self) -> bool:
        """The token is the slot's previous sample, still on the device (an overlapped step)."""
        return self.token_id == LAST_SAMPLED


@dataclass(frozen=True)
class CheckpointSave:
    """After this step's forward, copy the slot's state, which has then consumed exactly
    `prefix`, into the prefix cache, keyed by those tokens (a recurrent state cannot be cut back)."""

    slot: int
    prefix: tuple[int, ...]


@dataclass(frozen=True)
class CheckpointRestore:
    """Before this step's forward, load the checkpoint of exactly `prefix` (as `match_prefix`
    reported it) into the slot; the plan's prefill chunk for the slot starts at len(prefix)."""

    slot: int
    prefix: tuple[int, ...]


@dataclass(frozen=True)
class KVKeep:
    """Free blocks each KV pool keeps when it shrinks (`StepPlan.shrink_kv`): the blocks that running
    and queued requests are about to take. Only segments beyond these go back."""

    main: int = 0
    int8: int = 0


@dataclass(frozen=True)
class StepPlan:
    prefills: tuple[PrefillChunk, ...] = ()
    decodes: tuple[DecodeToken, ...] = ()
    sampling: dict[int, SamplingParams] = field(default_factory=dict)  # slot -> params
    release: tuple[int, ...] = ()  # slots whose request ended: free their per-slot state
    restores: tuple[CheckpointRestore, ...] = ()
    saves: tuple[CheckpointSave, ...] = ()
    max_slots: int | None = None  # the ladder's slot limit from this step on: no sequence starts past it
    shed_prefix_cache: bool = False  # empty the prefix cache before the step (ladder, WATCH+)
    shrink_kv: bool = False  # give free KV segments back before the step (ladder, TIGHT+)
    kv_keep: KVKeep = KVKeep()  # ... all but these free blocks (0 at CRITICAL: everything free)
    # Parked (preempted) sequences whose request ended while it waited: drop what would resume them.
    unpark: tuple[tuple[int, ...], ...] = ()

    @property
    def empty(self) -> bool:
        return not (
            self.prefills
            or self.decodes
            or self.release
            or self.restores
            or self.saves
            or self.shed_prefix_cache
            or self.shrink_kv
            or self.unpark
        )


@dataclass(frozen=True)
class SlotOutput:
    slot: int
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    at_capacity: bool = False  # the slot reached max_model_len: finish by length


@dataclass(frozen=True)
class PromptLogprobs:
    """What the model gave prompt tokens first_pos, first_pos + 1, ... of a slot: each one's
    logprob and the most likely alternatives (token id, logprob) at its position."""

    slot: int
    first_pos: int
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class KVFigures:
    """The KV block pool after a step: what admission counts blocks against."""

    block_size: int  # positions per block
    block_bytes: int  # one block across every attention layer
    free_blocks: int  # in live segments, held by nobody
    used_blocks: int
    segments: int  # live segments
    addable_blocks: int  # blocks the limits still allow in segments not yet live
    bytes_held: int
    evictable_blocks: int = 0  # in use only by the prefix cache: the engine evicts them for a sequence

    @property
    def spare_blocks(self) -> int:
        """Blocks a sequence can have without new memory: free, or freed by evicting cache."""
        return self.free_blocks + self.evictable_blocks

    @property
    def free_bytes(self) -> int:
        """Bytes of the spare blocks (free or held only by the prefix cache)."""
        return self.spare_blocks * self.block_bytes

    @property
    def addable_bytes(self) -> int:
        return self.addable_blocks * self.block_bytes


@dataclass(frozen=True)
class StepResult:
    outputs: tuple[SlotOutput, ...] = ()
    prefill_tokens: int = 0
    decode_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens restored from checkpoints instead of prefilled
    ledger_bytes: int = 0
    # Slots whose sequence the engine moved out because their blocks could not be had; the
    # scheduler re-queues their requests, which resume where they stopped.
    preempted: tuple[int, ...] = ()
    kv: KVFigures | None = None  # the main KV pool
    kv_int8: KVFigures | None = None  # the int8 pool new sequences use under pressure, if any
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # for chunks that asked (logprob_targets)
    # The MTP drafter's drafts (engine.spec.mtp): (slot, the position its next decode feeds, the
    # drafts after it) for every slot that emitted a token; empty without an MTP drafter.
    proposals: tuple[tuple[int, int, tuple[int, ...]], ...] = ()


class StepFailed(Exception):
    """A step raised, but the engine is still sound: it dropped every sequence the plan touched
    and applied its releases, so only the requests in `slots` are lost (the scheduler fails them,
    retryable). A fault that leaves the device unsound is raised as itself, never as this.
    `memory`: the step failed for want of memory (its requests may succeed in smaller steps)."""

    def __init__(self, cause: Exception, slots: frozenset[int], *, memory: bool = False) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause = cause
        self.slots = slots
        self.memory = memory
