"""The fused expert kernels on float8 weights with block scales (`moe_experts_triton.experts_mlp`
with `Fp8Scales`) against a float64 definition on the dequantized weights: the 80B's routing (512
experts, top-10), ragged loads and empty experts, scale blocks cut by the matrix edges and by the
gate/up seam, the shared expert in the same launches, pairs held on another rank; then an FP8
MoE block and a tiny FP8 hybrid model through the engine, fused against the unfused path.
On CUDA; also under Triton's CPU interpreter (TRITON_INTERPRET=1 with triton installed)."""

from __future__ import annotations

import pytest
import torch
from ballast.models.arch import registry
from ballast.models.blocks import moe
from ballast.models.kernels import moe_experts_triton, moe_triton
from ballast.models.kernels.moe_experts_triton import Fp8Scales, SharedExpert
from ballast.models.layers import fp8
from ballast.models.layers.fp8 import dequantize_blocks, quantize_blocks
from triton_kernels import DEVICE, marks

pytestmark = marks(moe_triton)
F64 = torch.float64
on_cuda = pytest.mark.skipif(DEVICE.type != "cuda", reason="full-size shapes: too slow for the interpreter")


@pytest.fixture(autouse=True)
def triton_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton routing and expert kernels (as on CUDA) under the interpreter too."""
    monkeypatch.setattr(moe_triton, "available", lambda x: True)
    monkeypatch.setattr(moe_experts_triton, "FUSED_EXPERTS", True)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.to(F64) - want).norm() / want.norm())


def fp8_weights(gen: torch.Generator, shape: tuple[int, ...], block: tuple[int, int]):  # noqa: ANN201
    """Block-quantized random weights: (float8 values, scales, the float64 weights they stand for).
    The scales differ block to block (x 1/4 to 4), so a scale applied to the wrong block shows."""
    w = torch.randn(shape, generator=gen) * 0.05
    rows, cols = shape[-2:]
    grid = (*shape[:-2], -(-rows // block[0]), -(-cols // block[1]))
    spread = 4.0 ** (2 * torch.rand(grid, generator=gen) - 1)
    w = w * spread.repeat_interleave(block[0], -2)[..., :rows, :].repeat_interleave(block[1], -1)[..., :cols]
    q, s = quantize_blocks(w, block)
    return q.to(DEVICE), s.to(DEVICE), dequantize_blocks(q, s, block, F64).to(DEVICE)


def definition(x, ids, weights, gate_up, down, shared=None):  # noqa: ANN001, ANN201
    """Float64, one expert at a time over its pairs; ids past the experts add 0; shared =
    (gate_up [2I, H], down [H, I], gate logits [T, 1]) adds sigmoid(gate) * its output."""
    xf, out = x.to(F64), torch.zeros(x.shape, dtype=F64, device=x.device)
    inter = gate_up.shape[1] // 2
    for e in ids.unique().tolist():
        if e >= gate_up.shape[0]:
            continue
        tok, j = (ids == e).nonzero(as_tuple=True)
        h = xf[tok] @ gate_up[e].T
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ down[e].T
        out.index_add_(0, tok, weights.to(F64)[tok, j, None] * y)
    if shared is not None:
        s_gu, s_dn, gate = shared
        h = xf @ s_gu.T
        y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ s_dn.T
        out += torch.sigmoid(gate.to(F64)) * y
    return out


def routed_ids(gen: torch.Generator, tokens: int, experts: int, top_k: int, ragged: bool) -> torch.Tensor:
    """Distinct experts per token; ragged: every token also picks expert 0 (its program loops
    over more rows than one pass) and only the lower half of the experts is ever picked (the
    upper half holds no pair)."""
    if not ragged:
        return torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    pool = max(top_k, experts // 2)
    rest = torch.stack([torch.randperm(pool - 1, generator=gen)[: top_k - 1] + 1 for _ in range(tokens)])
    return torch.cat([torch.zeros(tokens, 1, dtype=torch.int64), rest], 1)


CASES = [
    # tokens, experts, top_k, hidden, inter, block, ragged
    pytest.param(3, 512, 10, 256, 128, (128, 128), False, id="512-experts-top10"),
    pytest.param(5, 20, 4, 200, 96, (128, 128), False, id="partial-scale-blocks"),
    pytest.param(40, 12, 3, 64, 32, (16, 32), True, id="ragged-and-empty"),
    pytest.param(1, 512, 10, 2048, 512, (128, 128), False, id="80b-1-token", marks=on_cuda),
    pytest.param(32, 512, 10, 2048, 512, (128, 128), False, id="80b-32-tokens", marks=on_cuda),
    pytest.param(128, 512, 10, 2048, 512, (128, 128), True, id="80b-128-ragged", marks=on_cuda),
]


@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "block", "ragged"), CASES)
def test_fp8_expert_kernels_compute_the_definition(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, block: tuple[int, int], ragged: bool
) -> None:
    """With the shared expert in the launches and without. 2I = 192 rows in 128-row blocks: the
    second block is partial and the first holds gate and up rows both."""
    gen = torch.Generator().manual_seed(tokens * experts + hidden)
    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    gu_q, gu_s, gu = fp8_weights(gen, (experts, 2 * inter, hidden), block)
    dn_q, dn_s, dn = fp8_weights(gen, (experts, hidden, inter), block)
    ids = routed_ids(gen, tokens, experts, top_k, ragged).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE, dtype)
    scales = Fp8Scales(gu_s, dn_s, block)
    # the kernels serve any decode-sized batch; the engine sends them float8 batches up to a bound
    served = ids.numel() <= moe_experts_triton.MAX_FUSED_FP8_PAIRS
    assert moe_experts_triton.fused_ok(x, gu_q, ids.numel(), scales) == served
    routing = moe.Routing.sort(ids, experts)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: x, h and the output rounded
    got = moe_experts_triton.experts_mlp(
        x, routing.token, routing.order, routing.counts, weights, gu_q, dn_q, False, scales=scales
    )
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert rel_err(got, definition(x, ids, weights, gu, dn)) < tol
    sgu_q, sgu_s, sgu = fp8_weights(gen, (2 * inter, hidden), block)
    sdn_q, sdn_s, sdn = fp8_weights(gen, (hidden, inter), block)
    # the gate's logits a column view, as the router + gate GEMM gives them
    gate = torch.randn(tokens, 3, generator=gen).to(DEVICE, dtype)[:, 1:2]
    shared = SharedExpert(sgu_q, sdn_q, gate, sgu_s, sdn_s)
    r = routing
    got = moe_experts_triton.experts_mlp(
        x, r.token, r.order, r.counts, weights, gu_q, dn_q, False, shared=shared, scales=scales
    )
    assert rel_err(got, definition(x, ids, weights, gu, dn, (sgu, sdn, gate))) < tol


def test_fp8_pairs_held_on_another_rank_add_nothing() -> None:
    """Expert parallel: ids past this rank's experts are computed elsewhere."""
    gen = torch.Generator().manual_seed(4)
    block = (16, 32)
    x = torch.randn(6, 64, generator=gen).to(DEVICE)
    gu_q, gu_s, gu = fp8_weights(gen, (4, 64, 64), block)
    dn_q, dn_s, dn = fp8_weights(gen, (4, 64, 32), block)
    ids = moe.local_expert_ids(torch.randint(0, 8, (6, 3), generator=gen).to(DEVICE), 0, 4)
    weights = torch.rand(6, 3, generator=gen).to(DEVICE)
    got = moe.experts_forward(x, ids, weights, gu_q, dn_q, outside=True, scales=Fp8Scales(gu_s, dn_s, block))
    assert rel_err(got, definition(x, ids, weights, gu, dn)) < 1e-5


