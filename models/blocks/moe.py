"""Sparse mixture of experts with a shared expert (Qwen3-Next / Qwen3.5-MoE layout, HF names; the
experts fused as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]). Expert compute never loops
over tokens: the (token, expert) pairs are sorted by expert, then run as fused Triton kernels, one
`torch._grouped_mm` per projection, or one `bmm` over the active experts padded to the busiest.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from ballast.models.kernels import moe_experts_triton, moe_triton
from ballast.models.kernels.moe_experts_triton import Fp8Scales
from ballast.models.layers import fp8, pointwise
from ballast.models.layers.core import FusedLinears, SwiGLU
from torch import Tensor, nn


def route(logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor]:
    """Softmax over all experts in float32, keep the top k, optionally renormalise them to sum 1.
    Returns (weights [T, k] in logits' dtype, expert indices [T, k])."""
    if moe_triton.available(logits) and logits.shape[-1] <= moe_triton.MAX_EXPERTS:
        return moe_triton.route_topk(logits, top_k, normalize)  # one kernel
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts


@lru_cache(maxsize=8)
def grouped_mm_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs here for this dtype, asked once with a tiny problem (builds
    restrict devices, dtypes and architectures): the failure is the answer, not an error."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    device = torch.device(device_type)
    x = torch.ones(32, 16, dtype=dtype, device=device)
    w = torch.ones(2, 16, 16, dtype=dtype, device=device)
    offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
    try:
        out = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(out.float(), torch.full_like(out.float(), 16.0)))


