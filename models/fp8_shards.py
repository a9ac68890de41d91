"""A tensor-parallel rank's part of an FP8 checkpoint's float8 weights and their block scales.

A float8 weight [..., rows, cols] carries one float32 scale per (bn x bk) block of its last two
dims. A rank keeps some ranges of one dim of the weight (`parallel.Cut`), and the scales that
cover exactly those ranges: a column-parallel split of out_features (rows) must fall on whole
blocks of bn rows, a row-parallel split of in_features (cols) on whole blocks of bk columns (a
range may end at the dim's end, inside its last, partial block). Where a rank keeps the weight in
float8 a split that cuts a block is refused (`UnsupportedModel`, naming the tensor); where it
dequantizes at load (the CPU's default, `--fp8-weights dequantize`), such a weight is read whole,
dequantized and then cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from ballast.models.base import UnsupportedModel
from ballast.models.fp8 import Block, dequantize_blocks
from ballast.models.hf_loader import TensorInfo
from ballast.models.parallel import Cut, apply_cut
from safetensors import safe_open
from torch import Tensor

Read = Callable[[tuple[slice, ...]], Tensor]


def scale_ranges(
    dim: int, ranges: tuple[tuple[int, int], ...], shape: tuple[int, ...], block: Block
) -> tuple[tuple[int, int], ...] | None:
    """The ranges of the scale grid that cover `ranges` of the weight's dim `dim` exactly; None
    when a range starts or ends inside a block (a leading dim, e.g. the experts', is one scale
    per index: any range maps to itself)."""
    nd = len(shape)
    b = block[0] if dim == nd - 2 else block[1] if dim == nd - 1 else 1
    out = []
    for lo, hi in ranges:
        if lo % b or (hi % b and hi != shape[dim]):
            return None
        out.append((lo // b, -(-hi // b)))
    return tuple(out)


def fp8_part(
    cut: Cut, weight: tuple[TensorInfo, str, Read], scale: tuple[TensorInfo, str], block: Block, keep: bool
) -> tuple[Tensor, Tensor | None]:
    """The rank's part of one float8 weight (its checkpoint entry, name and a reader of its
    slices) and of its scales (entry, name): (float8 part, its scales) when `keep`, else (the
    part dequantized to float32, None)."""
    info, name, read_weight = weight
    scale_info, scale_name = scale
    covering = scale_ranges(cut.dim, cut.ranges, info.shape, block) if cut.ranges else ()
    with safe_open(str(scale_info.file), framework="pt", device="cpu") as f:
        scale_slice = f.get_slice(scale_name)
        if covering is None:
            if keep:
                raise UnsupportedModel(
                    f"tensor parallel: {name} {info.shape} would be split at {cut.ranges} of dim "
                    f"{cut.dim}, inside its {block[0]} x {block[1]} FP8 scale blocks; choose a "
                    "tensor-parallel size that splits it on whole blocks, or --fp8-weights dequantize"
                )
            everything = tuple(slice(None) for _ in info.shape)
            whole = dequantize_blocks(read_weight(everything), scale_slice[everything], block, torch.float32)
            return apply_cut(cut, lambda index: whole[index], info.shape), None
        part = apply_cut(cut, read_weight, info.shape)
        scale_cut = replace(cut, ranges=covering)
        scales: Tensor = apply_cut(scale_cut, lambda index: scale_slice[index], scale_info.shape)
    if keep:
        return part, scales
    return dequantize_blocks(part, scales, block, torch.float32), None
