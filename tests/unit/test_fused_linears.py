"""FusedLinears.outputs: one matmul's views where the linears fuse, each linear's own output where
they cannot (an FP8 part beside a bf16 one), equal to running the linears one by one either way."""

from __future__ import annotations

import torch
from ballast.models.layers import fp8
from ballast.models.layers.core import FusedLinears
from torch import nn


def _linears(*outs: int, hidden: int = 64) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(hidden, n, bias=False) for n in outs]


def test_fused_outputs_are_views_of_one_matmul_and_equal_the_linears_alone() -> None:
    parts = _linears(48, 16, 16)
    x = torch.randn(5, 64)
    alone = [lin(x) for lin in parts]
    fused = FusedLinears(*parts)
    fused.fuse()
    outs = fused.outputs(x)
    assert not fused.separate
    assert [o.shape for o in outs] == [a.shape for a in alone]
    assert len({o.untyped_storage().data_ptr() for o in outs}) == 1  # one result tensor
    for o, a in zip(outs, alone, strict=True):
        torch.testing.assert_close(o, a)


def test_parts_that_cannot_fuse_give_their_own_outputs() -> None:
    parts = _linears(128, 64)
    x = torch.randn(3, 64)
    fp8.convert_linear(parts[0], (128, 128))  # an FP8 weight beside a plain one
    with torch.no_grad():
        parts[0].weight.copy_(torch.randn(128, 64).to(fp8.FP8))
        parts[0].weight_scale_inv.fill_(0.5)
    alone = [lin(x) for lin in parts]
    fused = FusedLinears(*parts)
    fused.fuse()
    outs = fused.outputs(x)
    assert fused.separate
    assert len({o.untyped_storage().data_ptr() for o in outs}) == 2  # no concatenated copy
    for o, a in zip(outs, alone, strict=True):
        torch.testing.assert_close(o, a)
