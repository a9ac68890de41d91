"""On two or more GPUs: a tensor-parallel load whose per-die scratch cannot fit is refused before
any worker spawns, naming every die (issue 31, item 9). Skips cleanly without two GPUs."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.runner.loading import ModelLoadRefused
from ballast.memory.config import MemoryConfig
from ballast.memory.watch import MemWatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]


def test_every_die_is_admitted_before_its_weights_move() -> None:
    total = torch.cuda.get_device_properties(1).total_memory
    watch = MemWatch(MemoryConfig(die_scratch_bytes=total))  # no die can keep that free
    cfg = EngineConfig(model="builtin:tiny-llama", device="cuda:0", max_model_len=256, tensor_parallel_size=2)
    with pytest.raises(ModelLoadRefused) as refused:
        Engine.load(cfg, watch)
    assert "GPU 0" in str(refused.value) and "GPU 1" in str(refused.value)
    assert all(torch.cuda.memory_allocated(d) == 0 for d in (0, 1))  # nothing moved