def fp8_moe_block(block: tuple[int, int], shared_inter: int) -> moe.SparseMoeBlock:
    """A Qwen3-Next MoE block (16 experts top-4) with float8 experts and shared expert."""
    gen = torch.Generator().manual_seed(shared_inter)
    layer = moe.SparseMoeBlock(64, 16, 4, 32, shared_inter, normalize=True)
    for p in layer.parameters():
        p.data = torch.randn(p.shape, generator=gen) * 0.1
    quantized = ("proj.weight", "experts.gate_up_proj")
    registry.convert_model(layer, lambda name: name.endswith(quantized), block)
    fp8.init_random_fp8(layer, gen, std=0.05)
    layer.fuse()
    return layer.to(DEVICE)


@pytest.mark.parametrize("shared_inter", [32, 48], ids=["shared-in-kernel", "shared-apart"])
def test_an_fp8_moe_block_gives_the_unfused_paths_output(
    monkeypatch: pytest.MonkeyPatch, shared_inter: int
) -> None:
    """The shared expert of the routed experts' shape runs inside the kernels (48: another
    intermediate size, added by the torch form). The unfused side dequantizes (torch matmuls in
    float32), so both compute the same function up to rounding."""
    layer = fp8_moe_block((16, 32), shared_inter)
    experts = layer.experts
    assert experts.gate_up_proj.dtype == fp8.FP8 and layer.shared_expert.gate_up.weight.dtype == fp8.FP8
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits, gate = layer.gates.outputs(x)
    scales = Fp8Scales(experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv, experts.block)
    in_kernel = moe.Shared(layer.shared_expert, gate).kernel_form(x, experts.gate_up_proj, scales)
    assert (in_kernel is not None) == (shared_inter == 32)
    assert moe_experts_triton.fused_ok(x, experts.gate_up_proj, 9 * 4, scales)
    got = layer(x)
    monkeypatch.setattr(moe_experts_triton, "FUSED_EXPERTS", False)
    monkeypatch.setattr(fp8, "kernels_available", lambda device: False)  # dequantize: the definition
    want = layer(x)
    # Apart, the shared expert goes through the FP8 linear kernels, whose float32 dots Triton runs
    # in tf32 (measured on the H200: 7.7e-4 against the dequantized float32 matmuls; tf32 lands
    # near 3e-4 to 1e-3); inside the expert kernels everything is float32.
    assert rel_err(got, want.to(F64)) < (1e-5 if shared_inter == 32 else 2e-3)


