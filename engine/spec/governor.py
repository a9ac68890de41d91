"""When drafting pays: the load rule, and the measured acceptance against measured step times.

A step of b decoding streams reads the weights once whatever it computes, so verifying drafts is
nearly free while a step is bound by reading weights (one stream, a few) and costs its compute
once the batch makes it so. Nobody knows the crossover in advance for a model and a machine, so it
is measured: for each batch size, the emitted tokens per second of steps with drafts against steps
without (an average over recent steps of each kind). Drafting goes on while it wins; a step of the
other kind now and then keeps both figures current. Beyond the measure, two rules: none from
`max_streams` decoding streams on, and none from WATCH on (a verify step's extra rows are
activations, memory the ladder is then taking back).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ballast.engine.plan import StepPlan, StepResult
from ballast.engine.spec.config import SpeculativeConfig
from ballast.memory.types import Level

# Weight of the newest step in each running average: small, because on a shared machine one step's
# time swings several-fold with other processes' load.
EMA = 0.1
# Steps of each kind a batch size needs before the two are compared.
MIN_STEPS = 4
# Every this many steps at a batch size, one of the kind not chosen (its figure goes stale); while
# drafting loses the gap doubles up to PROBE_MAX (a losing probe costs a verify step).
PROBE_EVERY = 24
PROBE_MAX = 384
# Longest step gap that counts as a step's time (a gap longer than this was idleness).
MAX_STEP_GAP_S = 5.0
# How far ahead to draft: position j (0-based) is drafted once drafts through j - 1 were all
# accepted in at least this share of recent rows (position 0 always; the length grows one
# position at a time as acceptance shows, like a slow start). Each verify row costs more the
# longer it is (on a compute-bound CPU step 1 / 2 / 4 drafts measured 1.1x / 1.6x / 2.9x a decode
# step), so a workload that rarely accepts drafts one token at a time, and the step-time
# comparison above weighs that cheap form against plain steps.
MIN_ACCEPTANCE = 0.3
# Weight of the newest row in each position's running acceptance (its first row sets it).
ACCEPT_EMA = 0.25


@dataclass
class _Rate:
    """Running averages of one kind of step at one batch size."""

    steps: int = 0
    seconds: float = 0.0
    tokens: float = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        w = 1.0 if self.steps == 0 else EMA
        self.seconds += w * (seconds - self.seconds)
        self.tokens += w * (tokens - self.tokens)
        self.steps += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


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
    # "loses" (measured slower at that batch size), "measuring" (a plain step to measure).
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


class DraftGovernor:
    """Decides per step whether decodes carry drafts; learns from each step's time and tokens."""

    def __init__(self, config: SpeculativeConfig | None) -> None:
        self.config = config
        self.stats = DraftStats()
        self._rates: dict[tuple[int, bool], _Rate] = {}
        self._since_probe: dict[int, int] = {}
        self._probe_gap: dict[int, int] = {}
        self._promised: int | None = None  # streams a lookahead was told to leave to a drafting plan
        self._last_result_at: float | None = None
        self._acceptance: list[float] = []  # per draft position, a running share accepted through it
        # The engine's MTP drafts, by slot: (the position the slot's next decode feeds, drafts).
        self.proposals: dict[int, tuple[int, tuple[int, ...]]] = {}
        self.reason = "off" if config is None else "measuring"  # why the last decision was what it was

    def wants(self, streams: int, level: Level, ahead: bool = False) -> bool:
        """Whether a step of `streams` decoding streams should draft. `ahead`: asked by the planner's
        lookahead, whose yes hands the step to the next full plan; that plan's ask then gets the
        same yes, so a probe decided there is not decided again."""
        promised, self._promised = self._promised, None
        if promised == streams and not ahead:
            return True
        drafting = self._wants(streams, level)
        if ahead and drafting:
            self._promised = streams
        return drafting

    def length(self) -> int:
        """Drafts to propose now: 1, and one more for each leading position whose recent
        acceptance (all drafts through it kept) is at least MIN_ACCEPTANCE; at most k."""
        k = self.config.num_speculative_tokens if self.config is not None else 0
        acc, n = self._acceptance, 1
        while n < k and n <= len(acc) and acc[n - 1] >= MIN_ACCEPTANCE:
            n += 1
        return n

    def _wants(self, streams: int, level: Level) -> bool:
        if self.config is None:
            return False
        if level >= Level.WATCH:
            return self._decide(False, "memory")
        if streams >= self.config.max_streams:
            return self._decide(False, "streams")
        drafting, plain = self._rate(streams, True), self._rate(streams, False)
        if drafting.steps < MIN_STEPS or plain.steps < MIN_STEPS:
            # A batch size not measured yet: where drafting loses at fewer streams it loses here too
            # (a bigger batch only makes the verify rows dearer).
            if any(self._loses(b) for b in range(1, streams)):
                return self._decide(False, "loses")
            return self._decide(drafting.steps < MIN_STEPS, "measuring")
        winner = drafting.per_second >= plain.per_second
        gap = self._probe_gap.get(streams, PROBE_EVERY)
        n = self._since_probe.get(streams, 0) + 1
        self._since_probe[streams] = 0 if n >= gap else n
        if n >= gap:  # the kind not chosen, once, to keep its figure current
            self._probe_gap[streams] = PROBE_EVERY if winner else min(PROBE_MAX, 2 * gap)
            return self._decide(not winner, "measuring")
        return self._decide(winner, "wins" if winner else "loses")

    def _loses(self, streams: int) -> bool:
        drafting, plain = self._rates.get((streams, True)), self._rates.get((streams, False))
        if drafting is None or plain is None or min(drafting.steps, plain.steps) < MIN_STEPS:
            return False
        return drafting.per_second < plain.per_second

    def _decide(self, draft: bool, reason: str) -> bool:
        self.reason = reason
        if not draft:
            self.stats.declined[reason] = self.stats.declined.get(reason, 0) + 1
        return draft

    def observe_step(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """Count what a finished step's decodes emitted (drafted, accepted) and time it; keep
        the drafts the engine proposed for the next step."""
        self.proposals = {slot: (pos, drafts) for slot, pos, drafts in result.proposals}
        emitted: dict[int, int] = {}
        for out in result.outputs:
            emitted[out.slot] = emitted.get(out.slot, 0) + 1
        ran = [d for d in plan.decodes if d.slot in emitted]
        for d in ran:
            if d.draft:
                self.stats.count(len(d.draft), emitted[d.slot] - 1)
                self._accepted(len(d.draft), emitted[d.slot] - 1)
        tokens = sum(emitted[d.slot] for d in ran)
        self.observe(len(ran), any(d.draft for d in ran), tokens, now, timed=not plan.prefills)

    def _accepted(self, drafts: int, accepted: int) -> None:
        acc = self._acceptance
        for j in range(drafts):
            kept = float(j < accepted)
            if j < len(acc):
                acc[j] += ACCEPT_EMA * (kept - acc[j])
            else:
                acc.append(kept)

    def observe(self, streams: int, drafted: bool, tokens: int, now: float, timed: bool) -> None:
        """A step came back at `now`: `streams` decoding rows, whether any carried drafts, the
        tokens they emitted. `timed`: the step was decodes alone, back to back with the previous
        result, so the gap is its time (a prefill or an idle gap is not a decode step's time)."""
        last, self._last_result_at = self._last_result_at, now
        if drafted:
            self.stats.steps_drafting += 1
        elif streams:
            self.stats.steps_plain += 1
        if not timed or last is None or streams == 0 or not 0 < now - last < MAX_STEP_GAP_S:
            return
        self._rate(streams, drafted).add(now - last, tokens)

    def idle(self) -> None:
        """Nothing ran: the next result's gap is not a step time."""
        self._last_result_at = None

    def _rate(self, streams: int, drafted: bool) -> _Rate:
        return self._rates.setdefault((streams, drafted), _Rate())
