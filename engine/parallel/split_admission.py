"""Admission of a model split over several GPUs (tensor parallel), before any weights move.

Every rank's die must hold its shard's load needs plus a scratch the ledger never sees (the
worker's CUDA context, NCCL's buffers). Rank 0 checks every die NVML reports before it spawns a
worker, and each worker checks its own again with the driver's free figure before it loads. The
host must hold every rank's load spike at once: each worker stages its own shard.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from ballast.engine.config import EngineConfig
from ballast.engine.runner.load_fit import bytes_beside_weights
from ballast.engine.runner.loading import ModelLoadRefused
from ballast.memory.admission import DieSlice, admit_load_spike, admit_model_load_split
from ballast.memory.config import MemoryConfig
from ballast.memory.types import Verdict
from ballast.memory.watch import MemWatch


@dataclass(frozen=True)
class DieNeed:
    """What every rank's die must have free before its shard loads (a worker gets this from rank
    0: it has no MemoryConfig of its own)."""

    shard_bytes: int  # the shard's weights and slot states
    kv_bytes: int  # one max-length sequence's KV
    scratch_bytes: int  # prefill activations + MemoryConfig.die_scratch_bytes
    reserve_bytes: int  # the die's reserve

    def verdict(self, free: Mapping[int, int]) -> Verdict:
        """Whether each die (die -> its free bytes) holds a shard; the reason names each one short."""
        pieces = [
            DieSlice(d, self.shard_bytes, self.kv_bytes, f, self.reserve_bytes) for d, f in free.items()
        ]
        return admit_model_load_split(pieces, self.scratch_bytes)


def die_need(
    hf_shard: Mapping[str, Any],
    config: EngineConfig,
    dtype: torch.dtype,
    shard_weights: int,
    mem_config: MemoryConfig,
) -> DieNeed:
    fixed, one_seq, activations = bytes_beside_weights(hf_shard, config, dtype)
    return DieNeed(
        shard_weights + fixed,
        one_seq,
        activations + mem_config.die_scratch_bytes,
        mem_config.die_reserve_bytes,
    )


def admit_split(need: DieNeed, ranks: int, dies: Sequence[int], watch: MemWatch) -> None:
    """Rank 0, before spawning: raise ModelLoadRefused unless the host holds every rank's load
    spike and every die (of `dies`, empty on the CPU) that NVML sees holds its shard."""
    state = watch.poll_now()
    spike = admit_load_spike(watch.config.load_spike_bytes * ranks, state)
    if not spike.admitted:
        raise ModelLoadRefused(spike)
    seen = {d.index: d.free_bytes for d in state.dies if d.index in dies}
    if seen and not (verdict := need.verdict(seen)).admitted:
        raise ModelLoadRefused(verdict)
