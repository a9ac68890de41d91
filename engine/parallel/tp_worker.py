"""A tensor-parallel worker: ranks 1..N-1 of an engine whose rank 0 is the server's `Engine`.

A worker loads its shard and allocates the same slot states as rank 0 (same settings, same KV
layout), then loops: receive a `StepMessage`, replay rank 0's KV store changes and slot-state
copies in rank 0's order (its allocator decided them, so block ids agree on every rank), and run
the same forward on its shard (or replay the decode graph named). It samples nothing: rank 0 does.
Steps come over a pipe, not a collective, so an idle worker waits without a timeout and leaves
when rank 0 goes (the pipe reads end of file).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist
from ballast.engine.config import EngineConfig
from ballast.engine.injected_faults import FaultInjector
from ballast.engine.kv.shard_checkpoints import CheckpointOp, ShardCheckpoints
from ballast.engine.parallel.split_admission import DieNeed
from ballast.engine.parallel.tp_graphs import (
    CaptureGraphs,
    ReleaseGraphs,
    ReportGraphs,
    capture_as_worker,
    replay_as_rank0,
    report,
)
from ballast.engine.runner.loading import ModelLoadRefused
from ballast.engine.runner.model_runner import ModelRunner, profile_prefill, weights_bytes
from ballast.models.arch import builtin
from ballast.models.arch.parallel import Fp8Spec, ShardPlan, TPGroup, build_shard
from ballast.models.arch.registry import model_class
from ballast.models.base import ForwardBatch
from ballast.models.kv_store import StoreOp
from ballast.models.layers import pointwise
from ballast.models.weights.hf_loader import HFCheckpoint, inspect_hf_dir
from ballast.models.weights.shard_loading import load_full_into_shard, load_hf_shard
from torch import nn

log = logging.getLogger(__name__)

# A collective that waits longer than this for a peer fails (the engine then calls itself
# unsound). Generous: the first forward on CUDA compiles kernels on every rank at once.
COLLECTIVE_TIMEOUT_S = 120


@dataclass(frozen=True)
class StepMessage:
    """One forward, as rank 0 runs it: rows (slot, token ids, start); `ops`, rank 0's changes since
    the previous forward, in order (a store op names its store by `KVManager.stores` index); graph:
    the (batch, context) decode graph rank 0 replays (None: eager)."""

    rows: list[tuple[int, tuple[int, ...], int]]
    all_logits: list[bool]
    ops: list[StoreOp | CheckpointOp]
    int8_slots: list[int] = field(default_factory=list)
    graph: tuple[int, int] | None = None


@dataclass(frozen=True)
class Stop:
    """Rank 0 is shutting down: leave the loop and the process group."""


@dataclass(frozen=True)
class WorkerReady:
    """A worker's report once its shard is loaded: what its die holds (CUDA), for rank 0's ledger."""

    rank: int
    weights_bytes: int
    die: int | None = None
    die_total_bytes: int = 0
    die_free_bytes_before: int = 0


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    error: str


def device_of_rank(config: EngineConfig, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU after rank 0's (cuda:k -> cuda:k+r), or on the CPU."""
    base = config.resolved_device()
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def init_group(rank: int, world: int, address: str, device: torch.device) -> TPGroup:
    """Join the process group: NCCL between GPUs (device i = rank i), gloo on the CPU."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        device = torch.device(
            "cuda", device.index if device.index is not None else torch.cuda.current_device()
        )
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(
        backend,
        init_method=address,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        **kwargs,
    )
    return TPGroup(rank, world)


def load_shard(
    config: EngineConfig, tp: TPGroup, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, dict[str, Any]]:
    """This rank's shard of config.model. A small built-in model is generated whole and cut (so it
    is the model one device serves); a large one is drawn shard by shard from one seed (so the
    replicated weights agree); an HF directory is read in safetensors slices, never whole."""
    from ballast.engine.runner.loading import resolve

    source = resolve(config.model)
    ep = config.expert_parallel
    if source.kind == "builtin":
        hf = builtin.builtin_config(source.name)
        model = build_shard(hf, tp, dtype, device, expert_parallel=ep)
        if _parameters(hf) > builtin.DEVICE_INIT_PARAMS:
            builtin.init_random(model, int(hf.get("seed", 0)))
        else:
            full = builtin.build_builtin(source.name, dtype=torch.float32, device="cpu")
            load_full_into_shard(model, full.state_dict(), ShardPlan(hf, tp.rank, tp.world, ep))
            del full
    elif source.kind == "hf":
        assert source.path is not None
        ckpt = inspect_hf_dir(source.path)
        hf = ckpt.config
        model = build_shard(hf, tp, dtype, device, kept_fp8(ckpt, config, device), ep)
        load_hf_shard(model, ckpt, ShardPlan(hf, tp.rank, tp.world, ep))
    else:
        raise ValueError(f"tensor parallel serves built-in and Hugging Face models, not {source.kind}")
    return model.eval(), dict(hf)


def _parameters(hf: dict[str, Any]) -> int:
    """Parameters of the whole model (counted on the meta device)."""
    with torch.device("meta"):
        return sum(p.numel() for p in model_class(hf).from_hf_config(hf).parameters())


def kept_fp8(ckpt: HFCheckpoint, config: EngineConfig, device: torch.device) -> Fp8Spec | None:
    """Which parameters keep an FP8 checkpoint's float8 weights (None: none, they are dequantized)."""
    if not ckpt.scales or not config.keeps_fp8(device):
        return None
    return ckpt.fp8_params().__contains__, ckpt.fp8_block


