"""FusedLinears.outputs: one matmul's views where the linears fuse, each linear's own output where
they cannot (an FP8 part beside a bf16 one), equal to running the linears one by one either way."""

from __future__ import annotations

import pytest
import torch
from ballast.models.arch import builtin
from ballast.models.arch.registry import build_model
from ballast.models.layers import fp8
from ballast.models.layers.core import FusedLinears
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


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


class _Created(TorchDispatchMode):
    """Bytes of the tensors factory ops create while active (what a device's allocator is asked for)."""

    FACTORIES = ("empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "cat")

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        made = func.overloadpacket.__name__ in self.FACTORIES and isinstance(out, torch.Tensor)
        if made and not out.is_meta:
            self.bytes += out.numel() * out.element_size()
        return out


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next"])
def test_a_built_model_allocates_its_weights_once(name: str) -> None:
    """build_model allocates each weight's storage once: a fused projection's one tensor directly,
    its linears views into it, a tied head the embedding's. Fusing after `to_empty` gave every
    linear storage of its own first and then freed it, on a GPU into the caching allocator: 8.5 GiB
    on the 8B shape (q, k, v, gate and up of 32 layers)."""
    cfg = builtin.builtin_config("builtin:" + name)
    with _Created() as created:
        model = build_model(cfg, dtype=torch.bfloat16, device="cpu")
    held = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    held.update({b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in model.buffers()})
    fused = [f for m in model.modules() for f in vars(m).values() if isinstance(f, FusedLinears)]
    assert fused and all(f.fused for f in fused)
    assert created.bytes == sum(held.values())
