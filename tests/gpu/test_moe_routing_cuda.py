"""The Triton routing of a decode-sized batch (`models/kernels/moe_triton.py`) against the torch path:
the same top-k experts and weights, groups that hold the same pairs, and the same expert output.
On CUDA; also under Triton's CPU interpreter (TRITON_INTERPRET=1 with triton installed)."""

from __future__ import annotations

import pytest
import torch
from ballast.models.blocks import moe
from ballast.models.kernels import moe_experts_triton, moe_triton
from ballast.models.layers.core import SwiGLU
from triton_kernels import DEVICE, marks

pytestmark = marks(moe_triton)


@pytest.fixture(autouse=True)
def triton_routing(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe.route and Routing.sort take the Triton path (as on CUDA) under the interpreter too."""
    monkeypatch.setattr(moe_triton, "available", lambda x: True)


def torch_route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


@pytest.mark.parametrize("column_major", [False, True])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(1, 26, 10), (32, 512, 10), (7, 60, 4), (3, 5, 5)])
def test_route_topk_picks_the_experts_and_weights_of_torch(
    tokens: int, experts: int, top_k: int, normalize: bool, column_major: bool
) -> None:
    """column_major: the logits as the router + shared gate GEMM gives them (computed transposed,
    the gate's column after the experts')."""
    gen = torch.Generator().manual_seed(experts)
    if column_major:
        logits = torch.randn(experts + 1, tokens, generator=gen).to(DEVICE).t()[:, :experts]
    else:
        logits = torch.randn(tokens, experts, generator=gen).to(DEVICE)
    weights, ids = moe_triton.route_topk(logits, top_k, normalize)
    want_w, want_ids = torch_route(logits, top_k, normalize)
    assert ids.dtype == torch.int64 and weights.dtype == logits.dtype
    assert torch.equal(ids, want_ids)  # random logits: no ties, the same order (largest first)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("outside", [False, True])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(1, 26, 10), (32, 26, 10), (409, 512, 10), (5, 3, 2)]
)
def test_align_groups_every_pair_under_its_expert(
    tokens: int, experts: int, top_k: int, outside: bool
) -> None:
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts + int(outside), generator=gen)[:top_k] for _ in range(tokens)])
    ids = ids.to(DEVICE)
    got = moe.Routing.sort(ids, experts, outside)  # the Triton path on CUDA / under the interpreter
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    want_counts = torch.bincount(flat, minlength=experts + int(outside))[:experts]
    assert torch.equal(got.counts, want_counts)
    if outside:
        assert int(got.kept) == int(want_counts.sum())
    assert torch.equal(got.token, got.order // top_k)
    # every group holds the same pairs as the stable sort's (in any order within it)
    assert torch.equal(flat[got.order], flat[order])
    assert torch.equal(
        torch.sort(got.order * 1024 + flat[got.order])[0], torch.sort(order * 1024 + flat[order])[0]
    )


def test_the_expert_output_is_the_torch_routings() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(24, 64, generator=gen).to(DEVICE)
    gate_up = (torch.randn(12, 2 * 32, 64, generator=gen) * 0.1).to(DEVICE)
    down = (torch.randn(12, 64, 32, generator=gen) * 0.1).to(DEVICE)
    logits = torch.randn(24, 12, generator=gen).to(DEVICE)
    weights, ids = moe.route(logits, 4, True)
    got = moe.experts_forward(x, ids, weights, gate_up, down, use_grouped_mm=False)
    want_w, want_ids = torch_route(logits, 4, True)
    flat = want_ids.reshape(-1)
    want = torch.zeros_like(x)
    for pair in range(flat.shape[0]):  # one (token, expert) pair at a time: the definition
        t, e = pair // 4, int(flat[pair])
        gate, up = (gate_up[e] @ x[t]).chunk(2)
        want[t] += want_w[t, pair % 4] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_garbage_row_still_routes_to_real_experts() -> None:
    """A decode graph's padding rows carry whatever the scratch slot holds (NaN included): their
    expert ids must stay in range, or grouping them would write out of bounds."""
    logits = torch.randn(4, 26, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    logits[1] = float("nan")
    logits[2, 3] = float("inf")
    weights, ids = moe.route(logits, 10, True)
    assert ((ids >= 0) & (ids < 26)).all()
    routing = moe.Routing.sort(ids, 26)
    assert int(routing.counts.sum()) == ids.numel()
    assert torch.equal(torch.sort(routing.order)[0], torch.arange(ids.numel(), device=DEVICE))


def test_the_expert_output_is_the_same_bits_on_every_run() -> None:
    """The grouping kernel's atomics put a group's pairs in a different order on each run; the
    combine must not carry that into the sum (an atomic add would, and in bf16 a flipped rounding
    can change a greedy token between two runs of one prompt)."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(64, 256, generator=gen).to(DEVICE, torch.bfloat16)
    gate_up = (torch.randn(26, 2 * 64, 256, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)
    down = (torch.randn(26, 256, 64, generator=gen) * 0.1).to(DEVICE, torch.bfloat16)
    weights, ids = moe.route(torch.randn(64, 26, generator=gen).to(DEVICE), 10, True)
    runs = [moe.experts_forward(x, ids, weights.to(x.dtype), gate_up, down) for _ in range(8)]
    orders = {tuple(moe.Routing.sort(ids, 26).order.tolist()) for _ in range(8)}
    assert all(torch.equal(run, runs[0]) for run in runs), f"{len(orders)} orders of the pairs"


def definition(x, ids, weights, gate_up, down):  # noqa: ANN001, ANN201
    """One (token, expert) pair at a time, float32; a pair naming no local expert adds 0."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= gate_up.shape[0]:
                continue
            gate, up = (gate_up[e].float() @ x[t].float()).chunk(2)
            out[t] += float(weights[t, j]) * (down[e].float() @ (torch.nn.functional.silu(gate) * up))
    return out


FUSED_CASES = [
    # tokens, experts, top_k, hidden, inter, dtype
    (24, 12, 4, 64, 32, torch.float32),
    (3, 26, 10, 80, 40, torch.float32),  # hidden and inter not multiples of the blocks
    (40, 8, 2, 64, 48, torch.bfloat16),
]


@pytest.mark.parametrize("rows_per_pass", [None, 16])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter", "dtype"), FUSED_CASES)
def test_the_fused_expert_kernels_compute_the_definition(
    monkeypatch: pytest.MonkeyPatch,
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    rows_per_pass: int | None,
) -> None:
    """Every token also picks expert 0, so that expert holds more rows than one block (its program
    loops), and some experts get no pair at all (their programs exit). With 16 rows a pass, the
    shared expert's program (a row per token) loops too."""
    if dtype != torch.float32 and DEVICE.type == "cpu":
        pytest.skip("Triton's CPU interpreter (3.9) computes tl.dot of bf16 operands wrongly; on CUDA only")
    monkeypatch.setattr(moe_experts_triton, "FUSED_EXPERTS", True)
    if rows_per_pass is not None:
        monkeypatch.setattr(
            moe_experts_triton, "rows_per_pass", lambda pairs, experts, shared_rows: rows_per_pass
        )
    gen = torch.Generator().manual_seed(tokens + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).to(DEVICE, dtype)
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(experts - 1, generator=gen)[: top_k - 1] + 1 for _ in range(tokens)])
    ids = torch.cat([torch.zeros(tokens, 1, dtype=torch.int64), ids], 1).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(DEVICE, dtype)
    assert moe_experts_triton.fused_ok(x, gate_up, ids.numel())
    got = moe.experts_forward(x, ids, weights, gate_up, down)
    want = definition(x, ids, weights, gate_up, down)
    assert got.dtype == dtype
    tol = {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want, **tol)
    # A shared expert's gated output joins the sum: as one more program of the kernels where it
    # has the routed experts' shape, else added by the torch form. The gate logit is a column view,
    # as the fused router + gate projection gives it.
    logits = torch.randn(tokens, 3, generator=gen).to(DEVICE, dtype)[:, 1:2]
    for shared_inter, in_kernel in ((inter, True), (inter + 16, False)):
        mlp = SwiGLU(hidden, shared_inter)
        for p in mlp.parameters():
            p.data = torch.randn(p.shape, generator=gen) * 0.1
        mlp = mlp.to(DEVICE, dtype)
        shared = moe.Shared(mlp, logits)
        assert (shared.kernel_form(x, gate_up) is not None) == in_kernel
        got = moe.experts_forward(x, ids, weights, gate_up, down, shared=shared)
        gate_up_s = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).float()
        g, u = (x.float() @ gate_up_s.T).chunk(2, dim=-1)
        shared_out = (torch.nn.functional.silu(g) * u) @ mlp.down_proj.weight.float().T
        torch.testing.assert_close(got.float(), want + torch.sigmoid(logits.float()) * shared_out, **tol)


