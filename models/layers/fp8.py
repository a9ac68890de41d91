"""FP8 weights kept as FP8: linears and MoE experts holding float8 e4m3 weights with float32 block
scales (Hugging Face's fine-grained FP8 layout: `weight` [out, in] and `weight_scale_inv`
[ceil(out / bn), ceil(in / bk)]; the real weight is the float8 value times its block's scale).

On CUDA 8.9+ with Triton the GEMMs read the float8 weights directly (models/kernels/fp8_triton.py: half
the bytes of bf16, which decode is bound by); elsewhere through `dequantize_blocks`, exact but a
copy per call, so the loader dequantizes once at load there instead (engine `--fp8-weights`).
Conversion is in place on the meta device: an `nn.Linear` becomes an `Fp8Linear` (same object, so
whatever holds it sees the change) and `Experts` gets float8 fused tensors plus their scales.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import cast

import torch
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
Block = tuple[int, int]


def dequantize_blocks(weight: Tensor, scale_inv: Tensor, block: Block, dtype: torch.dtype) -> Tensor:
    """float8 weight [..., rows, cols] times its block scales [..., ceil(rows/bn), ceil(cols/bk)]."""
    rows, cols = weight.shape[-2:]
    full = scale_inv.float().repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)
    return (weight.float() * full[..., :cols]).to(dtype)


def quantize_blocks(weight: Tensor, block: Block) -> tuple[Tensor, Tensor]:
    """The inverse, for tests and random models: float8 values and float32 block scales of the last
    two dimensions (each block's largest magnitude maps to the float8 maximum)."""
    rows, cols = weight.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = weight.new_zeros((*weight.shape[:-2], grid[0] * block[0], grid[1] * block[1]))
    padded[..., :rows, :cols] = weight
    tiles = padded.unflatten(-1, (grid[1], block[1])).unflatten(-3, (grid[0], block[0]))
    scale = tiles.abs().amax(dim=(-3, -1)).float().clamp(min=1e-12) / FP8_MAX
    full = scale.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    return (weight.float() / full).to(FP8), scale


@lru_cache(maxsize=8)
def kernels_available(device: torch.device) -> bool:
    """Whether the Triton FP8 kernels run on this device (CUDA, compute capability 8.9+)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fp8_linear(
    x: Tensor, weight: Tensor, scale_inv: Tensor, block: Block, bias: Tensor | None = None
) -> Tensor:
    """x @ dequantized(weight).T (+ bias), x [..., in] in its own dtype."""
    if kernels_available(x.device):
        from ballast.models.kernels.fp8_triton import block_fp8_matmul

        y = block_fp8_matmul(x.reshape(-1, x.shape[-1]), weight, scale_inv, block).view(*x.shape[:-1], -1)
    else:
        y = x @ dequantize_blocks(weight, scale_inv, block, x.dtype).T
    return y if bias is None else y + bias


class Fp8Linear(nn.Linear):
    """An nn.Linear whose weight is float8 with block scales (`weight_scale_inv`, the checkpoint's
    name). Made by `convert_linear` from an existing Linear on the meta device."""

    block: Block
    weight_scale_inv: nn.Parameter

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)


def scale_param(shape: tuple[int, ...], block: Block, device: torch.device) -> nn.Parameter:
    grid = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    return nn.Parameter(torch.empty(grid, dtype=torch.float32, device=device), requires_grad=False)


def convert_linear(linear: nn.Linear, block: Block) -> None:
    """Turn linear (in place) into an Fp8Linear with uninitialised float8 weight and scales."""
    w = linear.weight
    linear.weight = nn.Parameter(torch.empty(w.shape, dtype=FP8, device=w.device), requires_grad=False)
    linear.weight_scale_inv = scale_param(tuple(w.shape), block, w.device)
    linear.__class__ = Fp8Linear
    cast(Fp8Linear, linear).block = block


def decoder_projection(name: str) -> bool:
    """The weights published FP8 checkpoints quantize: every projection of the decoder layers and
    the experts (not embeddings, norms, routers, gates or the head)."""
    return ".layers." in name and name.endswith(("proj.weight", "experts.gate_up_proj"))


def init_random_fp8(model: nn.Module, generator: torch.Generator, std: float = 0.02) -> None:
    """Random float8 weights ~N(0, 1) with every block scale `std`: values ~N(0, std)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == FP8:
                p.copy_(
                    torch.randn(p.shape, device=generator.device, generator=generator, dtype=torch.bfloat16)
                )
            elif name.endswith("_scale_inv"):
                p.fill_(std)
