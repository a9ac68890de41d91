"""Tensor-parallel load admission (issue 31, item 9): before any worker is spawned, the host must
hold every rank's load spike (each worker stages its own shard), and every die its shard with the
per-die scratch (--die-scratch-bytes, read by nothing before). The host figures come from a
fixture /proc tree; the split's figures from the real model config."""

from __future__ import annotations

from pathlib import Path

import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.parallel.split_admission import DieNeed
from ballast.engine.runner.loading import ModelLoadRefused
from ballast.memory.config import MemoryConfig
from ballast.memory.types import GiB, MiB
from ballast.memory.watch import MemWatch
from memfixtures import write_tree


def test_every_rank_s_load_spike_is_admitted_on_the_host(tmp_path: Path) -> None:
    # 3 GiB above the reserve: one 2 GiB spike fits, the two ranks' 4 GiB do not.
    write_tree(tmp_path, mem_total=64 * GiB, mem_available=4 * GiB)
    watch = MemWatch(MemoryConfig(root=str(tmp_path), host_reserve_bytes=GiB, load_spike_bytes=2 * GiB))
    cfg = EngineConfig(model="builtin:tiny-llama", device="cpu", max_model_len=64, tensor_parallel_size=2)
    with pytest.raises(ModelLoadRefused, match="load spike"):
        Engine.load(cfg, watch)


def test_the_reason_names_every_die_short_of_its_shard_and_scratch() -> None:
    need = DieNeed(shard_bytes=10 * GiB, kv_bytes=GiB, scratch_bytes=512 * MiB, reserve_bytes=GiB)
    fits = 12 * GiB + 512 * MiB
    assert need.verdict({0: fits, 1: fits}).admitted
    short = need.verdict({0: fits, 1: fits - 1, 2: GiB})
    assert not short.admitted and "GPU 1" in short.reason and "GPU 2" in short.reason
    assert "GPU 0" not in short.reason