def test_the_fused_kernels_add_nothing_for_pairs_held_on_another_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Expert parallel: ids past the local experts (`outside`) are computed elsewhere."""
    monkeypatch.setattr(moe_experts_triton, "FUSED_EXPERTS", True)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=gen).to(DEVICE)
    gate_up = (torch.randn(4, 64, 64, generator=gen) * 0.1).to(DEVICE)
    down = (torch.randn(4, 64, 32, generator=gen) * 0.1).to(DEVICE)
    ids = moe.local_expert_ids(torch.randint(0, 8, (6, 3), generator=gen).to(DEVICE), 0, 4)
    weights = torch.rand(6, 3, generator=gen).to(DEVICE)
    got = moe.experts_forward(x, ids, weights, gate_up, down, outside=True)
    torch.testing.assert_close(got, definition(x, ids, weights, gate_up, down), atol=2e-5, rtol=1e-4)


def test_a_hybrid_model_decodes_the_same_tokens_with_the_fused_experts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """tiny-qwen3-next in float32 through the engine (decode graphs on CUDA, so the kernels are
    captured too): the greedy tokens and their logprobs with the fused expert kernels are those of
    the grouped-GEMM path."""
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine
    from tp_harness import engine_greedy

    prompts = [[1, 400, 5000, 17, 23], [9, 8, 7], list(range(100, 160))]
    runs = []
    for fused in (False, True):
        monkeypatch.setattr(moe_experts_triton, "FUSED_EXPERTS", fused)
        cfg = EngineConfig(
            model="builtin:tiny-qwen3-next",
            device=DEVICE.type,
            dtype="float32",
            max_model_len=256,
            max_num_seqs=4,
        )
        engine = Engine.load(cfg)
        try:
            runs.append(engine_greedy(engine, prompts, 8))
        finally:
            engine.shutdown()
    (want, want_lp), (got, got_lp) = runs
    assert got == want
    # float32: the paths differ by ~1e-6 (summation order); an expert output off by 1% moves
    # this near-uniform model's logprobs by ~2e-4
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=2e-5, rtol=0)


@pytest.mark.parametrize("outside", [False, True], ids=["local", "expert-parallel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_combine_pairs_is_each_tokens_weighted_sum_of_its_rows(dtype: torch.dtype, outside: bool) -> None:
    """The grouped GEMM's combine (`moe_triton.combine_pairs`, what `Routing.combine` runs on CUDA):
    token t's output is sum_j weights[t, j] * y[its pair j's row], rows of pairs held on another
    rank (past `kept`) adding nothing even when they hold garbage."""
    tokens, num_experts, top_k, hidden = 37, 12, 10, 300
    gen = torch.Generator().manual_seed(tokens + int(outside))
    experts = torch.stack(
        [torch.randperm(num_experts + int(outside), generator=gen)[:top_k] for _ in range(tokens)]
    )
    routing = moe.Routing.sort(experts.to(DEVICE), num_experts, outside)
    y = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype).to(DEVICE)
    weights = torch.rand(tokens, top_k, generator=gen).to(dtype).to(DEVICE)
    kept = tokens * top_k if routing.kept is None else int(routing.kept)
    assert kept < tokens * top_k if outside else kept == tokens * top_k
    y[kept:] = float("nan")
    back = torch.empty_like(routing.order)
    back[routing.order] = torch.arange(tokens * top_k, device=DEVICE)
    rows = y.double()[back].view(tokens, top_k, hidden)
    rows = torch.where((back < kept).view(tokens, top_k, 1), rows, 0.0)
    want = (rows * weights.double().unsqueeze(-1)).sum(1)
    got = moe_triton.combine_pairs(y, back, weights, routing.kept)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype and torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    assert torch.equal(routing.combine(y, weights, tokens), got)
