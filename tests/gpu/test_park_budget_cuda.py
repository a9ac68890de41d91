"""On CUDA: parks are booked against the host budget one by one (issue 31, item 3).

Pinned pages cannot be reclaimed, so a victim parked in host memory must be deducted before the
next victim is weighed. The host here has room for about one parked sequence (a fixture /proc
tree, never polled again, so every park counts until a poll would show it): with four sequences
growing past the granted KV, the engine parks one and recomputes the others, and every request
still ends with the tokens of a calm run. Skips cleanly without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ballast.engine.engine import Engine
from ballast.engine.kv.blocks import blocks_for
from ballast.memory.config import MemoryConfig
from ballast.memory.types import GiB
from ballast.memory.watch import MemWatch
from memfixtures import limited_grants, write_tree
from test_kv_preemption_cuda import NEW, config, generate

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


async def test_two_parks_between_polls_do_not_share_one_snapshot(tmp_path: Path) -> None:
    calm = Engine.load(config("builtin:tiny-llama"))
    try:
        want = await generate(calm)
    finally:
        calm.shutdown()
    write_tree(tmp_path, mem_total=64 * GiB, mem_available=32 * GiB)
    watch = MemWatch(MemoryConfig(root=str(tmp_path), host_reserve_bytes=GiB))
    watch.poll_now()
    engine = Engine.load(config("builtin:tiny-llama"), watch)
    try:
        kv = engine.runner.kv
        assert kv is not None
        one_park = blocks_for(40 + NEW, kv.layout.block_size) * kv.layout.block_bytes
        one_park += engine.runner.fixed_bytes // max(1, engine.runner.num_slots)
        # The host's room: one and a half parked sequences, whatever else this box holds.
        write_tree(tmp_path, mem_total=64 * GiB, mem_available=GiB + one_park * 3 // 2 // 1024 * 1024)
        watch.poll_now()
        need = 4 * blocks_for(40 + NEW, kv.layout.block_size)
        # Grants for about half of that: two of the four fit, so at least two are preempted (with
        # two thirds, one victim's blocks were enough for the other three and only one was).
        kv._acquire = limited_grants(max(2, need // (2 * (kv.layout.seg_blocks - 1))))
        got = await generate(engine)
        assert engine.slot_kv.preemptions > 1
        assert engine.slot_kv.parked == 1  # the first took the room; the others were recomputed
        assert got == want
    finally:
        engine.shutdown()
