"""The next step's plan: a decode token per decoding request, then prefill chunks of admitted
and newly admitted requests within the token budget; with them the checkpoint orders, the slot
releases and the ladder's KV and slot changes.

The lookahead: while every running request decodes, step N+1 is planned before N's tokens are
back, each decode fed from the device (`DecodeToken.ahead`), so the GPU goes from N to N+1 without
waiting for the host. A request whose N token ends it (EOS, a stop string, an abort) has its N+1
row computed and dropped: one wasted row against a host round trip saved every step. One that N
brings to max_tokens or the context's end is known to finish and is left out.
"""

from __future__ import annotations

import itertools

from ballast.engine.interface import EngineLike
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan, StepResult
from ballast.engine.spec.config import FLAG
from ballast.engine.spec.governor import DraftGovernor
from ballast.engine.spec.ngram import propose
from ballast.memory.types import Level
from ballast.scheduler.checkpoints import CheckpointPlanner
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.gate import AdmissionGate
from ballast.scheduler.governor import Governor
from ballast.scheduler.kv_policy import KVPolicy
from ballast.scheduler.prompt_budget import PromptBudget
from ballast.scheduler.roster import Roster
from ballast.scheduler.sequence import Phase, Seq

from ballast.settings import ConfigError

# Tokens per prefill chunk of a request that scores its prompt: the model returns a row of
# logits (vocabulary-sized, float32) for every one of them.
PROMPT_LOGPROBS_CHUNK = 256


