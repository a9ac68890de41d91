"""On CUDA the checkpoint pool hands out pinned buffers, and trim gives the pinned pages back.
Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import KiB, MiB

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_pins_on_cuda_and_trim_releases_pinned_buffers() -> None:
    pool = CheckpointPool(lambda: 64 << 30, 0.5, 4, KiB)
    assert pool.pinned
    b = pool.get(3 * MiB)
    # exactly the bytes asked for: torch's own pinned allocator would have rounded up to 4 MiB
    assert b.is_pinned() and b.numel() == 3 * MiB
    assert pool.put(b)
    del b
    assert pool.trim(0) == 3 * MiB
    assert pool.stats().pin_failures == 0