def apply_ops(runner: ModelRunner, checkpoints: ShardCheckpoints, ops: list[StoreOp | CheckpointOp]) -> None:
    """Make rank 0's KV store changes and slot-state copies here, in its order."""
    kv = runner.kv_manager
    for op in ops:
        if isinstance(op, CheckpointOp):
            checkpoints.apply(op)
        else:
            assert kv is not None, "KV store changes sent to a model without attention"
            kv.stores[op.store].replay(op)


def worker_main(
    rank: int,
    world: int,
    address: str,
    config: EngineConfig,
    quantized_kv: bool,
    conn: Connection,
    need: DieNeed | None = None,
) -> None:
    """The process body of rank `rank` (spawned by `TPWorkers`). With `need`, its die is
    admitted on the driver's free figure before any of its weights move there."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    device = device_of_rank(config, rank)
    dtype = config.resolved_dtype(device)
    try:
        tp = init_group(rank, world, address, device)
        pointwise.set_enabled(config.compile)
        free_before, total = torch.cuda.mem_get_info(device) if device.type == "cuda" else (0, 0)
        if need is not None and device.type == "cuda":
            verdict = need.verdict({device.index or 0: int(free_before)})
            if not verdict.admitted:
                raise ModelLoadRefused(verdict)
        model, hf = load_shard(config, tp, device, dtype)
        conn.send(
            WorkerReady(
                rank,
                weights_bytes(model),
                device.index if device.type == "cuda" else None,
                int(total),
                int(free_before),
            )
        )
    except Exception as e:  # reported to rank 0, which fails the load with it
        log.exception("loading the shard failed")
        conn.send(WorkerFailed(rank, f"{type(e).__name__}: {e}"))
        sys.exit(1)
    profile_prefill(model, hf, config.prefill_chunk_tokens, config.max_model_len, device, dtype)
    runner = ModelRunner(
        model,
        device,
        dtype,
        config.max_num_seqs,
        config.max_model_len,
        quantized_kv,
        config.seed,
        scratch_slot=config.decode_graphs(device),  # as rank 0's runner: the same slot states
        segment_bytes=config.kv_segment_bytes,
    )
    serve(runner, conn, FaultInjector(config.fault_specs, device, rank))
    dist.destroy_process_group()


def serve(runner: ModelRunner, conn: Connection, faults: FaultInjector | None = None) -> None:
    """Run rank 0's forwards until it says Stop or goes away. A failure here ends the process:
    rank 0 sees its peer gone in the next collective and calls the engine unsound."""
    # where this rank keeps its shard of rank 0's checkpoints and parked sequences
    stores = runner.kv_manager.stores if runner.kv_manager is not None else []
    checkpoints = ShardCheckpoints(runner.states, stores, runner.device)
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            os._exit(0)
        if isinstance(msg, Stop):
            return
        if isinstance(msg, CaptureGraphs):
            apply_ops(runner, checkpoints, msg.ops)  # the scratch slot's blocks first
            capture_as_worker(runner.graph_runner, conn)
        elif isinstance(msg, ReleaseGraphs):
            runner.graph_runner.release_graphs()
        elif isinstance(msg, ReportGraphs):
            conn.send(report(runner.graph_runner))
        else:
            step(runner, checkpoints, msg, faults)


def step(
    runner: ModelRunner, checkpoints: ShardCheckpoints, msg: StepMessage, faults: FaultInjector | None = None
) -> None:
    """Rank 0's forward on this shard, after its ops and int8 slots: its graph, or eagerly."""
    apply_ops(runner, checkpoints, msg.ops)
    if runner.kv_manager is not None:
        runner.kv_manager.set_int8(msg.int8_slots)
    if faults is not None and msg.rows:
        faults.before_forward(prefill=any(len(tokens) > 1 for _, tokens, _ in msg.rows))
    if msg.graph is not None:
        replay_as_rank0(runner.graph_runner, msg.rows, msg.graph)
        return
    # Not runner.forward: its check that each slot holds blocks asks this rank's allocator,
    # which never allocates (rank 0's does; its tables came with the message).
    batch = ForwardBatch.of(msg.rows, all_logits=msg.all_logits)
    runner.mark_kv(batch)
    runner._run(batch)
