"""A staged checkpoint copy lays the slot's state out in one device buffer exactly as the host
buffer holds it, so one transfer fills every segment (checked here on the CPU, where the same
code runs; the stream and event side is tests/gpu/test_checkpoint_copies_cuda.py)."""

from __future__ import annotations

import torch
from ballast.engine.prefix_cache import _layout, _segment
from ballast.engine.state_copies import StateCopies


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
