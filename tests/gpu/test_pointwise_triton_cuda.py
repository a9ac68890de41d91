"""The Triton rope and SwiGLU-gate kernels of eager CUDA steps (`models/kernels/pointwise_triton.py`)
against the torch code they stand in for: strided views of a fused projection's output as the
layers pass them, full and partial rotary, head counts that do not fill a block. On CUDA; also
under Triton's CPU interpreter (TRITON_INTERPRET=1 with triton installed)."""

from __future__ import annotations

import pytest
import torch
from ballast.models.kernels import pointwise_triton
from ballast.models.layers import pointwise
from triton_kernels import DEVICE, marks

pytestmark = marks(pointwise_triton)

DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2}}


def tables(tokens: int, rot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    pos = torch.arange(tokens, device=DEVICE).float()[:, None]
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, device=DEVICE).float() / rot))
    emb = torch.cat([pos * inv, pos * inv], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim", "rot"),
    [(32, 8, 128, 128), (16, 2, 256, 64), (5, 1, 64, 64)],  # Llama-8B, Qwen3-Next (partial), odd
)
def test_rope_of_qkv_views_is_the_torch_rope(
    dtype: torch.dtype, q_heads: int, kv_heads: int, dim: int, rot: int
) -> None:
    tokens = 37
    gen = torch.Generator().manual_seed(dim + q_heads)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    cos, sin = tables(tokens, rot, dtype)
    q = qkv[:, : q_heads * dim].view(tokens, q_heads, dim)  # strided: rows of the whole qkv
    k = qkv[:, q_heads * dim : (q_heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    for x in (q, k):
        got = pointwise_triton.rope(x, cos, sin)
        assert got.is_contiguous() and got.dtype == dtype
        want = pointwise.apply_rope(x.float(), cos.float(), sin.float())
        torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 3000])  # one block, several blocks with a ragged last one
def test_silu_mul_is_the_torch_gate(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    wide = torch.randn(9, 2 * n + 8, generator=gen).to(DEVICE, dtype)
    gate_up = wide[:, : 2 * n]  # rows strided, as a view of a wider output would be
    got = pointwise_triton.silu_mul(gate_up, n)
    want = torch.nn.functional.silu(gate_up[:, :n].float()) * gate_up[:, n:].float()
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the dispatch is by device and token count")
def test_eager_cuda_steps_of_many_tokens_take_the_triton_kernels() -> None:
    """Outside the decode graphs' capture, `pointwise.rope` / `silu_mul` run the Triton kernels from
    MIN_TOKENS tokens (bit-equal to them; bf16 rounding differs from torch's chain of ops somewhere
    in a tensor this size) and the torch code below it."""
    for tokens in (pointwise_triton.MIN_TOKENS - 1, pointwise_triton.MIN_TOKENS):
        x = torch.randn(tokens, 8, 128, device=DEVICE, dtype=torch.bfloat16)
        cos, sin = tables(tokens, 128, torch.bfloat16)
        gate_up = torch.randn(tokens, 2 * 1024, device=DEVICE, dtype=torch.bfloat16)
        many = tokens >= pointwise_triton.MIN_TOKENS
        for got, triton_out, torch_out in (
            (
                pointwise.rope(x, cos, sin),
                pointwise_triton.rope(x, cos, sin),
                pointwise.apply_rope(x, cos, sin),
            ),
            (
                pointwise.silu_mul(gate_up, 1024),
                pointwise_triton.silu_mul(gate_up, 1024),
                torch.nn.functional.silu(gate_up[:, :1024]) * gate_up[:, 1024:],
            ),
        ):
            assert torch.equal(got, triton_out if many else torch_out)
            assert not torch.equal(triton_out, torch_out)  # the check above tells the paths apart
