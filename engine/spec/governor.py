"""When drafting pays: each sequence's acceptance, checked for free, against measured step costs.

A step of b decoding streams reads the weights once whatever it computes, so verifying drafts is
nearly free while a step is bound by reading weights (one stream, a few) and costs its compute
once the batch makes it so; and whether a draft is kept depends on the text (a copy keeps nine in
ten, a free story one in ten at its first position). Both are measured:
- acceptance, per sequence and draft position, for free: every decoding sequence has a proposal
  (prompt lookup, or the MTP layer's) checked against the tokens that actually come, whether the
  step verified drafts or not (a plain step checks one position of a standing proposal, a verify
  row its drafts and the token after them); a sequence's unchecked positions take all sequences';
- the cost of a drafted position at each batch size: the step time of drafting steps over their
  drafted positions against plain steps (medians of the last WINDOW steps of each kind).
A drafted position is worth its acceptance in tokens and costs c seconds where a plain step costs
t per token, so a sequence drafts the leading positions whose acceptance is at least c / t (in
one batch, a copy all k, a story none or one). Until a batch size's costs are measured it drafts
the positions with some acceptance to measure them; every PROBE_EVERY steps one of the kind not
chosen keeps both times current. Beyond the measure, two rules: none from `max_streams` decoding
streams on, and none from WATCH on (a verify step's extra rows are activations, memory the
ladder is then taking back).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ballast.engine.plan import StepPlan, StepResult
from ballast.engine.spec.config import SpeculativeConfig
from ballast.memory.types import Level

# Each kind of step at a batch size is judged by the medians of its last WINDOW steps: on a shared
# machine one step's time swings several-fold with other processes' load (a running average kept a
# spike for hundreds of steps: drafting "cost" 9x a step and stopped for good).
WINDOW = 9
# Steps of each kind a batch size needs before its costs count as measured.
MIN_STEPS = 4
# Every this many steps at a batch size, one of the kind not chosen (its times go stale otherwise).
PROBE_EVERY = 24
# Longest step gap that counts as a step's time (a gap longer than this was idleness).
MAX_STEP_GAP_S = 5.0
# The least acceptance a drafted position needs (while a batch size is measured, and as a floor):
# below it a draft is host work for nothing.
MIN_ACCEPTANCE = 0.05
# Weight of the newest check in each position's running acceptance (its first check sets it).
ACCEPT_EMA = 0.25


@dataclass
class _Rate:
    """One kind of step at one batch size: (seconds, tokens, positions drafted) of its last steps."""

    steps: int = 0
    last: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def add(self, seconds: float, tokens: int, drafts: int) -> None:
        self.last.append((seconds, tokens, drafts))
        self.steps += 1

    def median(self, i: int) -> float:
        return statistics.median(step[i] for step in self.last)


@dataclass
class DraftStats:
    """Counters for /metrics: drafts proposed and accepted, by position, and steps with drafts."""

    drafted: int = 0
    accepted: int = 0
    steps_drafting: int = 0
    steps_plain: int = 0
    drafted_at: list[int] = field(default_factory=list)  # position j (0-based): drafts proposed there
    accepted_at: list[int] = field(default_factory=list)
    # Decisions not to draft, by why: "streams" (the load rule), "memory" (WATCH and worse),
    # "loses" (no sequence's acceptance pays a draft's cost), "measuring" (a plain step to measure).
    declined: dict[str, int] = field(default_factory=dict)

    def count(self, drafts: int, accepted: int) -> None:
        self.drafted += drafts
        self.accepted += accepted
        while len(self.drafted_at) < drafts:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for j in range(drafts):
            self.drafted_at[j] += 1
            self.accepted_at[j] += int(j < accepted)

    def acceptance_at(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at, strict=True)]


def _learn(acc: list[float], j: int, kept: bool) -> None:
    if j < len(acc):
        acc[j] += ACCEPT_EMA * (kept - acc[j])
    elif j == len(acc):
        acc.append(float(kept))


class DraftGovernor:
    """Decides per step and sequence how many drafts a decode carries; learns from each step's
    time and tokens and from every proposal checked against the tokens that came."""

    def __init__(self, config: SpeculativeConfig | None) -> None:
        self.config = config
        self.stats = DraftStats()
        self._rates: dict[tuple[int, bool], _Rate] = {}
        self._since_probe: dict[int, int] = {}
        self._promised: int | None = None  # streams a lookahead was told to leave to a drafting plan
        self._last_result_at: float | None = None
        # Acceptance by draft position (the share of proposals kept through it): all sequences', and
        # each decoding slot's; the proposal each slot is checked against (position it starts at).
        self.acceptance: list[float] = []
        self._slot_acceptance: dict[int, list[float]] = {}
        self._checks: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._lengths: dict[int, int] = {}  # drafts by slot in the step `wants` said yes to
        # The engine's MTP drafts, by slot: (the position the slot's next decode feeds, drafts).
        self.proposals: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.reason = "off" if config is None else "measuring"  # why the last decision was what it was

    def wants(self, slots: Sequence[int], level: Level, ahead: bool = False) -> bool:
        """Whether a step of these decoding slots should draft (`length` says how far, by slot).
        `ahead`: asked by the planner's lookahead, whose yes hands the step to the next full plan;
        that plan's ask then gets the same yes, so a probe decided there is not decided again."""
        promised, self._promised = self._promised, None
        if promised == len(slots) and not ahead:
            return True
        drafting = self._wants(slots, level)
        if ahead and drafting:
            self._promised = len(slots)
        return drafting

    def length(self, slot: int) -> int:
        """Drafts the slot carries in the step `wants` said yes to."""
        return self._lengths.get(slot, 0)

    def _wants(self, slots: Sequence[int], level: Level) -> bool:
        self._lengths = {}
        if self.config is None:
            return False
        streams = len(slots)
        if level >= Level.WATCH:
            return self._decide(False, "memory")
        if streams >= self.config.max_streams:
            return self._decide(False, "streams")
        drafted, plain = self._rate(streams, True), self._rate(streams, False)
        measured = min(drafted.steps, plain.steps) >= MIN_STEPS
        if drafted.steps >= MIN_STEPS and not measured:
            return self._decide(False, "measuring")
        bar = MIN_ACCEPTANCE
        if measured:  # a drafted position's seconds over a plain step's seconds per token
            cost = max(0.0, drafted.median(0) - plain.median(0)) / max(drafted.median(2), 1.0)
            bar = max(bar, cost * plain.median(1) / plain.median(0))
        lengths = self._lengths_at(slots, bar)
        since = self._since_probe.get(streams, 0) + 1
        probe = measured and since >= PROBE_EVERY
        self._since_probe[streams] = 0 if probe else since
        if probe:  # once, the kind not chosen: its times go stale (a spike would stay)
            lengths = {} if lengths else self._lengths_at(slots, MIN_ACCEPTANCE)
        self._lengths = lengths
        if not lengths:
            return self._decide(False, "measuring" if probe else "loses")
        return self._decide(True, "wins" if measured and not probe else "measuring")

    def _lengths_at(self, slots: Sequence[int], bar: float) -> dict[int, int]:
        """Per slot, the leading positions whose acceptance (its own, else all sequences') reaches `bar`."""
        k = self.config.num_speculative_tokens if self.config else 0
        lengths: dict[int, int] = {}
        for slot in slots:
            own, n = self._slot_acceptance.get(slot, []), 0
            while n < k and (own[n] if n < len(own) else self._overall(n)) >= bar:
                n += 1
            if n:
                lengths[slot] = n
        return lengths

    def _overall(self, j: int) -> float:
        return self.acceptance[j] if j < len(self.acceptance) else 0.0

    def _decide(self, draft: bool, reason: str) -> bool:
        self.reason = reason
        if not draft:
            self.stats.declined[reason] = self.stats.declined.get(reason, 0) + 1
        return draft

    def needs_check(self, slot: int) -> bool:
        return slot not in self._checks

    def check(self, slot: int, pos: int, proposal: tuple[int, ...]) -> None:
        """Check `proposal` (what the slot's decodes from `pos` on would draft) against the tokens
        that come; a drafting row's drafts are its first positions."""
        if proposal:
            self._checks[slot] = (pos, proposal)

    def keep(self, slots: set[int]) -> None:
        """Forget the slots not decoding any more (a slot's next owner learns its own acceptance)."""
        for table in (self._checks, self._slot_acceptance):
            for slot in [s for s in table if s not in slots]:
                del table[slot]

    def _score(self, slot: int, pos: int, tokens: list[int]) -> None:
        """The tokens a decode at `pos` emitted against the slot's proposal: each position kept
        while they match; from the first that does not, the proposal is done (all rejected)."""
        at, proposal = self._checks.get(slot, (0, ()))
        j = pos - at
        if not 0 <= j < len(proposal):
            self._checks.pop(slot, None)
            return
        own = self._slot_acceptance.setdefault(slot, [])
        for token in tokens:
            kept = proposal[j] == token
            for i in range(j, j + 1 if kept else len(proposal)):
                _learn(own, i, kept)
                _learn(self.acceptance, i, kept)
            j += 1
            if not kept or j == len(proposal):
                del self._checks[slot]
                return

    def observe_step(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """Count what a finished step's decodes emitted (drafted, accepted), check the proposals
        and time it; keep the drafts the engine proposed for the next step."""
        self.proposals = {slot: (pos, drafts) for slot, pos, drafts in result.proposals}
        emitted: dict[int, list[int]] = {}
        for out in result.outputs:
            emitted.setdefault(out.slot, []).append(out.token_id)
        ran = [d for d in plan.decodes if d.slot in emitted]
        for d in ran:
            if d.draft:
                self.stats.count(len(d.draft), len(emitted[d.slot]) - 1)
            self._score(d.slot, d.pos, emitted[d.slot])
        tokens = sum(len(emitted[d.slot]) for d in ran)
        drafts = sum(len(d.draft) for d in ran)
        self.observe(len(ran), drafts, tokens, now, timed=not plan.prefills)

    def observe(self, streams: int, drafts: int, tokens: int, now: float, timed: bool) -> None:
        """A step came back at `now`: `streams` decoding rows, the positions they drafted, the
        tokens they emitted. `timed`: the step was decodes alone, back to back with the previous
        result, so the gap is its time (a prefill or an idle gap is not a decode step's time)."""
        last, self._last_result_at = self._last_result_at, now
        if drafts:
            self.stats.steps_drafting += 1
        elif streams:
            self.stats.steps_plain += 1
        if not timed or last is None or streams == 0 or not 0 < now - last < MAX_STEP_GAP_S:
            return
        self._rate(streams, drafts > 0).add(now - last, tokens, drafts)

    def idle(self) -> None:
        """Nothing ran: the next result's gap is not a step time."""
        self._last_result_at = None

    def _rate(self, streams: int, drafted: bool) -> _Rate:
        return self._rates.setdefault((streams, drafted), _Rate())