class StepPlanner:
    def __init__(
        self,
        engine: EngineLike,
        config: SchedulerConfig,
        roster: Roster,
        gate: AdmissionGate,
        gov: Governor,
        checkpoints: CheckpointPlanner,
        kv: KVPolicy,
        prompt_budget: PromptBudget,
        drafts: DraftGovernor | None = None,
    ) -> None:
        self._engine = engine
        self._prompt_budget = prompt_budget
        self.drafts = drafts or DraftGovernor(config.speculative)
        spec = self.drafts.config
        if spec is not None and spec.method == "mtp" and not getattr(engine, "mtp_drafts", 0):
            raise ConfigError(
                f"{FLAG}: method 'mtp' drafts from the engine's MTP layer, and this engine was "
                "loaded without one (Engine.load(..., mtp_drafts=k))"
            )
        if spec is not None and engine.recurrent_state:
            spec.check_verify(getattr(engine, "verify", None), engine.num_slots)
        self._roster = roster
        self._gate = gate
        self._gov = gov
        self._checkpoints = checkpoints
        self._kv = kv
        self._overlap = config.overlap and engine.decodes_ahead
        self._per_step = config.max_num_batched_tokens or max(
            engine.prefill_chunk_tokens, config.max_num_seqs
        )
        # The max_slots the engine applies now; unknown until the first plan states it (another
        # scheduler may have driven this engine, with another limit).
        self._engine_slots = 0

    def plan(self, admit: bool) -> StepPlan:
        """Decodes, then prefill chunks of the oldest admitted requests, then admissions from the
        queue head (when `admit`) while budget and slots remain."""
        roster = self._roster
        decoding = [seq for seq in roster.running if seq.phase is Phase.DECODING and seq.slot is not None]
        slots = [seq.slot for seq in decoding if seq.slot is not None]
        drafting = bool(slots) and self.drafts.wants(slots, self._gov.ladder.level)
        decodes = tuple(self._decode(seq, drafting) for seq in decoding)
        engine = self._engine
        # beside decodes, the prompt tokens that keep the step within the ITL target
        chunk = (
            self._prompt_budget.tokens(engine.busy_prefill_chunk_tokens, len(decodes))
            if decodes
            else engine.prefill_chunk_tokens
        )
        budget = min(self._per_step - sum(1 + len(d.draft) for d in decodes), chunk)
        unfinished = [s for s in roster.running if s.phase is Phase.PREFILLING and s.prefilled < len(s.feed)]
        admitted = iter(self._gate.admit_head, None) if admit else ()
        to_prefill = itertools.chain(unfinished, admitted)
        prefills: list[PrefillChunk] = []
        while budget > 0 and (seq := next(to_prefill, None)) is not None:  # admits a head only here
            prefills.append(self._next_chunk(seq, budget))
            budget -= len(prefills[-1].token_ids)
        rows: tuple[DecodeToken | PrefillChunk, ...] = (*decodes, *prefills)
        sampling = {row.slot: roster.by_slot[row.slot].req.params for row in rows}
        shed, saves, restores = self._checkpoints.take_orders()
        if drafting and saves:  # a checkpoint is of what the step feeds: no draft beside one
            saved = {s.slot for s in saves}
            decodes = tuple(DecodeToken(d.slot, d.token_id, d.pos) if d.slot in saved else d for d in decodes)
        release = roster.slots.take_releases()
        upcoming = itertools.islice(roster.queue, self._gate.slot_limit)
        shrink, keep = self._kv.shrink(bool(release), roster.charges(), upcoming)
        return StepPlan(
            prefills=tuple(prefills),
            decodes=decodes,
            sampling=sampling,
            release=release,
            restores=restores,
            saves=saves,
            max_slots=self._engine_slot_change(),
            shed_prefix_cache=shed,
            shrink_kv=shrink,
            kv_keep=keep,
            unpark=roster.take_unpark(),
        )

    def _decode(self, seq: Seq, drafting: bool) -> DecodeToken:
        """The seq's decode: its last sampled token at the position after what it consumed, and
        when drafting, the drafts the governor gives it (never past max_tokens or the context)."""
        assert seq.slot is not None
        pos = seq.consumed_tokens
        room = min(
            self.drafts.length(seq.slot) if drafting else 0,
            seq.max_tokens - len(seq.output) - 1,
            self._engine.max_model_len - 1 - pos,
        )
        draft: tuple[int, ...] = ()
        if room > 0:
            proposal = self._proposal(seq, pos)
            self.drafts.check(seq.slot, pos, proposal)  # its positions past the drafts checked too
            draft = proposal[:room]
        return DecodeToken(seq.slot, seq.output[-1], pos, draft)

    def _proposal(self, seq: Seq, pos: int) -> tuple[int, ...]:
        """k drafts for the seq's decode at `pos`: the engine's MTP drafts made for it, or prompt lookup."""
        config = self.drafts.config
        assert config is not None and seq.slot is not None
        if config.method == "mtp":  # the engine's, from the last step, if made for this position
            at, proposed = self.drafts.proposals.get(seq.slot, (-1, ()))
            return proposed if at == pos else ()
        context = (*seq.req.prompt_ids, *seq.output)
        k = config.num_speculative_tokens
        return propose(context, k, config.prompt_lookup_min, config.prompt_lookup_max)

    def observed(self, plan: StepPlan, result: StepResult, now: float) -> None:
        """After a step is applied: the governor learns from it, and every decoding seq without a
        proposal under check gets one (checked against the tokens to come: acceptance for free,
        while it drafts or not; none where it could not draft anyway)."""
        drafts = self.drafts
        drafts.observe_step(plan, result, now)
        if drafts.config is None:
            return
        decoding = {
            s.slot: s for s in self._roster.running if s.phase is Phase.DECODING and s.slot is not None
        }
        drafts.keep(set(decoding))
        if len(decoding) < drafts.config.max_streams and self._gov.ladder.level < Level.WATCH:
            for slot, seq in decoding.items():
                if drafts.needs_check(slot):
                    drafts.check(slot, seq.consumed_tokens, self._proposal(seq, seq.consumed_tokens))

    def _next_chunk(self, seq: Seq, budget: int) -> PrefillChunk:
        """The seq's next prefill chunk, at most `budget` tokens (the first restores a cached prefix)."""
        assert seq.slot is not None
        prompt = seq.feed
        # The prefix cache holds main-pool blocks: int8 sequences neither save nor restore; nor do
        # requests that score their prompt (every position's logits are needed).
        scoring = seq.req.prompt_logprobs is not None
        cached = not seq.int8_kv and not scoring
        if scoring:  # the model returns logits for every token of the chunk: keep those rows few
            budget = min(budget, PROMPT_LOGPROBS_CHUNK)
        if seq.chunk_cap:  # a chunk of it failed for want of memory: smaller ones now
            budget = min(budget, seq.chunk_cap)
        if seq.preempted and seq.prefilled == 0 and (n := self._engine.match_parked(prompt)) > 0:
            self._checkpoints.queue_resume(seq.slot, prompt[:n])  # parked when preempted: no recompute
            seq.prefilled = n
        elif cached and seq.prefilled == 0 and (n := self._checkpoints.queue_restore(seq.slot, prompt)) > 0:
            seq.prefilled = n
            if not seq.resumed:
                seq.cached = n
        end = min(len(prompt), seq.prefilled + budget)
        if cached:
            end = self._checkpoints.end_chunk_at_checkpoint(seq.slot, prompt, seq.prefilled, end, seq.cached)
        chunk = PrefillChunk(
            seq.slot,
            prompt[seq.prefilled : end],
            seq.prefilled,
            sample=end == len(prompt),
            int8_kv=bool(seq.int8_kv),
            logprob_targets=seq.req.prompt_ids[seq.prefilled + 1 : end + 1] if scoring else (),
            top_logprobs=seq.req.prompt_logprobs or 0,
        )
        seq.prefilled = end
        return chunk

    def lookahead(self, plan: StepPlan, closing: bool) -> StepPlan | None:
        """The decode-only plan after `plan`, built before its tokens are back; None unless only
        decoding goes on (no queue, release or checkpoint to send, the ladder at rest, every
        running request sampling in `plan`) and one request at least goes on past it."""
        roster = self._roster
        if (
            not self._overlap
            or closing
            or roster.queue
            or roster.unpark
            or roster.slots.releases_pending
            or self._gov.ladder.level is not Level.OK
            or self.engine_slots_wanted != self._engine_slots
            or any(d.draft for d in plan.decodes)  # where its drafts end is known only after it
        ):
            return None
        running = {seq.slot: seq for seq in roster.running if seq.slot is not None}
        rows = [(d.slot, d.pos + 1) for d in plan.decodes]
        rows += [(p.slot, p.start_pos + len(p.token_ids)) for p in plan.prefills if p.sample]
        if {slot for slot, _ in rows} != set(running) or self._drafts_next([slot for slot, _ in rows]):
            return None  # (a drafting plan needs the host's tokens)
        decodes = []
        sampling: dict[int, SamplingParams] = {}
        for slot, pos in rows:
            seq = running[slot]  # its output does not count plan's token yet
            if len(seq.output) + 1 < seq.max_tokens and pos < self._engine.max_model_len:
                decodes.append(DecodeToken.ahead(slot, pos))
                sampling[slot] = seq.req.params
        return StepPlan(decodes=tuple(decodes), sampling=sampling) if decodes else None

    def _drafts_next(self, slots: list[int]) -> bool:
        return self.drafts.wants(slots, self._gov.ladder.level, ahead=True)

    @property
    def engine_slots_wanted(self) -> int:
        """The slot limit the engine should apply now: the ladder's, never below a held slot."""
        return max(self._gate.slot_limit, self._roster.slots.highest_held)

    def _engine_slot_change(self) -> int | None:
        want = self.engine_slots_wanted
        if want == self._engine_slots:
            return None
        self._engine_slots = want
        return want
