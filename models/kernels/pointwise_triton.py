"""Rotary embedding and SwiGLU's gate as one Triton kernel each, for CUDA's eager steps (prefill,
mixed steps), where `pointwise`'s compiled kernels do not run.

In torch rope is five kernels and the gate two, each over a strided view of a fused projection's
output, which torch's element-wise kernels read without vector loads (H200, Llama-8B, a 1,000-token
prefill: 3.2 of its 27.9 ms of GPU work in 160 such launches). Each kernel here reads its input and
writes its output once, in float32, rounding once as the decode graphs' compiled kernels do. A
Triton launch costs the host more than a torch one, which a step of a few tokens waits on, so
`pointwise` takes these only from `MIN_TOKENS` tokens up.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch code serves
    triton = None

MIN_TOKENS = 256


def available(x: Tensor) -> bool:
    return triton is not None and x.is_cuda and x.shape[0] >= MIN_TOKENS


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim] (any strides, the last 1) rotated in its first cos.shape[-1] dims
    (half-split layout), the rest copied; cos, sin [T, rot] (rows may be strided, last stride 1).
    Returns a new contiguous tensor of x's dtype."""
    assert triton is not None
    tokens, heads, dim = x.shape
    rot = cos.shape[-1]
    assert x.stride(-1) == 1 and cos.stride(-1) == sin.stride(-1) == 1 and rot % 2 == 0 and rot <= dim
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    block_h = min(triton.next_power_of_2(heads), max(1, 4096 // triton.next_power_of_2(dim)))
    _rope_kernel[(tokens, triton.cdiv(heads, block_h))](
        x,
        cos,
        sin,
        out,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        sin.stride(0),
        heads,
        DIM=dim,
        HALF=rot // 2,
        BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_H=block_h,
    )
    return out


def silu_mul(gate_up: Tensor, n: int) -> Tensor:
    """silu(gate_up[:, :n]) * gate_up[:, n:] for a [T, 2n] tensor (rows may be strided)."""
    assert triton is not None
    tokens = gate_up.shape[0]
    assert gate_up.stride(-1) == 1 and gate_up.shape[1] == 2 * n
    out = torch.empty((tokens, n), dtype=gate_up.dtype, device=gate_up.device)
    block = min(2048, triton.next_power_of_2(n))
    _silu_mul_kernel[(tokens, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), n, BLOCK=block)
    return out


if triton is not None:

    @triton.jit
    def _rope_kernel(
        x,
        cos,
        sin,
        out,
        sxt,
        sxh,
        sct,
        sst,
        heads,
        DIM: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_H: tl.constexpr,
    ):
        """One token's heads of one block: out[d] = x[d] cos[d] + r[d] sin[d] for d < 2 HALF, where
        r[d] = -x[d + HALF] below HALF and x[d - HALF] above it; x[d] past the rotated dims."""
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        rotated = d < 2 * HALF
        ok = (h < heads)[:, None] & (d < DIM)[None, :]
        rows = x + t * sxt + h[:, None] * sxh
        v = tl.load(rows + d[None, :], mask=ok, other=0.0).to(tl.float32)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        p = tl.load(rows + partner[None, :], mask=ok & rotated[None, :], other=0.0).to(tl.float32)
        p = tl.where((d < HALF)[None, :], -p, p)
        c = tl.load(cos + t * sct + d, mask=rotated, other=1.0).to(tl.float32)
        s = tl.load(sin + t * sst + d, mask=rotated, other=0.0).to(tl.float32)
        o = v * c[None, :] + p * s[None, :]
        tl.store(out + (t * heads + h[:, None]) * DIM + d[None, :], o.to(out.dtype.element_ty), mask=ok)

    @triton.jit
    def _silu_mul_kernel(gate_up, out, srow, n, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n
        g = tl.load(gate_up + t * srow + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_up + t * srow + n + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + t * n + cols, (g * tl.sigmoid(g) * u).to(out.dtype.element_ty), mask=ok)
