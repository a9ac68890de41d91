"""A staged checkpoint copy lays the slot's state out in one device buffer exactly as the host
buffer holds it, so one transfer fills every segment (checked here on the CPU, where the same
code runs; the stream and event side is tests/gpu/test_checkpoint_copies_cuda.py); the staging
room is leased from the memory ledger."""

from __future__ import annotations

import torch
from ballast.engine.kv.checkpoint_buffers import checkpoint_bytes
from ballast.engine.kv.checkpoint_buffers import layout as _layout
from ballast.engine.kv.checkpoint_buffers import segment as _segment
from ballast.engine.kv.state_copies import StateCopies
from ballast.engine.runner.checkpoint_orders import staging_bytes
from ballast.memory.ledger import Lease, VramLedger
from ballast.models.layers.state import RecurrentState


def test_staging_matches_the_host_layout_and_one_copy_fills_every_segment() -> None:
    g = torch.Generator().manual_seed(0)
    layers = [
        (torch.randn(3, 5, generator=g).to(torch.bfloat16), torch.randn(2, 4, 4, generator=g)),
        (torch.randn(7, generator=g).to(torch.bfloat16), torch.randn(1, 9, generator=g)),
    ]
    layout, nbytes = _layout(layers)
    buf = torch.zeros(nbytes + 100, dtype=torch.uint8)
    pairs = [
        (src, _segment(buf, off, dtype, shape))
        for views, segs in zip(layers, layout, strict=True)
        for src, (off, dtype, shape) in zip(views, segs, strict=True)
    ]
    staging = StateCopies(torch.device("cpu"))._stage(pairs, buf, nbytes)
    assert staging.numel() == nbytes
    buf[:nbytes].copy_(staging)  # what the side stream does on CUDA
    for src, dst in pairs:
        assert torch.equal(dst, src)


def test_on_the_cpu_a_copy_is_done_on_return() -> None:
    src = torch.arange(6, dtype=torch.float32)
    buf = torch.zeros(64, dtype=torch.uint8)
    dst = _segment(buf, 0, torch.float32, src.shape)
    copies = StateCopies(torch.device("cpu"))
    assert copies.copy_out(0, [(src, dst)], buf, 24) is None
    assert torch.equal(dst, src) and copies.pending_slots() == frozenset()


def test_the_staging_for_a_burst_of_saves_is_what_the_ledger_grants() -> None:
    """A CUDA engine leases staging for `checkpoints` checkpoints at load; a ledger without room
    for them grants one, and one without room for one gets direct copies (0), with nothing held.
    Real ledger and real recurrent states (on the CPU: only their sizes are read)."""
    states = [RecurrentState(2, (8, 4), (2, 16, 16), torch.bfloat16, "cpu") for _ in range(3)]
    one = checkpoint_bytes(states)
    assert one >= 3 * (8 * 4 * 2 + 2 * 16 * 16 * 4)
    cuda0 = torch.device("cuda", 0)

    def granted(room: int) -> tuple[int, list[int]]:
        ledger = VramLedger(die_reserve_bytes=0, usable_fraction=1.0)
        ledger.register_die(0, total_bytes=room, free_bytes=room)
        leases: list[Lease] = []
        got = staging_bytes(cuda0, states, ledger, leases, checkpoints=8)
        assert [lease.nbytes for lease in leases] == ([got] if got else [])
        assert ledger.held(0) == got
        return got, [n for _, n in ledger.leases(0)]

    assert granted(10 * one) == (8 * one, [8 * one])
    assert granted(5 * one) == (one, [one])
    assert granted(one - 1) == (0, [])
    # on the CPU, or for a model with no recurrent state, nothing is staged or leased
    ledger = VramLedger(die_reserve_bytes=0, usable_fraction=1.0)
    ledger.register_die(0, total_bytes=10 * one, free_bytes=10 * one)
    assert staging_bytes(torch.device("cpu"), states, ledger, [], 8) == 0
    assert staging_bytes(cuda0, [], ledger, [], 8) == 0
    assert ledger.held(0) == 0
