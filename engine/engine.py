"""The Engine: owns the device, the model runner and the one engine thread.

Every tensor operation (loading, profiling, allocation, each step) runs on a single-worker
executor, so no allocation or free can race a step in flight (the hazard the seed engine
catalogued). The scheduler talks to it only through frozen `StepPlan` / `StepResult` values.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from itertools import accumulate

import psutil
import torch
from ballast.engine.checkpoint_orders import CheckpointExecutor, build_cache
from ballast.engine.config import EngineConfig
from ballast.engine.detok import Detokenizer
from ballast.engine.errors import EngineUnhealthy, PlanError
from ballast.engine.faults import is_device_fault, is_memory_fault
from ballast.engine.injected_faults import FaultInjector
from ballast.engine.kv_budget import capacity_line
from ballast.engine.pipeline import DrawnRow, LaunchedStep, StepPipeline
from ballast.engine.plan import (
    LAST_SAMPLED,
    KVFigures,
    PrefillChunk,
    PromptLogprobs,
    SamplingParams,
    SlotOutput,
    StepFailed,
    StepPlan,
    StepResult,
)
from ballast.engine.prefix_cache import PrefixCacheConfig
from ballast.engine.runner import (
    Profile,
    build_cost_model,
)
from ballast.engine.sampler import Draw
from ballast.engine.sampling_defaults import sampling_defaults as defaults_for
from ballast.engine.slot_kv import SlotKV
from ballast.engine.staging import to_device
from ballast.engine.startup import Parts, bring_up
from ballast.engine.tokenizer import Tokenizer
from ballast.engine.workspace import step_workspace
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import CostModel
from ballast.memory.watch import MemWatch
from ballast.models.base import Rows

log = logging.getLogger(__name__)


# A "recoverable" fault that recurs in this many steps with work in a row is not recoverable: the
# engine calls itself unsound so /health fails and a supervisor restarts the process. Steps
# without work (a release-only plan follows every failure) neither count nor break the run.
MAX_CONSECUTIVE_STEP_FAILURES = 8


@dataclass(frozen=True)
class LoadReport:
    """What loading found, for logs and the bench."""

    load_s: float
    weights_bytes: int
    state_bytes: int
    profile: Profile
    quantized_kv: bool


class Engine:
    """Implements `ballast.engine.interface.EngineLike`. Build it with `Engine.load(config)`."""

    def __init__(
        self,
        config: EngineConfig,
        watch: MemWatch | None = None,
        *,
        prefix_cache: PrefixCacheConfig | None = None,
        pool: CheckpointPool | None = None,
    ) -> None:
        self.device = config.resolved_device()
        config = replace(config, prefill_chunk_tokens=config.resolved_prefill_chunk(self.device))
        self.config = config
        self._prefix_cfg = prefix_cache or PrefixCacheConfig()
        self._pool = pool
        self.dtype = config.resolved_dtype(self.device)
        self.num_slots = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self.slot_limit = config.max_num_seqs  # the ladder's max_slots: no sequence starts at or past it
        self._watch = watch
        self._healthy = True
        self.step_failures = 0  # steps that failed and were recovered (their requests lost)
        self.last_step_failure: str | None = None
        self._failures_in_a_row = 0
        self._faults = FaultInjector(config.fault_specs, self.device)
        if config.fault_specs:
            log.warning("BALLAST_FAULTS is set: injecting %s into engine steps", list(config.fault_specs))
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ballast-engine")
        self._pipeline = StepPipeline(
            self._executor, self.launch, self._finish_step, self._on_step_failure, _needs_host_tokens
        )
        # Slots whose sequence the last launched step preempted or dropped: a next plan built
        # before that step's result came back may still decode them from LAST_SAMPLED; skipped.
        self._gone: frozenset[int] = frozenset()
        # slot -> (position, token) of the last finished step's draws: a plan launched after that
        # finish names them LAST_SAMPLED, and the slot's fed record takes the token at once.
        self._settled: dict[int, tuple[int, int]] = {}
        # Loading touches tensors, so it too runs on the engine thread.
        try:
            parts = self._executor.submit(self._load).result()
        except BaseException:
            self._executor.shutdown(wait=False)
            raise
        self._setup(parts)

    @classmethod
    def load(
        cls,
        config: EngineConfig,
        watch: MemWatch | None = None,
        *,
        prefix_cache: PrefixCacheConfig | None = None,
        pool: CheckpointPool | None = None,
    ) -> Engine:
        """Load the model, profile a prefill, allocate slot states (the main KV pool in
        config.kv_quant's format). prefix_cache: the checkpoint cache's settings (default: on);
        pool: where its buffers come from and go back to."""
        return cls(config, watch, prefix_cache=prefix_cache, pool=pool)

    def _load(self) -> Parts:
        return bring_up(self.config, self.device, self.dtype, self._watch, self.dies, lambda: self.gpu_die)

    @property
    def dies(self) -> list[int]:
        """Every GPU this engine's ranks hold memory on, rank by rank (empty: it runs on the host)."""
        if self.device.type != "cuda":
            return []
        return [self._die() + r for r in range(self.config.tensor_parallel_size)]

    def _capacity_bytes(self) -> int:
        """What the KV pool could still be granted now (ledger headroom, or the host budget)."""
        if self._watch is None:
            return psutil.virtual_memory().available
        if self.device.type == "cuda":
            die = self.gpu_die
            assert die is not None
            return self._watch.ledger.headroom(die)
        return self._watch.read().host_budget_bytes

    @property
    def gpu_die(self) -> int | None:
        """The GPU whose ledger admission checks (None: it runs on the host). Under tensor
        parallel every die gets the same leases, so the die with the lowest ledger ceiling is the
        one that fills first: checking it checks every die."""
        dies = self.dies
        if len(dies) > 1 and self._watch is not None:
            return min(dies, key=self._watch.ledger.ceiling)
        return dies[0] if dies else None

    def _die(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _setup(self, parts: Parts) -> None:
        loaded, runner, profile, leases = parts
        self._loaded = loaded
        self.runner = runner
        self.model_name = loaded.source.name
        self._leases = leases
        self.cost_model: CostModel = build_cost_model(
            loaded.model,
            self.dtype,
            profile,
            loaded.weights_bytes,
            runner.kv.layout.block_size if runner.kv is not None else 1,
        )
        self.load_report = LoadReport(
            loaded.load_s, loaded.weights_bytes, runner.state_bytes, profile, runner.quantized_kv
        )
        # One cache object holds prefix checkpoints (when prefix caching is on) and the sequences
        # parked by preemption (always): both are slot states kept in pool buffers.
        self._cache = build_cache(
            self._prefix_cfg, self.runner, self.cost_model, self._watch, self._pool, self.config, self._leases
        )
        self.prefix_cache = self._cache if self._prefix_cfg.enabled else None
        self.checkpoint_interval = self._cache.interval if self.prefix_cache is not None else 0
        self.recurrent_state = self.cost_model.state_bytes_per_slot > 0
        self.quantized_kv = runner.quantized_kv
        self.decodes_ahead = self.config.tensor_parallel_size == 1
        self.slot_kv = SlotKV(self.runner, self._cache, self._watch, ranks=self.config.tensor_parallel_size)
        self._orders = CheckpointExecutor(
            self._cache,
            self.prefix_cache,
            self._pool,
            self.slot_kv,
            self.runner,
            self._check_slots,
            self.max_model_len,
        )
        # Cumulative figures: prompt tokens run through the model vs restored from checkpoints.
        self.prefilled_tokens = 0
        self.reused_tokens = 0
        log.info(
            "engine: %s on %s (%s), up to %d sequences x %d tokens, load %.2fs",
            self.model_name,
            self.device,
            self.dtype,
            self.num_slots,
            self.max_model_len,
            loaded.load_s,
        )
        log.info(
            "%s",
            capacity_line(
                self.cost_model,
                runner.fixed_bytes,
                self._capacity_bytes(),
                runner.quantized_kv,
                self.num_slots,
                self.max_model_len,
                step_workspace(self.num_slots, runner.sampler.vocab_size, self.dtype.itemsize),
            ),
        )

    # --- EngineLike ------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._loaded.tokenizer.get()

    @property
    def hf_config(self) -> dict[str, object]:
        """The model's Hugging Face-style config dict (from config.json, the GGUF, or built in)."""
        return dict(self._loaded.hf_config)

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, float]:
        """Sampling values for what a request omits (generation_config.json, or GGUF defaults)."""
        source = self._loaded.source
        return defaults_for(source.kind, source.path)

    @property
    def vocab_size(self) -> int:
        """Width of the logits the sampler draws from (may exceed the tokenizer's vocabulary)."""
        return self.runner.sampler.vocab_size

    @property
    def preemptions(self) -> int:
        """Sequences moved out of the KV pool for want of blocks (each resumed later)."""
        return self.slot_kv.preemptions

    @property
    def parked(self) -> int:
        """Of the preemptions, those parked in host buffers rather than recomputed."""
        return self.slot_kv.parked

    @property
    def healthy(self) -> bool:
        return self._healthy and self.runner.sound

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        if not self._healthy:
            failed: Future[StepResult] = Future()
            failed.set_exception(EngineUnhealthy("an earlier step failed; restart the engine"))
            return failed
        return self._pipeline.submit(plan)

    @property
    def overlapped_steps(self) -> int:
        """Steps launched while the previous step's tokens were still on their way."""
        return self._pipeline.overlapped

    def match_parked(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` a parked (preempted) sequence holds: restore them to resume it."""
        return self._cache.match_parked(tokens)

    def match_prefix(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens a restore would cover now (0: none, or prefix caching is off)."""
        return self.prefix_cache.match(prompt_ids) if self.prefix_cache is not None else 0

    def new_detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> Detokenizer:
        return self.tokenizer.new_detokenizer(prompt_ids, stop)

    def abandon(self) -> None:
        self.runner.abandon()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
        self.runner.release_graphs()
        self._cache.shed()  # buffers back to the pool, which the owner trims
        self._cache.unpark_all()
        if self._pool is not None:
            self._pool.free_copied(wait=True)  # nothing runs any more: wait for the last copies
        for pool in self.runner.pools:
            pool.close()  # segments' grants (ledger leases) released
        for lease in self._leases:
            lease.release()
        self.runner.close()

    # --- the step, on the engine thread ---------------------------------------------------------

    def _finish_step(self, launched: LaunchedStep) -> StepResult:
        result = self.finish(launched)
        if result.prefill_tokens or result.decode_tokens:
            self._failures_in_a_row = 0
        return result

    def _on_step_failure(self, plan: StepPlan, exc: BaseException) -> None:
        """A step raised. A device fault (or anything that is not an Exception) makes the engine
        unsound; otherwise the plan's sequences are dropped and StepFailed names them."""
        if isinstance(exc, EngineUnhealthy):
            return  # a plan queued behind the step that made the engine unsound
        if is_device_fault(exc) or not isinstance(exc, Exception):
            self._mark_unhealthy(f"device fault: {type(exc).__name__}")
            return
        if plan.prefills or plan.decodes:
            self._failures_in_a_row += 1
        self.step_failures += 1
        self.last_step_failure = f"{type(exc).__name__}: {exc}"
        if self._failures_in_a_row >= MAX_CONSECUTIVE_STEP_FAILURES:
            self._mark_unhealthy(f"{self._failures_in_a_row} steps in a row failed")
            return
        try:
            slots = self._recover(plan)
        except Exception:
            self._mark_unhealthy("recovery from a failed step failed")
            return
        log.warning(
            "engine step failed (%s); dropped the sequences of slots %s, serving on",
            self.last_step_failure,
            sorted(slots),
            exc_info=exc,
        )
        raise StepFailed(exc, slots, memory=is_memory_fault(exc)) from exc

    def _mark_unhealthy(self, why: str) -> None:
        # Nothing on the device can be trusted any more: the engine is unsound until restarted.
        self._healthy = False
        log.exception("engine step failed (%s); marking the engine unhealthy", why)

    def _recover(self, plan: StepPlan) -> frozenset[int]:
        """Undo what a failed step may have half done: every slot the plan named loses its
        sequence (blocks, states, sampler history; a sequence parked by a preemption in this step
        is dropped with it), and the plan's housekeeping (releases, unparks, shed) is applied so
        no buffer or block is left behind. Each of these is idempotent."""
        slots = _written_slots(plan)
        touched = sorted(s for s in slots | set(plan.release) if 0 <= s < self.num_slots)
        self._gone = frozenset(touched)
        for tokens in plan.unpark:
            self._cache.unpark(tokens)
        for fed in self.slot_kv.take_parked_in_step():  # parked under exactly what it was fed
            self._cache.drop_parked(fed)
        if plan.shed_prefix_cache and self.prefix_cache is not None:
            self.prefix_cache.shed()
        self._apply_slot_limit(plan)
        self.slot_kv.drop(touched)
        self._cache.before_writes(touched)
        self.runner.reset(touched)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # an OOM left the allocator's cache fragmented
        return slots

    def step(self, plan: StepPlan) -> StepResult:
        """Execute one plan and wait for its tokens. Call only on the engine thread, or in tests
        and benches (the server's plans go through `submit`, which overlaps steps)."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Everything of a step up to its sampled tokens' copy to the host, without waiting for the
        device: housekeeping, restores, blocks, the forward, the draw."""
        if not self._healthy:
            raise EngineUnhealthy("an earlier step failed; restart the engine")
        self.slot_kv.begin_step()
        if self._pool is not None:
            self._pool.free_copied()  # checkpoint buffers let go of whose copies have run since
        self._orders.shed(plan)
        self._apply_releases(plan)
        self._cache.before_writes(_written_slots(plan))  # checkpoint copies still reading them
        reused, unrestored = self._orders.restore(plan)
        gone = frozenset(d.slot for d in plan.decodes if d.token_id == LAST_SAMPLED and d.slot in self._gone)
        seqs, sampled = self._sequences(plan, unrestored | gone)
        preempted = self.slot_kv.take_blocks(plan, seqs) | unrestored
        if preempted:
            keep = [i for i, (slot, _, _) in enumerate(seqs) if slot not in preempted]
            seqs, sampled = [seqs[i] for i in keep], [sampled[i] for i in keep]
        self._gone = preempted | gone
        self._feed_settled(plan)
        asks = {p.slot: p for p in plan.prefills if p.logprob_targets and p.slot not in preempted}
        started = time.perf_counter()
        if seqs:
            self._faults.before_forward(prefill=any(p.slot not in preempted for p in plan.prefills))
        draw, rows, prompt_logprobs = self._forward(seqs, sampled, plan.sampling, asks)
        self._orders.save(plan, frozenset(plan.release) | preempted)
        prefill_tokens = sum(len(p.token_ids) for p in plan.prefills if p.slot not in preempted)
        self.prefilled_tokens += prefill_tokens
        self.reused_tokens += reused
        result = StepResult(
            prefill_tokens=prefill_tokens,
            decode_tokens=sum(d.slot not in preempted and d.slot not in gone for d in plan.decodes),
            reused_tokens=reused,
            forward_s=time.perf_counter() - started if seqs else 0.0,
            ledger_bytes=self._ledger_bytes(),
            preempted=tuple(sorted(preempted)),
            kv=self.kv_figures(),
            kv_int8=self.kv_figures(int8=True),
            prompt_logprobs=prompt_logprobs,
        )
        return LaunchedStep(plan, result, draw, rows, started)

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens (its one device-to-host copy) and complete its result.
        forward_s then runs from the forward's launch to the tokens' arrival."""
        if launched.draw is None:
            return launched.result
        tokens = self.runner.sampler.collect(launched.draw)
        outputs = []
        self._settled = {}
        for (slot, pos, at_capacity), tok in zip(launched.rows, tokens, strict=True):
            self.slot_kv.fed_at(slot, pos, tok.token_id)  # a next step that fed it as LAST_SAMPLED
            self._settled[slot] = (pos, tok.token_id)  # or one launched later
            outputs.append(SlotOutput(slot, tok.token_id, tok.logprob, tok.top_logprobs, at_capacity))
        return replace(
            launched.result, outputs=tuple(outputs), forward_s=time.perf_counter() - launched.started
        )

    def _feed_settled(self, plan: StepPlan) -> None:
        """A LAST_SAMPLED decode at the position of a token the last finished step drew: the
        slot's fed record takes that token now (finish recorded it before this plan named it)."""
        settled, self._settled = self._settled, {}
        for d in plan.decodes:
            drawn = settled.get(d.slot)
            if d.token_id == LAST_SAMPLED and drawn is not None and drawn[0] == d.pos:
                self.slot_kv.fed_at(d.slot, d.pos, drawn[1])

    def kv_figures(self, int8: bool = False) -> KVFigures | None:
        """A KV pool's figures now: the main one, or the int8 one new sequences use under pressure
        (None where there is none: no attention layers, or the main pool is int8 already)."""
        pool = self.runner.kv_int8 if int8 else self.runner.kv
        return pool.figures() if pool is not None else None

    def _forward(
        self,
        seqs: Rows,
        sampled: list[bool],
        sampling: dict[int, SamplingParams],
        asks: dict[int, PrefillChunk],
    ) -> tuple[Draw | None, tuple[DrawnRow, ...], tuple[PromptLogprobs, ...]]:
        if not seqs:
            return None, (), ()
        every = [slot in asks for slot, _, _ in seqs]
        logits = self.runner.forward(seqs, every)
        prompt_logprobs: tuple[PromptLogprobs, ...] = ()
        if asks:  # rows: every token of the sequences that asked, the last token of the others
            counts = [len(tokens) if e else 1 for (_, tokens, _), e in zip(seqs, every, strict=True)]
            ends = list(accumulate(counts))
            prompt_logprobs = tuple(
                _prompt_logprobs(asks[slot], logits[end - count : end])
                for (slot, _, _), count, end in zip(seqs, counts, ends, strict=True)
                if slot in asks
            )
            logits = logits.index_select(0, torch.tensor([e - 1 for e in ends], device=logits.device))
        draw, rows = self._draw(seqs, sampled, logits, sampling)
        return draw, rows, prompt_logprobs

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
        self._check_slots(plan.release)
        # A finished request's checkpoint travels with its slot's release: save it first, while
        # the slot still holds the blocks.
        released = replace(plan, saves=tuple(s for s in plan.saves if s.slot in plan.release))
        self._orders.save(released, frozenset())
        self.runner.sampler.reset(plan.release)
        self.slot_kv.drop(plan.release)
        if plan.shrink_kv:
            # TIGHT and worse: free segments beyond what the scheduler's requests are about to take
            # go back to the device / host at once; CRITICAL keeps nothing free, so the pools shrink
            # to what running sequences hold.
            self.slot_kv.shrink(plan.kv_keep)

    def _sequences(
        self, plan: StepPlan, skip: frozenset[int]
    ) -> tuple[list[tuple[int, Sequence[int], int]], list[bool]]:
        """(slot, tokens, start) per sequence in plan order (prefills, then decodes; slots in
        `skip` left out), and whether each one samples a token. Slots starting a new sequence are
        reset first."""
        seqs: list[tuple[int, Sequence[int], int]] = []
        sampled: list[bool] = []
        for p in (p for p in plan.prefills if p.slot not in skip):
            seqs.append((p.slot, p.token_ids, p.start_pos))
            sampled.append(p.sample)
        for d in (d for d in plan.decodes if d.slot not in skip):
            seqs.append((d.slot, (d.token_id,), d.pos))
            sampled.append(True)
        self._check_slots([s for s, _, _ in seqs])
        vocab = self.runner.sampler.vocab_size
        from_device = {d.slot for d in plan.decodes if d.token_id == LAST_SAMPLED}
        for slot, tokens, start in seqs:
            if not tokens:
                raise PlanError(f"slot {slot}: a prefill chunk of no tokens")
            if start + len(tokens) > self.max_model_len:
                raise PlanError(
                    f"slot {slot}: positions up to {start + len(tokens) - 1} exceed max_model_len "
                    f"{self.max_model_len}"
                )
            if slot in from_device and not self.runner.sampler.has_drawn(slot):
                raise PlanError(f"slot {slot}: a LAST_SAMPLED decode, but the slot has drawn no token")
            if (min(tokens) < 0 and slot not in from_device) or max(tokens) >= vocab:
                raise PlanError(f"slot {slot}: token ids must be in 0..{vocab - 1}")
        fresh = [p for p in plan.prefills if p.start_pos == 0]
        self.slot_kv.start([p.slot for p in fresh], [p.int8_kv for p in fresh])
        self.runner.reset([p.slot for p in fresh])
        for p in plan.prefills:
            if p.slot not in skip:
                self.runner.sampler.observe_prompt(p.slot, p.token_ids)
        return seqs, sampled

    def _check_slots(self, slots: Sequence[int]) -> None:
        bad = [s for s in slots if not 0 <= s < self.num_slots]
        if bad:
            raise PlanError(f"slots {bad} out of range 0..{self.num_slots - 1}")

    def _draw(
        self, seqs: Rows, sampled: list[bool], logits: torch.Tensor, sampling: dict[int, SamplingParams]
    ) -> tuple[Draw | None, tuple[DrawnRow, ...]]:
        """Queue the draw of the rows that sample, and name each drawn row (`DrawnRow`)."""
        rows = [i for i, s in enumerate(sampled) if s]
        if not rows:
            return None, ()
        slots = [seqs[i][0] for i in rows]
        missing = [s for s in slots if s not in sampling]
        if missing:
            raise PlanError(f"no sampling params for slots {missing}")
        if len(rows) != len(seqs):
            logits = logits.index_select(0, to_device(rows, torch.long, logits.device))
        draw = self.runner.sampler.draw(logits, slots, [sampling[s] for s in slots])
        ends = [seqs[i][2] + len(seqs[i][1]) for i in rows]
        return draw, tuple(
            (slot, end, end >= self.max_model_len) for slot, end in zip(slots, ends, strict=True)
        )

    def _ledger_bytes(self) -> int:
        return sum(lease.nbytes for lease in self._leases if not lease.released)


def _written_slots(plan: StepPlan) -> frozenset[int]:
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


def _needs_host_tokens(plan: StepPlan) -> bool:
    """A grammar row's matcher must consume the slot's previous token before its mask is built."""
    return any(p.constraint is not None for p in plan.sampling.values())
