"""The FP8 x FP8 prefill GEMMs (`models/w8a8_triton.py`) against float32 references: activation
quantization (plain and silu * up) within its rounding, the dense and expert-grouped GEMMs exact on
the quantized inputs at the 80B's shapes (hidden 2048, 512 experts of 2 x 512 gate/up and 512 ->
2048 down, top-10; ragged and empty experts) and at partial scale blocks, the whole expert MLP and
the FP8 MoE block within the error FP8 activations bring, and the switch that turns them off.
On CUDA; also under Triton's CPU interpreter (TRITON_INTERPRET=1 with triton installed), at fewer
tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ballast.models.blocks import moe
from ballast.models.kernels import moe_experts_triton, moe_triton
from ballast.models.layers import fp8
from ballast.models.layers.fp8 import FP8, dequantize_blocks, quantize_blocks
from torch import Tensor
from triton_kernels import DEVICE, marks

w8a8_triton = pytest.importorskip("ballast.models.kernels.w8a8_triton")
pytestmark = marks(moe_triton)
ON_CUDA = DEVICE.type == "cuda"
BLOCK = (128, 128)


@pytest.fixture(autouse=True)
def kernels_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton paths (as on CUDA) under the interpreter too."""
    monkeypatch.setattr(moe_triton, "available", lambda x: True)
    monkeypatch.setattr(fp8, "kernels_available", lambda device: True)
    monkeypatch.setattr(w8a8_triton, "ENABLED", True)