def _grouped_ok(x: Tensor, gate_up: Tensor) -> bool:
    # CUDA grouped GEMM wants 16-byte aligned rows.
    aligned = all(d * x.element_size() % 16 == 0 for d in (gate_up.shape[1] // 2, gate_up.shape[2]))
    return (aligned or not x.is_cuda) and grouped_mm_supported(x.device.type, x.dtype)


def local_expert_ids(experts: Tensor, first: int, count: int) -> Tensor:
    """Expert parallel: the router's ids [T, k] -> ids among this rank's experts [first, first +
    count), `count` for another rank's (sorted last, never computed). No host sync."""
    local = experts - first
    return local.masked_fill((local < 0) | (local >= count), count)


class Routing(NamedTuple):
    """The (token, expert) pairs grouped by expert, in expert order: pair i is `order[i]` of the
    flat [T * k] pairs, reading token `token[i]`; `counts[e]` pairs go to expert e. kept: with
    pairs outside the experts (id num_experts, grouped last), how many come before them."""

    order: Tensor
    token: Tensor
    counts: Tensor
    kept: Tensor | None = None

    @classmethod
    def sort(cls, experts: Tensor, num_experts: int, outside: bool = False) -> Routing:
        flat = experts.reshape(-1)
        bins = num_experts + int(outside)
        if moe_triton.available(flat) and flat.shape[0] <= moe_triton.MAX_PAIRS:
            order, token, counts = moe_triton.align(flat, bins, experts.shape[1])  # one kernel
        else:
            order = flat.argsort(stable=True)
            token = order // experts.shape[1]
            # Not bincount: on CUDA it reads the largest index back to the host, which a graph
            # cannot hold.
            counts = torch.zeros(bins, dtype=torch.int64, device=flat.device).index_add_(
                0, flat, torch.ones_like(flat)
            )
        if not outside:
            return cls(order, token, counts)
        counts = counts[:num_experts]
        return cls(order, token, counts, counts.sum())

    def combine(self, y: Tensor, weights: Tensor, num_tokens: int) -> Tensor:
        """Per-pair outputs y [T * k, H] (sorted order) -> the weighted sum per token, in float32.
        Rows past `kept` count zero: no GEMM wrote them. Deterministic: summed in k order, no
        atomic adds (whose order varies run to run and can flip a bf16 rounding, then a token)."""
        back = torch.empty_like(self.order).scatter_(
            0, self.order, torch.arange(self.order.shape[0], device=y.device)
        )
        if moe_triton.available(y):
            return moe_triton.combine_pairs(y, back, weights.reshape(num_tokens, -1).contiguous(), self.kept)
        if self.kept is not None:
            rows = torch.arange(y.shape[0], device=y.device).unsqueeze(-1)
            y = torch.where(rows < self.kept, y, 0)
        per_token = y[back].float().view(num_tokens, -1, y.shape[1])
        return (per_token * weights.float().reshape(num_tokens, -1, 1)).sum(1).to(weights.dtype)


class Shared(NamedTuple):
    """A shared expert and its gate's logits [T, 1]: sigmoid(gate) * expert(x) joins the routed sum."""

    expert: SwiGLU
    gate: Tensor

    def output(self, x: Tensor) -> Tensor:
        return torch.sigmoid(self.gate) * self.expert(x)

    def kernel_form(
        self, x: Tensor, gate_up: Tensor, scales: Fp8Scales | None = None
    ) -> moe_experts_triton.SharedExpert | None:
        """The shared expert as one more expert of `moe_experts_triton.experts_mlp`, where its
        weights match the routed experts' shape and kind (float8 with the same scale blocks under
        `scales`); None otherwise, and the torch form adds it."""
        mlp = self.expert
        fused = mlp.gate_up
        if fused.separate or fused.bias is not None or mlp.down_proj.bias is not None:
            return None
        if not fused.fused:
            fused.fuse()
        assert fused.weight is not None
        down = mlp.down_proj.weight
        if fused.weight.shape != gate_up.shape[1:]:
            return None
        if scales is None:
            if fused.weight.dtype != x.dtype or down.dtype != x.dtype:
                return None
            return moe_experts_triton.SharedExpert(fused.weight, down, self.gate)
        down_scale = getattr(mlp.down_proj, "weight_scale_inv", None)
        if (
            fused.weight.dtype != fp8.FP8
            or fused.scale_inv is None
            or down_scale is None
            or fused.block != scales.block
            or getattr(mlp.down_proj, "block", None) != scales.block
        ):
            return None
        return moe_experts_triton.SharedExpert(fused.weight, down, self.gate, fused.scale_inv, down_scale)


def plus_shared(routed: Tensor, x: Tensor, shared: Shared | None) -> Tensor:
    """The routed experts' sum with the gated shared expert added (the torch paths)."""
    return routed if shared is None else routed + shared.output(x)


def experts_forward(
    x: Tensor,
    experts: Tensor,
    weights: Tensor,
    gate_up: Tensor,
    down: Tensor,
    use_grouped_mm: bool | None = None,
    outside: bool = False,
    shared: Shared | None = None,
    scales: Fp8Scales | None = None,
) -> Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) (+ the gated shared expert), [T, H] in
    x's dtype, accumulated in float32. x [T, H]; experts, weights [T, k]. outside: a pair may name
    expert E (held elsewhere), which adds 0. scales: float8 weights, for the fused kernels only.
    use_grouped_mm None: grouped GEMM where it runs here."""
    if gate_up.shape[0] == 0:  # no expert here received a pair (the dequantizing FP8 path)
        return plus_shared(torch.zeros_like(x), x, shared)
    routing = Routing.sort(experts, gate_up.shape[0], outside)
    if scales is not None or moe_experts_triton.fused_ok(x, gate_up, routing.order.shape[0]):
        r, w = routing, weights.to(x.dtype)
        in_kernel = shared.kernel_form(x, gate_up, scales) if shared is not None else None
        out = moe_experts_triton.experts_mlp(
            x, r.token, r.order, r.counts, w, gate_up, down, outside, shared=in_kernel, scales=scales
        )
        return out if in_kernel is not None else plus_shared(out, x, shared)
    rows = x.index_select(0, routing.token)
    grouped = _grouped_ok(x, gate_up) if use_grouped_mm is None else use_grouped_mm
    if grouped:
        # the offsets end at the last local pair: the grouped GEMM leaves the outside rows alone
        offs = routing.counts.cumsum(0).to(torch.int32)
        h = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(pointwise.silu_mul(h, h.shape[-1] // 2), down.transpose(1, 2), offs=offs)
    else:
        # this path reads the counts on the host anyway, so it computes only the local pairs
        kept = rows.shape[0] if routing.kept is None else int(routing.kept)
        y = rows.new_zeros((rows.shape[0], down.shape[1]))
        if kept:
            row_expert = experts.reshape(-1)[routing.order[:kept]]
            y[:kept] = _padded_bmm(rows[:kept], row_expert, routing.counts, gate_up, down)
    return plus_shared(routing.combine(y, weights.to(x.dtype), x.shape[0]), x, shared)


def _padded_bmm(rows: Tensor, row_expert: Tensor, counts: Tensor, gate_up: Tensor, down: Tensor) -> Tensor:
    """rows sorted by row_expert -> per-row expert output, via one bmm over the active experts."""
    active = counts.nonzero().flatten()
    per = counts[active]
    width = int(per.max())
    slot_of_expert = torch.full_like(counts, -1)
    slot_of_expert[active] = torch.arange(len(active), device=counts.device)
    first_row = torch.cumsum(counts, 0) - counts
    rank = torch.arange(rows.shape[0], device=rows.device) - first_row[row_expert]
    where = slot_of_expert[row_expert] * width + rank
    buf = rows.new_zeros((len(active) * width, rows.shape[1]))
    buf[where] = rows
    h = torch.bmm(buf.view(len(active), width, -1), gate_up[active].transpose(1, 2))
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(F.silu(gate) * up, down[active].transpose(1, 2))
    return y.reshape(len(active) * width, -1)[where]


# Many published checkpoints store each expert separately; our parameters are the fused tensors.
_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight"
    r"(?P<scale>_scale_inv)?$"
)


def fused_param(name: str) -> str:
    """The parameter a checkpoint tensor fills: its own name, or a per-expert tensor's fused one."""
    target = per_expert_target(name)
    return name if target is None else target[0]


def per_expert_target(name: str) -> tuple[str, int, str] | None:
    """For an unfused checkpoint tensor `....mlp.experts.{e}.{gate,up,down}_proj.weight` (or its FP8
    `weight_scale_inv`): (our fused parameter's name, e, part). None for any other name."""
    m = _PER_EXPERT.match(name)
    if m is None:
        return None
    fused = "gate_up_proj" if m["part"] in ("gate_proj", "up_proj") else "down_proj"
    return f"{m['prefix']}.{fused}{m['scale'] or ''}", int(m["expert"]), m["part"]


def place_expert_tensor(fused: Tensor, expert: int, part: str, tensor: Tensor) -> None:
    """Copy one expert's projection into its fused parameter: gate -> gate_up_proj[e, :I], up ->
    [e, I:] (the reference's order), down -> down_proj[e]."""
    rows = tensor.shape[0]
    dst = {"gate_proj": fused[expert, :rows], "up_proj": fused[expert, rows:], "down_proj": fused[expert]}[
        part
    ]
    if dst.shape != tensor.shape:
        raise ValueError(
            f"expert {expert} {part}: tensor {tuple(tensor.shape)} does not fit {tuple(dst.shape)}"
        )
    dst.copy_(tensor)


class Experts(nn.Module):
    # float8 weights' scale block (rows, cols) and scales, once `convert_experts` made them float8
    block: tuple[int, int] = (128, 128)
    gate_up_proj_scale_inv: Tensor
    down_proj_scale_inv: Tensor
    # Expert parallel: this module holds only experts [first, first + its count) of the router's
    # (`parallel.hold_local_experts` sets it); the others' pairs add 0 here.
    first: int | None = None

    def __init__(self, hidden: int, intermediate: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))

    def forward(self, x: Tensor, experts: Tensor, weights: Tensor, shared: Shared | None = None) -> Tensor:
        gate_up, down, outside, scales = self.gate_up_proj, self.down_proj, self.first is not None, None
        if self.first is not None:
            experts = local_expert_ids(experts, self.first, gate_up.shape[0])
        if gate_up.dtype == fp8.FP8:
            scales = Fp8Scales(self.gate_up_proj_scale_inv, self.down_proj_scale_inv, self.block)
            if not moe_experts_triton.fused_ok(x, gate_up, experts.numel(), scales):
                return plus_shared(fp8_experts_forward(self, x, experts, weights, outside), x, shared)
        return experts_forward(
            x, experts, weights, gate_up, down, outside=outside, shared=shared, scales=scales
        )


