"""Every request the scheduler holds and where it is: waiting in the queue or running in a slot.

The one place a request changes place or ends, and that applies a step's result. A `Seq` changes
only here and in the planner that chunks its prompt: a request object mutated by scheduler,
allocator and runner at once is the field-tested failure mode.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque

from ballast.engine.plan import SlotOutput, StepFailed, StepPlan, StepResult
from ballast.scheduler.checkpoints import TurnSaves
from ballast.scheduler.errors import REFUSAL_OUTCOMES, Refused, RequestFailed, StepAborted, outcome_of
from ballast.scheduler.kv_policy import Charge
from ballast.scheduler.request import FinishReason, TokenEvent, TokenLogprob
from ballast.scheduler.sequence import Phase, Seq
from ballast.scheduler.service_rate import LengthShare, WaitAccuracy

log = logging.getLogger(__name__)
request_log = logging.getLogger("ballast.events.request")  # per-request events (quiet in text mode)

OUTCOMES = ("stop", "length", "abort", *REFUSAL_OUTCOMES)

# A prompt whose chunk fails for want of memory is retried with half the chunk, down to this;
# a chunk this small failing is not the prompt's size but the server's state: it is refused.
MIN_RETRY_CHUNK = 16


class SlotState(enum.Enum):
    FREE = "free"
    BUSY = "busy"
    DRAINING = "draining"


class SlotError(RuntimeError):
    """A slot was used against its state (a scheduler bug, never a client error)."""


class SlotTable:
    """The one owner of the engine's slots on the scheduler side: FREE, BUSY, or DRAINING (its
    request ended; the release travels in the next StepPlan). A draining slot is free only once
    that plan has run, so a slot is never reused while the engine may hold the old state."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("slot table needs at least one slot")
        self._state = [SlotState.FREE] * capacity
        self._in_release: set[int] = set()  # draining slots whose release is in a plan in flight

    @property
    def capacity(self) -> int:
        return len(self._state)

    def acquire(self, limit: int) -> int | None:
        """The lowest free slot below `limit`, now busy, or None. Lowest-first packs live slots at
        the bottom so a lowered ceiling is reached as requests finish."""
        for slot in range(min(limit, self.capacity)):
            if self._state[slot] is SlotState.FREE:
                self._state[slot] = SlotState.BUSY
                return slot
        return None

    def has_free(self, limit: int) -> bool:
        return any(st is SlotState.FREE for st in self._state[: max(0, limit)])

    def retire(self, slot: int) -> None:
        self._expect(slot, SlotState.BUSY)
        self._state[slot] = SlotState.DRAINING

    def take_releases(self) -> tuple[int, ...]:
        """Draining slots not yet sent: they go into the plan being built."""
        out = self._unsent_releases()
        self._in_release.update(out)
        return out

    def released(self, slots: tuple[int, ...]) -> None:
        for slot in slots:
            self._expect(slot, SlotState.DRAINING)
            self._in_release.discard(slot)
            self._state[slot] = SlotState.FREE

    def _unsent_releases(self) -> tuple[int, ...]:
        return tuple(
            s for s, st in enumerate(self._state) if st is SlotState.DRAINING and s not in self._in_release
        )

    def _expect(self, slot: int, state: SlotState) -> None:
        actual = self._state[slot] if 0 <= slot < self.capacity else None
        if actual is not state:
            found = "out of range" if actual is None else actual.value
            raise SlotError(f"slot {slot} is {found}, expected {state.value}")

    @property
    def busy(self) -> int:
        return self._state.count(SlotState.BUSY)

    @property
    def draining(self) -> int:
        return self._state.count(SlotState.DRAINING)

    @property
    def releases_pending(self) -> bool:
        return bool(self._unsent_releases())

    @property
    def highest_held(self) -> int:
        """1 + the highest slot not free (0 if all free): the engine may not shrink below it."""
        for slot in range(self.capacity - 1, -1, -1):
            if self._state[slot] is not SlotState.FREE:
                return slot + 1
        return 0

    @property
    def idle(self) -> bool:
        return all(st is SlotState.FREE for st in self._state)