@pytest.fixture(autouse=True)
def interpreter_rounds_float8_to_nearest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's CPU interpreter rounds float32 -> float8 e4m3 (rtne) without carrying a full
    mantissa into the exponent (124.3 becomes 64, where the GPU's conversion gives 128): under the
    interpreter, that one conversion is torch's (round to nearest even, as the hardware does)."""
    if DEVICE.type == "cuda":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    emulated = interpreter._convert_float

    def convert(value: np.ndarray, src: object, dst: object, rounding: object) -> np.ndarray:
        if src == tl.float32 and dst == tl.float8e4nv:
            return torch.from_numpy(np.ascontiguousarray(value)).to(FP8).view(torch.uint8).numpy()
        return emulated(value, src, dst, rounding)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def rel(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def random_fp8(shape: tuple[int, ...], block: tuple[int, int], seed: int) -> tuple[Tensor, Tensor]:
    """float8 ~N(0, 1) values (made a chunk of experts at a time: the 80B's layer is 1.6 G of them)
    and block scales spread over [0.005, 0.015]."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    w = torch.empty(shape, dtype=FP8, device=DEVICE)
    for e in range(0, shape[0], 32):
        w[e : e + 32] = torch.randn(w[e : e + 32].shape, generator=g, device=DEVICE).to(FP8)
    grid = (shape[0], -(-shape[1] // block[0]), -(-shape[2] // block[1]))
    return w, 0.005 + 0.01 * torch.rand(grid, generator=g, device=DEVICE)


def skewed_routing(tokens: int, experts: int, top_k: int, seed: int) -> Tensor:
    """Distinct experts per token, a few hot (weight 1 / (e + 1)) and a range never chosen."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    p = 1.0 / torch.arange(1, experts + 1, device=DEVICE, dtype=torch.float32)
    p[experts // 4 : experts // 2] = 0  # empty experts in the middle of the table
    return torch.multinomial(p.expand(tokens, experts), top_k, generator=g)


def dequantized_rows(q: Tensor, s: Tensor, group: int) -> Tensor:
    return q.float() * s.repeat_interleave(group, 1)[:, : q.shape[1]]


@pytest.mark.parametrize("silu", [False, True])
def test_activation_quantization_rounds_each_group_to_nearest(silu: bool) -> None:
    """Each value within 1/16 of itself (e4m3's 3 mantissa bits, rounded to nearest) or the
    smallest step at its group's scale; every group's largest magnitude maps to 448."""
    torch.manual_seed(0)
    x = torch.randn(37, 2 * 704 if silu else 704, device=DEVICE, dtype=torch.bfloat16) * 3
    q, s = (w8a8_triton.silu_mul_quantize if silu else w8a8_triton.quantize_rows)(x)
    want = F.silu(x[:, :704].float()) * x[:, 704:].float() if silu else x.float()
    assert q.shape == (37, 704) and s.shape == (37, 6)
    back = dequantized_rows(q, s, 128)
    step = s.repeat_interleave(128, 1)[:, :704] * 2**-9
    assert ((back - want).abs() <= want.abs() / 16 + step).all()
    assert (q[:, :640].float().abs().unflatten(1, (5, 128)).amax(-1) == 448).all()


DENSE = [(300, 1024, 2048), (70, 1000, 704)]
DENSE_CUDA = [(300, 1024, 2048), (1000, 12288, 2048), (4096, 2048, 4096), (257, 1000, 704)]


@pytest.mark.parametrize(("m", "n", "k"), DENSE_CUDA if ON_CUDA else DENSE)
def test_dense_gemm_is_exact_on_the_quantized_activations(m: int, n: int, k: int) -> None:
    """Against float32 of the dequantized activations and weights: only the multiply's own
    rounding (float32 sums of FP8 products on the GPU); against the bf16 activations, the error
    FP8 activations bring (~2.5% of the output's magnitude)."""
    torch.manual_seed(m)
    w, scale = quantize_blocks(torch.randn(n, k, device=DEVICE) * 0.02, BLOCK)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    dense = dequantize_blocks(w, scale, BLOCK, torch.float32)
    q, s = w8a8_triton.quantize_rows(x)
    exact = dequantized_rows(q, s, 128) @ dense.T
    got = w8a8_triton.w8a8_matmul(x, w, scale, BLOCK)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert rel(got, exact) < 5e-3  # bf16's rounding of the output
    assert rel(got, x.float() @ dense.T) < 0.05


@pytest.mark.parametrize(
    ("tokens", "experts", "hidden", "inter", "top_k"),
    [(3, 512, 2048, 512, 10), (9, 8, 704, 320, 2)]
    if not ON_CUDA
    else [(1000, 512, 2048, 512, 10), (40, 512, 2048, 512, 10), (300, 8, 704, 320, 2)],
)
def test_grouped_gemms_at_the_80b_shapes_and_partial_blocks(
    tokens: int, experts: int, hidden: int, inter: int, top_k: int
) -> None:
    """The expert-grouped GEMMs exact on their quantized inputs: gate/up reading its rows through
    the routing's token index, down on silu(gate) * up quantized; the three together against
    float32 of the bf16 activations within FP8 activations' error, and `experts_w8a8` exactly
    them. Ragged loads, a quarter of the experts empty, scale blocks cut by the edges (704
    columns, 320 rows) and by the gate/up seam."""
    gate_up, gu_s = random_fp8((experts, 2 * inter, hidden), BLOCK, 1)
    down, dn_s = random_fp8((experts, hidden, inter), BLOCK, 2)
    choice = skewed_routing(tokens, experts, top_k, 3)
    routing = moe.Routing.sort(choice, experts)
    assert (routing.counts == 0).sum() >= experts // 4
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)

    def by_expert(rows: Tensor, w: Tensor, scale: Tensor) -> Tensor:
        """Each expert's rows (sorted by expert) times its dequantized weight, in float32."""
        out, first = [], 0
        for e, count in enumerate(routing.counts.tolist()):
            if count:
                dense = dequantize_blocks(w[e], scale[e], BLOCK, torch.float32)
                out.append(rows[first : first + count].float() @ dense.T)
            first += count
        return torch.cat(out)

    q, qs = w8a8_triton.quantize_rows(x)
    groups = moe_groups(routing, block_rows=tokens * top_k)
    h = w8a8_triton.grouped_w8a8_matmul(q, qs, groups, gate_up, gu_s, BLOCK, torch.bfloat16, routing.token)
    xq = dequantized_rows(q, qs, 128)[routing.token]
    assert rel(h, by_expert(xq, gate_up, gu_s)) < 5e-3
    act, act_s = w8a8_triton.silu_mul_quantize(h)
    y = w8a8_triton.grouped_w8a8_matmul(act, act_s, groups, down, dn_s, BLOCK, torch.bfloat16)
    assert rel(y, by_expert(dequantized_rows(act, act_s, 128), down, dn_s)) < 5e-3

    hr = by_expert(x[routing.token], gate_up, gu_s)
    want = by_expert(F.silu(hr[:, :inter]) * hr[:, inter:], down, dn_s)
    assert y.shape == (tokens * top_k, hidden)
    assert rel(y, want) < 0.06
    if ON_CUDA or experts <= 8:  # the interpreter takes minutes a GEMM at the 80B's widths
        whole = w8a8_triton.experts_w8a8(x, routing.token, routing.counts, gate_up, gu_s, down, dn_s, BLOCK)
        assert torch.equal(whole, y)


def moe_groups(routing: moe.Routing, block_rows: int) -> object:
    from ballast.models.kernels.fp8_triton import Groups

    experts = routing.counts.numel()
    return Groups.plan(
        routing.counts,
        block_rows,
        BLOCK,
        w8a8_triton.expert_tiles(block_rows / min(experts, block_rows), BLOCK),
    )


@pytest.mark.parametrize("on", [True, False])
def test_fp8_moe_block_takes_the_fp8_activation_path_from_its_row_threshold(
    monkeypatch: pytest.MonkeyPatch, on: bool
) -> None:
    """An FP8 experts module past the fused kernel's pairs: with the switch on, the FP8 x FP8
    kernels (within FP8 activations' error of float32 on the dequantized weights); off, the
    weight-only grouped GEMMs."""
    from ballast.models.kernels.fp8_triton import Groups, grouped_fp8_matmul

    monkeypatch.setattr(moe_experts_triton, "MAX_FUSED_FP8_PAIRS", 0)
    monkeypatch.setattr(w8a8_triton, "FROM_ROWS", 16)
    torch.manual_seed(0)
    experts, hidden, inter, tokens, top_k = 8, 256, 128, 24, 2
    module = moe.Experts(hidden, inter, experts).to(DEVICE)
    moe.convert_experts(module, BLOCK)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            w, s = quantize_blocks(torch.randn(getattr(module, name).shape, device=DEVICE) * 0.05, BLOCK)
            getattr(module, name).copy_(w)
            getattr(module, name + "_scale_inv").copy_(s)
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    choice = skewed_routing(tokens, experts, top_k, 4)
    weights = torch.softmax(torch.randn(tokens, top_k, device=DEVICE), -1).to(torch.bfloat16)
    monkeypatch.setattr(w8a8_triton, "ENABLED", on)
    got = moe.fp8_experts_forward(module, x, choice, weights)
    if on:
        gu = dequantize_blocks(module.gate_up_proj, module.gate_up_proj_scale_inv, BLOCK, torch.float32)
        dn = dequantize_blocks(module.down_proj, module.down_proj_scale_inv, BLOCK, torch.float32)
        h = torch.einsum("th,tkih->tki", x.float(), gu[choice])
        act = F.silu(h[..., :inter]) * h[..., inter:]
        want = torch.einsum("tki,tkhi,tk->th", act, dn[choice], weights.float())
        assert rel(got, want) < 0.06
        return
    if not ON_CUDA:
        pytest.skip("the interpreter's float8 -> bf16 conversion breaks the weight-only kernel")
    routing = moe.Routing.sort(choice, experts)
    groups = Groups.plan(routing.counts, tokens * top_k, BLOCK)
    h = grouped_fp8_matmul(
        x[routing.token], groups, module.gate_up_proj, module.gate_up_proj_scale_inv, BLOCK
    )
    act = (F.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
    y = grouped_fp8_matmul(act, groups, module.down_proj, module.down_proj_scale_inv, BLOCK)
    assert rel(got, routing.combine(y, weights, tokens).float()) < 1e-2  # split-K sums: not bit-exact
