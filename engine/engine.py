"""The Engine: owns the device, the model runner and the one engine thread.

Every tensor operation (loading, profiling, allocation, each step) runs on a single-worker
executor, so no allocation or free can race a step in flight. The engine keeps the thread, its
health and `submit`; a step itself is the `StepExecutor`'s (`startup.assemble`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING

import psutil
import torch
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.plan import EngineUnhealthy, KVFigures, StepPlan, StepResult
from ballast.engine.runner.executor import needs_host_tokens
from ballast.engine.startup import Parts, VerifySize, assemble, bring_up
from ballast.engine.step.pipeline import LaunchedStep, StepPipeline
from ballast.engine.text.sampling_defaults import sampling_defaults as defaults_for
from ballast.memory.pool import CheckpointPool
from ballast.memory.watch import MemWatch

if TYPE_CHECKING:
    from ballast.engine.text.detok import Detokenizer
    from ballast.engine.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Engine:
    """Implements `ballast.engine.interface.EngineLike`. Build it with `Engine.load(config)`."""

    def __init__(
        self,
        config: EngineConfig,
        watch: MemWatch | None = None,
        *,
        prefix_cache: PrefixCacheConfig | None = None,
        pool: CheckpointPool | None = None,
        mtp_drafts: int = 0,
        verify: VerifySize | None = None,
    ) -> None:
        self.mtp_drafts = mtp_drafts  # drafts per step from the model's MTP layer (0: none)
        self.verify = verify or VerifySize()  # the verify workspace's size (none: a hybrid cannot draft)
        self.device = config.resolved_device()
        self.busy_prefill_chunk_tokens = config.resolved_busy_prefill_chunk(self.device)
        config = replace(config, prefill_chunk_tokens=config.resolved_prefill_chunk(self.device))
        self.config = config
        self._prefix_cfg = prefix_cache or PrefixCacheConfig()
        self._pool = pool
        self.dtype = config.resolved_dtype(self.device)
        self.num_slots = config.max_num_seqs
        self.max_model_len = config.max_model_len
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self._watch = watch
        self._healthy = True
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ballast-engine")
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
        mtp_drafts: int = 0,
        verify: VerifySize | None = None,
    ) -> Engine:
        """Load the model, profile a prefill, allocate slot states. prefix_cache: the checkpoint
        cache's settings (default: on); pool: where its buffers come from and go back to;
        mtp_drafts: load the model's MTP layer and draft this many tokens a step from it (the
        scheduler's `--speculative-config` method "mtp"); verify: the verify steps to size the
        recurrent states' rollback workspace for (`SpeculativeConfig.verify_size`)."""
        return cls(config, watch, prefix_cache=prefix_cache, pool=pool, mtp_drafts=mtp_drafts, verify=verify)

    def _load(self) -> Parts:
        return bring_up(
            self.config,
            self.device,
            self.dtype,
            self._watch,
            self.dies,
            lambda: self.gpu_die,
            self.mtp_drafts > 0,
            self.verify,
        )

    @property
    def dies(self) -> list[int]:
        """Every GPU this engine's ranks hold memory on, rank by rank (empty: it runs on the host)."""
        if self.device.type != "cuda":
            return []
        first = self.device.index if self.device.index is not None else torch.cuda.current_device()
        return [first + r for r in range(self.config.tensor_parallel_size)]

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
        """The GPU whose ledger admission checks (None: the host). Under tensor parallel every die
        gets the same leases, so the one with the lowest ceiling fills first: it speaks for all."""
        dies = self.dies
        if len(dies) > 1 and self._watch is not None:
            return min(dies, key=self._watch.ledger.ceiling)
        return dies[0] if dies else None

    def _setup(self, parts: Parts) -> None:
        loaded, runner, _, _ = parts
        self._loaded = loaded
        if loaded.config != self.config:  # fitted to memory at load (engine/runner/load_fit)
            self.config = cfg = loaded.config
            self.num_slots, self.max_model_len = cfg.max_num_seqs, cfg.max_model_len
            self.prefill_chunk_tokens = cfg.prefill_chunk_tokens
            self.busy_prefill_chunk_tokens = min(self.busy_prefill_chunk_tokens, cfg.prefill_chunk_tokens)
        self.runner = runner
        self.verify = runner.verify  # what start-up allocated (none under tensor parallel)
        self.model_name = loaded.source.name
        log.info(
            "engine: %s on %s (%s), up to %d sequences x %d tokens, load %.2fs",
            self.model_name,
            self.device,
            self.dtype,
            self.num_slots,
            self.max_model_len,
            loaded.load_s,
        )
        built = assemble(
            parts,
            self.config,
            self.dtype,
            self._watch,
            self._pool,
            self._prefix_cfg,
            self._capacity_bytes,
            self.mtp_drafts,
        )
        self._steps = built.steps
        self.vocab_size = built.steps.vocab_size
        self._cache = built.cache
        self.prefix_cache = built.prefix_cache
        self.slot_kv = built.slot_kv
        self.cost_model = built.cost_model
        self.load_report = built.load_report
        self.checkpoint_interval = self._cache.interval if self.prefix_cache is not None else 0
        self.recurrent_state = self.cost_model.state_bytes_per_slot > 0
        self.quantized_kv = runner.quantized_kv
        # An MTP drafter reads each step's tokens before the next step runs: no step ahead.
        self.decodes_ahead = self.config.tensor_parallel_size == 1 and not self.mtp_drafts
        log.info("%s", built.capacity)
        self._pipeline = StepPipeline(
            self._executor, self.launch, self._steps.finish, self._on_step_failure, needs_host_tokens
        )

    # --- EngineLike ------------------------------------------------------------------------

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens run through the model so far (`reused_tokens`: restored instead)."""
        return self._steps.prefilled_tokens

    @property
    def reused_tokens(self) -> int:
        return self._steps.reused_tokens

    @property
    def tokenizer(self) -> Tokenizer:
        return self._loaded.tokenizer.get()

    @property
    def hf_config(self) -> dict[str, object]:
        """The model's Hugging Face-style config dict (from config.json, the GGUF, or built in)."""
        return dict(self._loaded.hf_config)

    @functools.cached_property
    def sampling_defaults(self) -> dict[str, float]:
        source = self._loaded.source
        return defaults_for(source.kind, source.path)

    def new_detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> Detokenizer:
        return self.tokenizer.new_detokenizer(prompt_ids, stop)

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
        return self._cache.parked.match(tokens)

    def match_prefix(self, prompt_ids: Sequence[int]) -> int:
        return self.prefix_cache.match(prompt_ids) if self.prefix_cache is not None else 0

    def kv_figures(self, int8: bool = False) -> KVFigures | None:
        return self._steps.kv_figures(int8)

    def abandon(self) -> None:
        self.runner.abandon()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)
        self._steps.close()

    # --- the step, on the engine thread ---------------------------------------------------------

    def step(self, plan: StepPlan) -> StepResult:
        """Execute one plan and wait for its tokens. Call only on the engine thread, or in tests
        and benches (the server's plans go through `submit`, which overlaps steps)."""
        return self.finish(self.launch(plan))

    def launch(self, plan: StepPlan) -> LaunchedStep:
        """A step up to its sampled tokens' copy to the host, without waiting for the device."""
        if not self._healthy:
            raise EngineUnhealthy("an earlier step failed; restart the engine")
        return self._steps.launch(plan)

    def finish(self, launched: LaunchedStep) -> StepResult:
        """Wait for a launched step's tokens and complete its result."""
        return self._steps.finish(launched)

    def _on_step_failure(self, plan: StepPlan, exc: BaseException) -> None:
        """A step raised: the engine is unsound, or StepFailed names the sequences dropped."""
        if isinstance(exc, EngineUnhealthy):
            return  # a plan queued behind the step that made the engine unsound
        outcome = self._steps.failed(plan, exc)
        if isinstance(outcome, str):
            # Nothing on the device can be trusted any more: the engine is unsound until restarted.
            self._healthy = False
            log.exception("engine step failed (%s); marking the engine unhealthy", outcome)
            return
        raise outcome from exc
