"""Bringing an engine up, on the engine thread: load the model (or its shards), profile a prefill,
lease slot states and activations on every die before allocating them, build the runner and
capture its graphs, giving back whatever was leased if any of it fails. `assemble` then puts the
step's owners together around the runner.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from ballast.engine import threads
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.injected_faults import FaultInjector
from ballast.engine.kv.kv_budget import capacity_line, segment_grant
from ballast.engine.kv.prefix_cache import PrefixCache
from ballast.engine.parallel import tensor_parallel
from ballast.engine.runner.checkpoint_orders import CheckpointExecutor, build_cache
from ballast.engine.runner.executor import StepExecutor
from ballast.engine.runner.loading import LoadedModel, ModelSpecError, load
from ballast.engine.runner.model_runner import (
    ModelRunner,
    Profile,
    build_cost_model,
    planned_state_bytes,
    profile_prefill,
    vocab_size,
)
from ballast.engine.runner.slot_kv import SlotKV
from ballast.engine.runner.warm_up import warm_up
from ballast.engine.spec.mtp import DraftingModel, MTPDrafter
from ballast.engine.step.step_batch import check_slots
from ballast.engine.workspace import VerifySize, step_workspace
from ballast.memory import heap
from ballast.memory.ledger import Lease
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import CostModel
from ballast.memory.watch import MemWatch
from ballast.models.base import StepBatch
from ballast.models.layers import pointwise

log = logging.getLogger(__name__)

Parts = tuple[LoadedModel, ModelRunner, Profile, list[Lease]]


def bring_up(
    cfg: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    watch: MemWatch | None,
    dies: list[int],
    gpu_die: Callable[[], int | None],
    mtp: bool = False,
    verify: VerifySize | None = None,
) -> Parts:
    """dies: every GPU the engine's ranks use (empty on the host); gpu_die: the one admission
    checks, asked once the model is loaded; mtp: load the model's MTP layer to draft from; verify:
    the verify steps the recurrent states keep per-position states for (none under tensor
    parallel: the workers would have to roll back too, so a hybrid does not draft there)."""
    pointwise.set_enabled(cfg.compile)  # the decode graphs' capture compiles them
    if device.type == "cpu":
        set_cpu_threads(cfg.cpu_threads)
    quantized = cfg.kv_quant == "int8"  # the operator's choice alone: never the level at load
    workers = None
    verify = verify if verify is not None and cfg.tensor_parallel_size == 1 else VerifySize()
    if cfg.tensor_parallel_size > 1:
        if mtp:
            raise ModelSpecError("--speculative-config method 'mtp' is not built for tensor parallel")
        loaded, workers = tensor_parallel.load_sharded(cfg, device, dtype, quantized, watch)
    else:
        loaded = load(cfg, device, dtype, watch, mtp, verify)
    heap.trim()  # the load's staging is freed: its heap back to the OS, as the load estimate counts it
    cfg = loaded.config  # what fits, where the asked configuration did not
    leases = list(loaded.leases)
    try:
        profile = profile_prefill(
            loaded.model, loaded.hf_config, cfg.prefill_chunk_tokens, cfg.max_model_len, device, dtype
        )
        # Under tensor parallel only with --tp-cuda-graphs: every rank captures (tp_graphs). With
        # MTP each replay hands back the hidden states the drafter reads (graphs.decode.Leftover).
        graphs = cfg.decode_graphs(device)
        die = gpu_die()
        if watch is not None and die is not None:
            # Lease before allocating: the ledger refuses before the driver would OOM. Every
            # rank allocates the same slot states and activations on its own die.
            planned = planned_state_bytes(loaded.model, dtype, cfg.max_num_seqs, graphs, verify)
            workspace = step_workspace(cfg.max_num_seqs, vocab_size(loaded.model), dtype.itemsize)
            for tag, nbytes in (
                (f"slot-states:{loaded.source.name}", planned),
                ("activations", profile.peak_activation_bytes),
                ("sampler-workspace", workspace.sampler_bytes),
                ("prompt-logprobs", workspace.prompt_logprobs_bytes),
            ):
                leases.extend(tensor_parallel.lease_everywhere(watch, dies, nbytes, tag))
        acquire = None
        if watch is not None:
            acquire = (
                tensor_parallel.segment_grant_all(watch, dies, cfg.tensor_parallel_size)
                if workers is not None
                else segment_grant(watch, die)
            )
        args = (loaded.model, device, dtype, cfg.max_num_seqs, cfg.max_model_len, quantized)
        kwargs = {
            "scratch_slot": graphs,
            "acquire": acquire,
            "segment_bytes": cfg.kv_segment_bytes,
            "verify": verify,
        }
        runner = (
            tensor_parallel.ShardedRunner(*args, cfg.seed, workers=workers, **kwargs)
            if workers is not None
            else ModelRunner(*args, cfg.seed, **kwargs)
        )
        if graphs:
            leases.extend(runner.graph_runner.capture_at_start(watch, dies, cfg.prefill_graph_tokens(device)))
        if device.type == "cuda" and workers is None:  # Triton's kernels: none compiles after /ready
            warm_up(runner, cfg.prefill_chunk_tokens)
    except BaseException:
        for lease in leases:
            lease.release()
        if workers is not None:
            workers.close(timeout_s=2.0)
        raise
    return loaded, runner, profile, leases


def set_cpu_threads(configured: int) -> int:
    """Size torch's intra-op pool for this (the engine's) thread by `engine/threads`; logged."""
    share = threads.read_cpu_share()
    n = threads.intra_op_threads(share, configured)
    torch.set_num_threads(n)
    log.info("%s", threads.describe(share, n, configured))
    return n


@dataclass(frozen=True)
class LoadReport:
    """What loading found, for logs and the bench."""

    load_s: float
    weights_bytes: int
    state_bytes: int
    profile: Profile
    quantized_kv: bool


@dataclass(frozen=True)
class Assembled:
    """The step's owners, around one runner."""

    steps: StepExecutor
    cache: PrefixCache  # checkpoints (when prefix caching is on) and parked sequences (always)
    prefix_cache: PrefixCache | None  # the same object when prefix caching is on
    slot_kv: SlotKV
    cost_model: CostModel
    load_report: LoadReport
    capacity: str  # the start-up report of what memory holds (`capacity_line`), for the engine's log