class SparseMoeBlock(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert, over flat tokens x [T, H]."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        expert_intermediate: int,
        shared_intermediate: int,
        normalize: bool,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.top_k, self.normalize = top_k, normalize
        self.experts = Experts(hidden, expert_intermediate, num_experts)
        self.shared_expert = SwiGLU(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        # the router's and the shared expert's gate read the same x: one GEMM, its E + 1 wide
        # output computed transposed
        self.gates = FusedLinears(self.gate, self.shared_expert_gate, transposed=True)

    def fuse(self, keep_values: bool = True) -> None:
        self.gates.fuse(keep_values)
        self.shared_expert.gate_up.fuse(keep_values)

    def token_thresholds(self) -> tuple[int, ...]:
        """The token counts from which this block's kernels change (its token x expert pairs pass
        a kernel's limit: the routing kernel's, the fused expert kernels', the FP8 x FP8 experts'
        and their tiling's): start-up's warm-up steps meet each on both sides."""
        pairs = [
            moe_triton.MAX_PAIRS,
            moe_experts_triton.MAX_FUSED_PAIRS,
            moe_experts_triton.MAX_FUSED_FP8_PAIRS,
        ]
        pairs = [p + 1 for p in pairs]  # each serves up to its limit
        try:
            from ballast.models.kernels import w8a8_triton
        except ImportError:  # no Triton: the torch paths, no kernel limits
            return ()
        pairs += [w8a8_triton.FROM_ROWS, w8a8_triton.EXPERT_TILE_ROWS * self.gate.out_features + 1]
        return tuple(sorted({-(-p // self.top_k) for p in pairs}))

    def token_multiples(self) -> tuple[int, ...]:
        """Its kernels launch over the token x expert pairs: top_k x the tokens."""
        return (self.top_k,)

    def forward(self, x: Tensor) -> Tensor:
        logits, shared_gate = self.gates.outputs(x)
        weights, experts = route(logits, self.top_k, self.normalize)
        return self.experts(x, experts, weights, Shared(self.shared_expert, shared_gate))


def convert_experts(experts: Experts, block: fp8.Block) -> None:
    """Give an `Experts` module float8 `gate_up_proj` / `down_proj` and their `*_scale_inv` (a
    gate_up scale grid is whole only when the intermediate size is whole blocks of rows)."""
    for name in ("gate_up_proj", "down_proj"):
        w: Tensor = getattr(experts, name)
        fp8_weight = torch.empty(w.shape, dtype=fp8.FP8, device=w.device)
        setattr(experts, name, nn.Parameter(fp8_weight, requires_grad=False))
        setattr(experts, name + "_scale_inv", fp8.scale_param(tuple(w.shape), block, w.device))
    experts.block = block


def expert_weights(experts: Experts, name: str, index: Tensor, dtype: torch.dtype) -> Tensor:
    """The experts `index` of fused parameter `name`, dequantized when float8 (the reference path)."""
    w: Tensor = getattr(experts, name)
    if w.dtype != fp8.FP8:
        return w[index]
    return fp8.dequantize_blocks(w[index], getattr(experts, name + "_scale_inv")[index], experts.block, dtype)


def fp8_experts_forward(
    module: Experts, x: Tensor, experts: Tensor, weights: Tensor, outside: bool = False
) -> Tensor:
    """`experts_forward` over float8 weights: where the kernels run, prefill-sized batches through
    the FP8 x FP8 grouped GEMMs (`w8a8_triton`), smaller ones one weight-only grouped FP8 GEMM per
    projection; else the dense path over only the experts that received tokens, dequantized."""
    num_experts = module.gate_up_proj.shape[0]
    if not fp8.kernels_available(x.device):
        active, local = experts.unique(return_inverse=True)
        # id num_experts (held elsewhere), if present, is the largest: its local id is len(held)
        held = active[active < num_experts]
        gate_up = expert_weights(module, "gate_up_proj", held, x.dtype)
        down = expert_weights(module, "down_proj", held, x.dtype)
        return experts_forward(x, local, weights, gate_up, down, outside=outside)
    from ballast.models.kernels import w8a8_triton
    from ballast.models.kernels.fp8_triton import Groups, grouped_fp8_matmul

    routing = Routing.sort(experts, num_experts, outside)
    block = module.block
    if w8a8_triton.serves(x, module.gate_up_proj, block, routing.token.shape[0]):
        weights_and_scales = (module.gate_up_proj, module.gate_up_proj_scale_inv, module.down_proj)
        y = w8a8_triton.experts_w8a8(
            x, routing.token, routing.counts, *weights_and_scales, module.down_proj_scale_inv, block
        )
        return routing.combine(y, weights.to(x.dtype), x.shape[0])
    rows = x.index_select(0, routing.token)
    groups = Groups.plan(routing.counts, rows.shape[0], block)
    h = grouped_fp8_matmul(rows, groups, module.gate_up_proj, module.gate_up_proj_scale_inv, block)
    act = pointwise.silu_mul(h, h.shape[1] // 2)
    y = grouped_fp8_matmul(act, groups, module.down_proj, module.down_proj_scale_inv, block)
    return routing.combine(y, weights.to(x.dtype), x.shape[0])
