"""One plan's step on the engine thread, in two halves (`StepPipeline` overlaps them): `launch`
does everything on the host up to the sampled tokens' copy (housekeeping, restores, blocks, the
batch, the forward, the draw), `finish` waits for that copy and completes the result. A step that
raises is undone by `failed`, which says whether the engine is still sound. It holds no tensors.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from itertools import accumulate

import torch
from ballast.engine.faults import is_device_fault, is_memory_fault
from ballast.engine.injected_faults import FaultInjector
from ballast.engine.kv.prefix_cache import PrefixCache
from ballast.engine.plan import (
    KVFigures,
    PlanError,
    PrefillChunk,
    PromptLogprobs,
    SamplingParams,
    SlotOutput,
    StepFailed,
    StepPlan,
    StepResult,
)
from ballast.engine.runner.checkpoint_orders import CheckpointExecutor
from ballast.engine.runner.model_runner import ModelRunner
from ballast.engine.runner.slot_kv import SlotKV
from ballast.engine.spec.mtp import MTPDrafter
from ballast.engine.spec.step import DraftVerifier
from ballast.engine.step.pipeline import DrawnRow, LaunchedStep
from ballast.engine.step.sampler import Draw, Sampler
from ballast.engine.step.step_batch import DeviceFed, build_batch, check_slots
from ballast.memory.ledger import Lease
from ballast.memory.pool import CheckpointPool
from ballast.models.base import StepBatch, to_device

log = logging.getLogger(__name__)

# A "recoverable" fault that recurs in this many steps with work in a row is not recoverable: the
# engine calls itself unsound so /health fails and a supervisor restarts the process. Steps
# without work (a release-only plan follows every failure) neither count nor break the run.
MAX_CONSECUTIVE_STEP_FAILURES = 8


class StepExecutor:
    """Launches and finishes the steps of one engine (engine thread only)."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        slot_kv: SlotKV,
        cache: PrefixCache,
        prefix_cache: PrefixCache | None,
        orders: CheckpointExecutor,
        pool: CheckpointPool | None,
        faults: FaultInjector,
        leases: list[Lease],
        max_model_len: int,
        mtp: MTPDrafter | None = None,
    ) -> None:
        self._runner = runner
        self._mtp = mtp  # drafts for the next step from the model's MTP layer (None: none)
        self._sampler = sampler
        self._slot_kv = slot_kv
        self._cache = cache
        self._prefix_cache = prefix_cache  # the cache itself when prefix caching is on
        self._orders = orders
        self._pool = pool
        self._faults = faults
        self._leases = leases
        self._fed = DeviceFed(slot_kv.fed_at)
        self._drafts = DraftVerifier(sampler, runner.states, slot_kv.truncate, max_model_len, runner.verify)
        self.num_slots = runner.num_slots
        self.max_model_len = max_model_len
        self.slot_limit = runner.num_slots  # the ladder's max_slots: no sequence starts at or past it
        self.step_failures = 0  # steps that failed and were recovered (their requests lost)
        self.last_step_failure: str | None = None
        self._failures_in_a_row = 0
        # Cumulative figures: prompt tokens run through the model vs restored from checkpoints.
        self.prefilled_tokens = 0
        self.reused_tokens = 0

    @property
    def vocab_size(self) -> int:
        """Width of the logits the sampler draws from (may exceed the tokenizer's vocabulary)."""
        return self._sampler.vocab_size

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """A step up to its sampled tokens' copy to the host, without waiting for the device."""
        self._slot_kv.begin_step()
        if self._pool is not None:
            self._pool.free_copied()  # checkpoint buffers let go of whose copies have run since
        self._orders.shed(plan)
        self._apply_releases(plan)
        self._cache.before_writes(written_slots(plan))  # checkpoint copies still reading them
        reused, unrestored = self._orders.restore(plan)
        gone = self._fed.skipped(plan)
        batch = self._batch(plan, unrestored | gone)
        preempted = unrestored
        if batch is not None:
            preempted = self._slot_kv.take_blocks(plan, batch) | unrestored
            if preempted and preempted & set(batch.slots_list):  # the step runs without them
                batch = self._build(plan, preempted | gone)
        self._fed.launched(plan, preempted | gone)
        self._drafts.before(plan, preempted | gone, batch)
        asks = {p.slot: p for p in plan.prefills if p.logprob_targets and p.slot not in preempted}
        if batch is not None:
            self._faults.before_forward(prefill=any(p.slot not in preempted for p in plan.prefills))
        draw, rows, prompt_logprobs, verified = self._forward(batch, plan.sampling, asks)
        self._orders.save(plan, frozenset(plan.release) | preempted)
        prefill_tokens = sum(len(p.token_ids) for p in plan.prefills if p.slot not in preempted)
        self.prefilled_tokens += prefill_tokens
        self.reused_tokens += reused
        result = StepResult(
            prefill_tokens=prefill_tokens,
            decode_tokens=sum(d.slot not in preempted and d.slot not in gone for d in plan.decodes),
            reused_tokens=reused,
            ledger_bytes=sum(lease.nbytes for lease in self._leases if not lease.released),
            preempted=tuple(sorted(preempted)),
            kv=self.kv_figures(),
            kv_int8=self.kv_figures(int8=True),
            prompt_logprobs=prompt_logprobs,
            outputs=verified,  # drafting rows' tokens, final now; the draw's join them in `finish`
        )
        return LaunchedStep(plan, result, draw, rows)

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (its one device-to-host copy) and complete its result."""
        result = launched.result
        if launched.draw is not None:
            tokens = self._sampler.collect(launched.draw)
            self._fed.finished(launched.rows, [tok.token_id for tok in tokens])
            outputs = tuple(
                SlotOutput(slot, tok.token_id, tok.logprob, tok.top_logprobs, at_capacity)
                for (slot, _, at_capacity), tok in zip(launched.rows, tokens, strict=True)
            )
            result = replace(result, outputs=outputs + result.outputs)
        if self._mtp is not None:
            drafting = frozenset(d.slot for d in launched.plan.decodes if d.draft)
            try:
                result = replace(result, proposals=self._mtp.propose(result.outputs, drafting))
            except Exception as exc:  # the step's tokens stand; short of memory, no drafts this time
                if not is_memory_fault(exc) or is_device_fault(exc):
                    raise
                log.warning("MTP drafts skipped for want of memory: %s", exc)
                self._mtp.forget()
        if result.prefill_tokens or result.decode_tokens:
            self._failures_in_a_row = 0
        return result

    def failed(self, plan: StepPlan, exc: BaseException) -> str | StepFailed:
        """A step raised: why the engine is unsound now, or, once the plan's sequences are
        dropped, the StepFailed that names them."""
        if is_device_fault(exc) or not isinstance(exc, Exception):
            return f"device fault: {type(exc).__name__}"
        if plan.prefills or plan.decodes:
            self._failures_in_a_row += 1
        self.step_failures += 1
        self.last_step_failure = f"{type(exc).__name__}: {exc}"
        if self._failures_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
            return f"{self._failures_in_a_row} steps in a row failed"
        try:
            slots = self._recover(plan)
        except Exception:
            return "recovery from a failed step failed"
        log.warning(
            "engine step failed (%s); dropped the sequences of slots %s, serving on",
            self.last_step_failure,
            sorted(slots),
            exc_info=exc,
        )
        return StepFailed(exc, slots, memory=is_memory_fault(exc))

    def _recover(self, plan: StepPlan) -> frozenset[int]:
        """Undo what a failed step may have half done: every slot the plan named loses its sequence
        (one parked in this step too), and the plan's releases, unparks and shed are applied so no
        buffer or block is left behind. Each of these is idempotent."""
        slots = written_slots(plan)
        self._drafts.forget()
        touched = sorted(s for s in slots | set(plan.release) if 0 <= s < self.num_slots)
        if self._mtp is not None:
            self._mtp.forget()
            self._mtp.drop(touched)
        self._fed.dropped(frozenset(touched))
        for tokens in plan.unpark:
            self._cache.parked.unpark(tokens)
        for fed in self._slot_kv.take_parked_in_step():  # parked under exactly what it was fed
            self._cache.parked.drop(fed)
        if plan.shed_prefix_cache and self._prefix_cache is not None:
            self._prefix_cache.shed()
        self._apply_slot_limit(plan)
        self._slot_kv.drop(touched)
        self._cache.before_writes(touched)
        self._runner.reset(touched)
        if self._runner.device.type == "cuda":
            torch.cuda.empty_cache()  # an OOM left the allocator's cache fragmented
        return slots

    def kv_figures(self, int8: bool = False) -> KVFigures | None:
        """A KV pool's figures now: the main one, or the int8 one new sequences use under pressure
        (None where there is none: no attention layers, or the main pool is int8 already)."""
        pool = self._runner.kv_int8 if int8 else self._runner.kv
        return pool.figures() if pool is not None else None

    def close(self) -> None:
        """Once the engine thread is done: let go of everything the steps held."""
        self._runner.graph_runner.release_graphs()
        self._cache.shed()  # buffers back to the pool, which the owner trims
        self._cache.parked.drop_all()
        if self._pool is not None:
            self._pool.free_copied(wait=True)  # nothing runs any more: wait for the last copies
        for pool in self._runner.pools:
            pool.close()  # segments' grants (ledger leases) released
        for lease in self._leases:
            lease.release()
        self._runner.close()

    def _forward(
        self, batch: StepBatch | None, sampling: dict[int, SamplingParams], asks: dict[int, PrefillChunk]
    ) -> tuple[Draw | None, tuple[DrawnRow, ...], tuple[PromptLogprobs, ...], tuple[SlotOutput, ...]]:
        if batch is None:
            if self._mtp is not None:
                self._mtp.ran(None)
            return None, (), (), ()
        logits = self._runner.forward(batch)
        if self._mtp is not None:
            self._mtp.ran(batch)
        prompt_logprobs: tuple[PromptLogprobs, ...] = ()
        verified: tuple[SlotOutput, ...] = ()
        if batch.all_logits:  # rows: every token of the sequences that asked or draft, the last of the others
            counts = [n if e else 1 for n, e in zip(batch.lens_list, batch.all_logits, strict=True)]
            ends = list(accumulate(counts))
            every = {
                slot: logits[end - count : end]
                for slot, count, end, e in zip(batch.slots_list, counts, ends, batch.all_logits, strict=True)
                if e
            }
            prompt_logprobs = tuple(
                _prompt_logprobs(asks[slot], every[slot]) for slot in every if slot in asks
            )
            logits = logits.index_select(0, torch.tensor([e - 1 for e in ends], device=logits.device))
            verified = self._drafts.after({s: rows for s, rows in every.items() if s not in asks}, sampling)
        return (*self._draw(batch, logits, sampling), prompt_logprobs, verified)

    def _apply_slot_limit(self, plan: StepPlan) -> None:
        """The ladder's slot limit, as the plan resizes it (running sequences keep their slots)."""
        if plan.max_slots is not None:
            self.slot_limit = max(1, min(self.num_slots, plan.max_slots))

    def _apply_releases(self, plan: StepPlan) -> None:
        self._apply_slot_limit(plan)
        starting = {p.slot for p in plan.prefills if p.start_pos == 0} | {r.slot for r in plan.restores}
        beyond = sorted(s for s in starting if s >= self.slot_limit)
        if beyond:  # the scheduler admits under the ladder's limit: a plan past it is a bug there
            raise PlanError(f"slots {beyond} start sequences past the ladder's slot limit {self.slot_limit}")
        check_slots(self.num_slots, plan.release)
        # A finished request's checkpoint travels with its slot's release: save it first, while
        # the slot still holds the blocks.
        released = replace(plan, saves=tuple(s for s in plan.saves if s.slot in plan.release))
        self._orders.save(released, frozenset())
        self._sampler.reset(plan.release)
        self._slot_kv.drop(plan.release)
        if self._mtp is not None:
            self._mtp.drop(plan.release)
        if plan.shrink_kv:
            # TIGHT and worse: free segments beyond what the scheduler's requests are about to take
            # go back to the device / host at once; CRITICAL keeps nothing free, so the pools shrink
            # to what running sequences hold.
            self._slot_kv.shrink(plan.kv_keep)

    def _batch(self, plan: StepPlan, skip: frozenset[int]) -> StepBatch | None:
        """The step's batch, slots in `skip` left out; slots starting a new sequence are reset."""
        batch = self._build(plan, skip)
        fresh = [p for p in plan.prefills if p.start_pos == 0]
        self._slot_kv.start([p.slot for p in fresh], [p.int8_kv for p in fresh])
        self._runner.reset([p.slot for p in fresh])
        for p in plan.prefills:
            if p.slot not in skip:
                self._sampler.observe_prompt(p.slot, p.token_ids)
        return batch

    def _build(self, plan: StepPlan, skip: frozenset[int]) -> StepBatch | None:
        return build_batch(plan, skip, self.num_slots, self.max_model_len, self._sampler)

    def _draw(
        self, batch: StepBatch, logits: torch.Tensor, sampling: dict[int, SamplingParams]
    ) -> tuple[Draw | None, tuple[DrawnRow, ...]]:
        """Queue the draw of the rows that sample, and name each drawn row (`DrawnRow`)."""
        rows = [i for i, s in enumerate(batch.sampled) if s]
        if not rows:
            return None, ()
        slots = [batch.slots_list[i] for i in rows]
        missing = [s for s in slots if s not in sampling]
        if missing:
            raise PlanError(f"no sampling params for slots {missing}")
        if len(rows) != batch.num_seqs:
            logits = logits.index_select(0, to_device(rows, torch.long, logits.device))
        draw = self._sampler.draw(logits, slots, [sampling[s] for s in slots])
        ends = [batch.starts_list[i] + batch.lens_list[i] for i in rows]
        return draw, tuple(
            (slot, end, end >= self.max_model_len) for slot, end in zip(slots, ends, strict=True)
        )


def written_slots(plan: StepPlan) -> frozenset[int]:
    """Slots whose states the step writes: every sequence it runs, every slot it restores into."""
    slots = [p.slot for p in plan.prefills] + [d.slot for d in plan.decodes] + [r.slot for r in plan.restores]
    return frozenset(slots)


def _prompt_logprobs(chunk: PrefillChunk, logits: torch.Tensor) -> PromptLogprobs:
    """The model's logprob of each prompt token the chunk's positions predict (the raw model: no
    logit bias, penalty or temperature), with the most likely alternatives."""
    targets = chunk.logprob_targets
    logprobs = torch.log_softmax(logits[: len(targets)].float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor(targets, device=logprobs.device)[:, None])[:, 0].tolist()
    top: tuple[tuple[tuple[int, float], ...], ...] = ()
    if chunk.top_logprobs:
        values, ids = logprobs.topk(chunk.top_logprobs, dim=-1)
        top = tuple(tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True))
    return PromptLogprobs(chunk.slot, chunk.start_pos + 1, tuple(picked), top)


def needs_host_tokens(plan: StepPlan) -> bool:
    """A grammar row's matcher must consume the slot's previous token before its mask is built."""
    return any(p.constraint is not None for p in plan.sampling.values())