def assemble(
    parts: Parts,
    cfg: EngineConfig,
    dtype: torch.dtype,
    watch: MemWatch | None,
    pool: CheckpointPool | None,
    prefix: PrefixCacheConfig,
    capacity_bytes: Callable[[], int],
    mtp_drafts: int = 0,
) -> Assembled:
    """pool: where the cache's buffers come from and go back to; capacity_bytes: what the KV pool
    could still be granted now (for the start-up report); mtp_drafts: drafts per step from the
    model's MTP layer (0: none)."""
    loaded, runner, profile, leases = parts
    block = runner.kv.layout.block_size if runner.kv is not None else 1
    cost = build_cost_model(loaded.model, dtype, profile, loaded.weights_bytes, block)
    report = LoadReport(loaded.load_s, loaded.weights_bytes, runner.state_bytes, profile, runner.quantized_kv)
    # One cache object holds prefix checkpoints (when prefix caching is on) and the sequences
    # parked by preemption (always): both are slot states kept in pool buffers.
    cache = build_cache(prefix, runner, cost, watch, pool, cfg, leases)
    prefix_cache = cache if prefix.enabled else None
    slot_kv = SlotKV(runner, cache, watch, ranks=cfg.tensor_parallel_size)
    checks = functools.partial(check_slots, cfg.max_num_seqs)
    orders = CheckpointExecutor(cache, prefix_cache, pool, slot_kv, runner, checks, cfg.max_model_len)
    if cfg.fault_specs:
        log.warning("BALLAST_FAULTS is set: injecting %s into engine steps", list(cfg.fault_specs))
    faults = FaultInjector(cfg.fault_specs, runner.device)
    mtp = None
    if mtp_drafts:
        kv = runner.kv_manager

        def ensure(slot: int, n: int) -> bool:
            return kv is None or slot_kv.pool_of(slot).ensure(slot, n)

        def place(batch: StepBatch) -> StepBatch:
            runner.mark_kv(batch)
            return batch.place(runner.device)

        model, rows = cast(DraftingModel, loaded.model), runner.verify.rows  # rows: the most that draft
        mtp = MTPDrafter(model, runner.states, mtp_drafts, ensure, place, cfg.max_model_len, rows)
    steps = StepExecutor(
        runner,
        runner.sampler,
        slot_kv,
        cache,
        prefix_cache,
        orders,
        pool,
        faults,
        leases,
        cfg.max_model_len,
        mtp,
    )
    workspace = step_workspace(cfg.max_num_seqs, runner.sampler.vocab_size, dtype.itemsize)
    room = capacity_bytes()
    n, length = cfg.max_num_seqs, cfg.max_model_len
    capacity = capacity_line(cost, runner.fixed_bytes, room, runner.quantized_kv, n, length, workspace)
    return Assembled(steps, cache, prefix_cache, slot_kv, cost, report, capacity)