def test_an_fp8_hybrid_model_decodes_the_same_tokens_with_the_fused_experts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tiny-qwen3-next with float8 projections and experts (16 x 32 blocks) through the engine in
    float32 (decode graphs on CUDA, so the kernels are captured too): the greedy tokens and their
    logprobs with the fused FP8 expert kernels are those of the dequantizing path."""
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine
    from ballast.models.arch.builtin import BUILTIN, builtin_config
    from tp_harness import engine_greedy

    monkeypatch.setitem(
        BUILTIN,
        "tiny-qwen3-next-fp8-test",
        {**builtin_config("tiny-qwen3-next"), "quantization_config": {"weight_block_size": [16, 32]}},
    )
    monkeypatch.setattr(fp8, "kernels_available", lambda device: False)  # dense FP8 linears dequantize
    prompts = [[1, 400, 5000, 17, 23], [9, 8, 7], list(range(100, 160))]
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(moe_experts_triton, "FUSED_EXPERTS", fused)
        cfg = EngineConfig(
            model="builtin:tiny-qwen3-next-fp8-test",
            device=DEVICE.type,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=4,
        )
        engine = Engine.load(cfg)
        try:
            experts = engine.runner.model.model.layers[0].mlp.experts
            assert experts.gate_up_proj.dtype == fp8.FP8
            runs.append(engine_greedy(engine, prompts, 8))
        finally:
            engine.shutdown()
    (want, want_lp), (got, got_lp) = runs
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=2e-5, rtol=0)
