"""Rank 0 of a tensor-parallel engine: the workers it spawns (`TPWorkers`, ranks 1..N-1 in
`tp_worker`), its shard, and its runner (`ShardedRunner`, which sends each step and the KV and
checkpoint journal to every worker, so all ranks run the same forward on the same block tables).

Every die is governed from rank 0: it leases what each worker's die holds on that die's ledger,
and grants a KV segment only when every die has room. A worker that dies (or a failed collective)
makes the engine unsound: the forward raises `WorkerLost`, and `sound` turns False as soon as the
watchdog sees a worker gone, even while idle.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from ballast.engine.config import EngineConfig
from ballast.engine.kv.kv_budget import segment_grant
from ballast.engine.kv.kv_pool import Acquire
from ballast.engine.parallel.sharded_runner import ShardedRunner as ShardedRunner  # rank 0's runner
from ballast.engine.parallel.split_admission import admit_split, die_need
from ballast.engine.parallel.tp_worker import (
    init_group,
    kept_fp8,
    load_shard,
)
from ballast.engine.parallel.workers import TPWorkers
from ballast.engine.runner.loading import (
    LoadedModel,
    ModelSpecError,
    admit_load,
    die_index,
    lazy_tokenizer,
    resolve,
)
from ballast.engine.runner.model_runner import weights_bytes
from ballast.memory.config import MemoryConfig
from ballast.memory.errors import LedgerFull
from ballast.memory.host_book import HostGrant
from ballast.memory.ledger import Lease
from ballast.memory.watch import MemWatch
from ballast.models.arch import builtin
from ballast.models.arch.parallel import check_tensor_parallel, shard_hf_config, shard_weights_bytes
from ballast.models.base import UnsupportedModel
from ballast.models.weights.hf_loader import inspect_hf_dir

log = logging.getLogger(__name__)


def load_sharded(
    config: EngineConfig, device: torch.device, dtype: torch.dtype, quantized_kv: bool, watch: MemWatch | None
) -> tuple[LoadedModel, TPWorkers]:
    """Spawn the workers, join the group, admit and load rank 0's shard while they load theirs,
    and lease every die's weights on its ledger."""
    source = resolve(config.model)
    if source.kind not in ("builtin", "hf"):
        raise ModelSpecError(f"tensor parallel serves built-in and Hugging Face models, not {source.kind}")
    # the tokenizer's directory: --tokenizer's, else the model's (a built-in's is the default model's)
    tok_dir = source.path if config.tokenizer is None else Path(config.tokenizer)
    if config.tokenizer is not None and not Path(config.tokenizer).is_dir():
        raise ModelSpecError(f"--tokenizer {tok_dir} is not a directory")
    t0 = time.perf_counter()
    fp8 = None
    if source.kind == "builtin":
        hf = builtin.builtin_config(source.name)
        if hf.get("quantization_config"):
            raise UnsupportedModel(
                "tensor parallel serves FP8 checkpoints from a Hugging Face directory, not FP8 built-ins"
            )
    else:
        assert source.path is not None
        ckpt = inspect_hf_dir(source.path)  # headers only
        hf, fp8 = ckpt.config, kept_fp8(ckpt, config, device)
    check_tensor_parallel(hf, config.tensor_parallel_size, config.expert_parallel)
    dies: list[int] = []  # the GPUs of every rank: rank r on the r-th after rank 0's
    if device.type == "cuda":
        first, have = die_index(device), torch.cuda.device_count()
        dies = list(range(first, first + config.tensor_parallel_size))
        if dies[-1] >= have:
            raise ModelSpecError(
                f"tensor-parallel size {len(dies)} needs GPUs {first}..{dies[-1]}; this host has {have}"
            )
    shard_weights = shard_weights_bytes(hf, config.tensor_parallel_size, dtype, fp8, config.expert_parallel)
    mem_config = watch.config if watch is not None else MemoryConfig()
    hf_shard = shard_hf_config(hf, config.tensor_parallel_size, config.expert_parallel)
    need = die_need(hf_shard, config, dtype, shard_weights, mem_config)
    if watch is not None:  # every die (NVML's view) and every worker's load spike, before any spawns
        admit_split(need, config.tensor_parallel_size, dies, watch)
    # Rank 0's die (or, on the CPU, the host that holds every rank) must fit its share.
    ranks_here = 1 if device.type == "cuda" else config.tensor_parallel_size
    admit_load(hf_shard, config, device, dtype, shard_weights * ranks_here, watch)
    # A timed-out NCCL collective aborts its communicators and raises, rather than the default
    # of taking the whole process (the server) down. NVLink SHARP (multicast) stays off unless
    # the operator turns it on: the hosts we run on do not lend it. Set before the workers are
    # spawned, so they inherit both.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    workers = TPWorkers(config, quantized_kv, need if watch is not None else None)
    leases: list[Lease] = []
    try:
        tp = init_group(0, workers.world, workers.address, device)
        model, hf = load_shard(config, tp, device, dtype)
        ready = workers.wait_loaded()
        workers.watch(nccl=device.type == "cuda")
        if device.type == "cuda" and watch is not None:
            leases.append(
                watch.ledger.lease(die_index(device), weights_bytes(model), f"weights:{source.name}:tp0")
            )
            for r in ready:
                assert r.die is not None
                watch.ledger.register_die(r.die, r.die_total_bytes, r.die_free_bytes_before)
                leases.append(watch.ledger.lease(r.die, r.weights_bytes, f"weights:{source.name}:tp{r.rank}"))
    except BaseException:
        for lease in leases:
            lease.release()
        workers.close(timeout_s=2.0)
        raise
    held = weights_bytes(model) * ranks_here
    loaded = LoadedModel(
        source, model, hf, lazy_tokenizer(tok_dir), held, time.perf_counter() - t0, leases, config
    )
    log.info("tensor parallel %d: rank 0 on %s, workers pids %s", workers.world, device, workers.pids)
    return loaded, workers


def lease_everywhere(watch: MemWatch, dies: Sequence[int], nbytes: int, tag: str) -> list[Lease]:
    """One lease of nbytes on each die, all or none (LedgerFull names the die that said no)."""
    leases: list[Lease] = []
    try:
        for die in dies:
            leases.append(watch.ledger.lease(die, nbytes, tag))
    except LedgerFull:
        for lease in leases:
            lease.release()
        raise
    return leases


def segment_grant_all(watch: MemWatch, dies: Sequence[int], world: int) -> Acquire:
    """A KV segment lives on every rank: granted only when every die's ledger has room (on the
    CPU, where every rank's segment is host memory, when the host budget holds all of them)."""
    if not dies:
        host = segment_grant(watch, None)

        def host_grant(nbytes: int) -> Callable[[], None] | None:
            # Every rank commits its share when it replays the segment, after rank 0 has: the
            # grant is never marked committed, so it counts against the budget until released
            # (twice once the host shows it: safe, and only the CPU test path runs here).
            held = host(nbytes * world)
            return held.release if isinstance(held, HostGrant) else held

        return host_grant

    def grant(nbytes: int) -> Callable[[], None] | None:
        try:
            leases = lease_everywhere(watch, dies, nbytes, "kv-segment")
        except LedgerFull:
            return None

        def release() -> None:
            for lease in leases:
                lease.release()

        return release

    return grant
