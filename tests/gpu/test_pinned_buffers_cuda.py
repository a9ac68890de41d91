"""Checkpoint buffers pinned at exactly their size (`memory.pool.pinned`: an anonymous mapping
registered with CUDA) are what the copy engines take as pinned: a device-to-host copy into one is
asynchronous and lands intact, and freeing it leaves CUDA sound. Skips without CUDA."""

from __future__ import annotations

import gc

import pytest
import torch
from ballast.memory.pinned import pinned
from ballast.memory.pool import CheckpointPool
from ballast.memory.types import GiB, MiB

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BUSY_CYCLES = 500_000_000  # a fraction of a second of one SM spinning


def test_an_exact_size_pinned_buffer_takes_an_asynchronous_copy() -> None:
    nbytes = 73 * MiB + 4097  # a Qwen3-Next state is 73.7 MiB; torch would pin 128 MiB for it
    buf = pinned(nbytes)
    assert buf.numel() == nbytes and buf.is_pinned()
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    buf.copy_(src, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    assert not done.query()  # returned while the device is still busy: no host sync
    done.synchronize()
    assert torch.equal(buf, src.cpu())
    del buf
    gc.collect()  # unregistered and unmapped (the order is checked in tests/unit/test_pool.py)
    assert torch.cuda.is_available() and torch.ones(4, device="cuda").sum().item() == 4  # CUDA still sound


def test_the_pool_hands_out_pinned_buffers_of_the_size_asked() -> None:
    pool = CheckpointPool(lambda: 64 * GiB, 0.25, 8, MiB)
    assert pool.pinned
    assert pool.reserve(73 * MiB + 1, 2) == 2
    got = pool.get(73 * MiB + 1)
    assert got.numel() == 73 * MiB + 1 and got.is_pinned()
    assert pool.stats().bytes_held == 73 * MiB + 1  # the other one, exactly its size
