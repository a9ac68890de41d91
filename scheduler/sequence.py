"""A request as the scheduler tracks it, from the queue to its finish."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ballast.engine.interface import DetokenizerLike
from ballast.scheduler.errors import Refused
from ballast.scheduler.request import FinishEvent, FinishReason, GenerationRequest, Mailbox, TokenLogprob


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    FINISHED = "finished"


@dataclass(eq=False)
class Seq:
    req: GenerationRequest
    mailbox: Mailbox
    submitted_at: float
    deadline: float | None
    detok: DetokenizerLike
    phase: Phase = Phase.WAITING
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the slot (sent to the engine or restored)
    cached: int = 0  # of which restored from a prefix checkpoint
    max_tokens: int = 0  # after admission (a CAP lowers it)
    capped: bool = False
    output: list[int] = field(default_factory=list)
    # Output generated before a preemption: prefilled after the prompt when it resumes.
    resumed: tuple[int, ...] = ()
    preempted: bool = False
    # Its KV lives in int8 blocks: decided at first admission and kept on resume, so a level
    # change never changes an admitted request's tokens.
    int8_kv: bool | None = None
    kv_held: int = 0  # positions the engine held for it after the last step (what its figures count)
    # Prompt logprobs by position (1 .. len(prompt) - 1); a recompute rescores to the same values.
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    # After a step failed for want of memory: the largest prefill chunk it gets (0 = no cap), and
    # how many decode-only steps it was in that failed so.
    chunk_cap: int = 0
    memory_strikes: int = 0
    # Seconds from submission to its first token the queue-wait projection gave it as it was
    # queued, before the measured factor (0: it was not projected); what that factor is taken from.
    projected_wait_s: float = 0.0

    @property
    def feed(self) -> tuple[int, ...]:
        """The tokens prefill runs over: the prompt, and after a preemption what was generated."""
        return self.req.prompt_ids + self.resumed if self.resumed else self.req.prompt_ids

    @property
    def total_tokens(self) -> int:
        """Positions the sequence may reach: what admission charged."""
        return len(self.req.prompt_ids) + self.max_tokens

    @property
    def consumed_tokens(self) -> int:
        """Positions it has been fed, in plans sent so far."""
        if self.phase is Phase.DECODING:
            return len(self.req.prompt_ids) + len(self.output) - 1
        return self.prefilled

    def finish_event(self, reason: FinishReason, error: Refused | None) -> FinishEvent:
        """Its last event: the counts, and its prompt's logprobs once every position was scored."""
        n_prompt = len(self.req.prompt_ids)
        scored = None
        if self.req.prompt_logprobs is not None and len(self.prompt_logprobs) == n_prompt - 1:
            scored = tuple(self.prompt_logprobs[pos] for pos in range(1, n_prompt))
        capped = self.capped and reason == "length"
        return FinishEvent(reason, n_prompt, len(self.output), capped, error, self.cached, scored)