class Roster:
    def __init__(
        self, slots: int, turns: TurnSaves, lengths: LengthShare, accuracy: WaitAccuracy, eos: frozenset[int]
    ) -> None:
        self.slots = SlotTable(slots)
        # FCFS: only the head is ever admitted (removal from the middle is an abort, a deadline or a
        # refusal). Preempted requests go back in front and may exceed the gate's max_queue.
        self.queue: deque[Seq] = deque()
        self.running: list[Seq] = []  # admission order: the FCFS order of prefill chunks
        self.by_slot: dict[int, Seq] = {}
        self._turns = turns
        self._eos = eos
        self.unpark: list[tuple[int, ...]] = []  # parked sequences to drop, for the next plan
        self.lengths = lengths  # how much of max_tokens finished requests used
        self.accuracy = accuracy  # how queued requests' first tokens came against their projection
        self.outcomes = dict.fromkeys(OUTCOMES, 0)
        self.preemptions = 0
        # Counted as each token is handed (/metrics reads it live); each request's share is its
        # completion_tokens, however it ended.
        self.generated_tokens = 0

    # --- where requests are -----------------------------------------------------------------
    def place(self, seq: Seq, slot_limit: int) -> None:
        slot = self.slots.acquire(slot_limit)
        assert slot is not None  # the gate saw a free one, and nothing ran in between
        self.queue.popleft()
        seq.slot, seq.phase = slot, Phase.PREFILLING
        self.running.append(seq)
        self.by_slot[slot] = seq

    def requeue(self, slot: int, preemption: bool = True) -> None:
        """The engine preempted the sequence in slot, or dropped it in a step that failed for want
        of memory (`preemption` False): it goes back to the queue head, later prefills prompt +
        output and goes on. Its client sees only the wait; it is never refused while waiting."""
        seq = self.by_slot.pop(slot, None)
        if seq is None:  # it finished while the step ran; its release is already on its way
            return
        self.running.remove(seq)
        self.slots.retire(slot)
        self.preemptions += preemption
        seq.slot, seq.phase, seq.prefilled, seq.kv_held = None, Phase.WAITING, 0, 0
        seq.resumed, seq.preempted = tuple(seq.output), True
        self.queue.appendleft(seq)

    def charges(self) -> list[Charge]:
        """What each running request holds and may still take of the KV pools."""
        return [Charge(s.total_tokens, s.kv_held, bool(s.int8_kv)) for s in self.running]

    def take_unpark(self) -> tuple[tuple[int, ...], ...]:
        out, self.unpark = tuple(self.unpark), []
        return out

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running and self.slots.idle

    # --- how requests end -------------------------------------------------------------------
    def count(self, refusal: Refused) -> None:
        self.outcomes[outcome_of(refusal)] += 1

    def finish(self, seq: Seq, reason: FinishReason, error: Refused | None = None) -> None:
        """End a request wherever it is: out of the queue or its slot, final text, FinishEvent."""
        if seq.phase is Phase.FINISHED:
            return
        if seq.phase is Phase.WAITING:
            self.queue.remove(seq)
            if seq.preempted:  # whatever the engine parked for it would never be resumed
                self.unpark.append(seq.feed)
        else:
            self._leave_slot(seq, completed=reason in ("stop", "length"))
            if reason in ("stop", "length"):
                self.lengths.finished(len(seq.output), seq.max_tokens)
        seq.phase = Phase.FINISHED
        if reason in ("stop", "length") and not seq.detok.stopped:
            try:
                tail = seq.detok.flush()
            except Exception as exc:  # the reader must still get its FinishEvent
                log.exception("request %s: flushing its text failed", seq.req.request_id)
                reason, error, tail = "error", RequestFailed(exc), ""
            if tail:
                seq.mailbox.put(TokenEvent(tail, ()))
        seq.mailbox.put(seq.finish_event(reason, error))
        self.outcomes[reason if error is None else outcome_of(error)] += 1

    def end_all(self, reason: FinishReason, error: Refused | None = None) -> None:
        for seq in [*self.queue, *self.running]:
            self.finish(seq, reason, error)

    def _leave_slot(self, seq: Seq, completed: bool) -> None:
        self.running.remove(seq)
        if seq.slot is None:
            return
        if completed and seq.phase is Phase.DECODING:
            self._turns.completed(seq)
        del self.by_slot[seq.slot]
        self.slots.retire(seq.slot)

    # --- a step's result --------------------------------------------------------------------
    def apply(self, plan: StepPlan, result: StepResult) -> None:
        self.slots.released(plan.release)
        if self._turns.after_ahead:  # turns waiting for a plan to feed their last token
            self._turns.ran(plan, result.preempted)
        for slot in result.preempted:
            self.requeue(slot)
        self._record_prompt_logprobs(result)
        self._deliver_tokens(plan, result)
        for seq in self.running:  # what the step's KV figures count for each running request
            seq.kv_held = seq.consumed_tokens

    def _record_prompt_logprobs(self, result: StepResult) -> None:
        for scored in result.prompt_logprobs:
            if (owner := self.by_slot.get(scored.slot)) is not None:
                tops = scored.top or ((),) * len(scored.logprobs)
                for pos, (lp, top) in enumerate(zip(scored.logprobs, tops, strict=True), scored.first_pos):
                    owner.prompt_logprobs[pos] = TokenLogprob(owner.req.prompt_ids[pos], lp, top)

    def _deliver_tokens(self, plan: StepPlan, result: StepResult) -> None:
        outputs: dict[int, list[SlotOutput]] = {}
        for out in result.outputs:  # a drafting slot has several, in order
            outputs.setdefault(out.slot, []).append(out)
        for slot in [d.slot for d in plan.decodes] + [p.slot for p in plan.prefills if p.sample]:
            seq = self.by_slot.get(slot)
            if seq is None:  # ended while the step ran (aborted, timed out) or preempted by it
                continue
            if slot not in outputs:
                raise RuntimeError(
                    f"engine returned no token for slot {slot} of request {seq.req.request_id}"
                )
            try:
                for out in outputs[slot]:  # tokens after one that ends the request are dropped
                    if seq.phase is Phase.FINISHED:
                        break
                    self._on_token(seq, out)
            except Exception as exc:  # its detokenizer failed: this request's error, not the engine's
                log.exception("request %s: output handling failed", seq.req.request_id)
                self.finish(seq, "error", RequestFailed(exc))

    def _on_token(self, seq: Seq, out: SlotOutput) -> None:
        seq.phase = Phase.DECODING
        seq.output.append(out.token_id)
        self.generated_tokens += 1
        if len(seq.output) == 1 and seq.projected_wait_s:
            waited = time.monotonic() - seq.submitted_at
            self.accuracy.first_token(seq.projected_wait_s, waited)
            rid, projected = seq.req.request_id, seq.projected_wait_s
            fields = {"event": "first_token", "request_id": rid, "waited_s": waited, "projected_s": projected}
            said = f"first token after {waited:.3f} s, projected {projected:.3f} s as queued"
            request_log.info("request %s: %s", rid, said, extra=fields)
        logprobs = None
        if seq.req.params.logprobs is not None and out.logprob is not None:
            logprobs = (TokenLogprob(out.token_id, out.logprob, out.top_logprobs),)
        if out.token_id in self._eos:
            # The EOS token is counted in usage, so its event (no text) comes before the finish:
            # a client scoring by logprobs sees every generated token, and the server sees that the
            # answer ended by EOS rather than by a stop string.
            seq.mailbox.put(TokenEvent("", (out.token_id,), logprobs))
            self.finish(seq, "stop")
            return
        text = seq.detok.add(out.token_id)
        seq.mailbox.put(TokenEvent(text, (out.token_id,), logprobs))
        if seq.detok.stopped:
            self.finish(seq, "stop")
        elif len(seq.output) >= seq.max_tokens or out.at_capacity:
            self.finish(seq, "length")

    def step_failed(self, plan: StepPlan, failed: StepFailed, retry_after_s: float) -> None:
        """The engine failed the step, dropped the sequences of `failed.slots` (a preempted one
        among them) and applied the releases. After a failure for want of memory they run again
        from their prompt, a prompt whose chunk was in the step with half the chunk, so one prompt
        too big costs only itself. A chunk already MIN_RETRY_CHUNK, a decode-only step failing
        twice, and any other failure (a bug hit by this batch) end with a retryable error."""
        self.slots.released(plan.release)
        self._turns.failed(plan)
        chunks = {p.slot: len(p.token_ids) for p in plan.prefills}
        # Latest admitted first: each goes to the queue's front, so they keep their order there.
        for seq in reversed([s for s in self.running if s.slot in failed.slots]):
            assert seq.slot is not None
            if failed.memory and _retries(seq, chunks.get(seq.slot), bool(chunks)):
                self.requeue(seq.slot, preemption=False)
            else:
                self.finish(seq, "error", StepAborted(retry_after_s, str(failed), len(seq.output)))


def _retries(seq: Seq, chunk: int | None, step_had_prompt: bool) -> bool:
    """Whether a request of a step that failed for want of memory runs again (see `step_failed`)."""
    if chunk is not None:  # its prompt chunk was in the step: the likely cause
        if chunk <= MIN_RETRY_CHUNK:
            return False
        seq.chunk_cap = max(MIN_RETRY_CHUNK, chunk // 2)
        return True
    if step_had_prompt:  # a decode beside the prompt that failed: not its fault
        return True
    seq.memory_strikes += 1  # a decode-only step failed: once may be a co-tenant's spike
    return seq.memory_strikes < 2
