"""One MoE layer's experts on CUDA at decode batch sizes: torch's grouped GEMM path against our fused
Triton kernels (`moe_experts_triton.experts_mlp`), both through `moe.experts_forward` as the engine calls
it (routing sort, expert MLPs, weighted sum over top-k), with the shared expert both models have
(the torch side runs it as its own GEMMs, as the engine does off the fused path), bf16; with
--fp8 the weights are float8 with 128 x 128 block scales (the FP8 releases' layout) and the torch
side is the path FP8 experts took before the fused kernels read them (`moe.fp8_experts_forward`:
a device tile table and two grouped FP8 GEMMs; the shared expert as FP8 linears).

Shapes: Qwen3-Next-80B-A3B's MoE layer (512 experts, top-10, hidden 2048, expert width 512) and
the 26-expert cut of it that `builtin:qwen3-next-6b` uses. Timed as CUDA-graph replays, the way the
engine runs decode, each replay walking --layers layers of distinct weights (several times the L2
cache), so no expert's weights are still cached when they are read again. The bound is the bytes
of the experts the batch reads (gate, up and down of the shared expert and of every expert that
received a pair: the dense-equivalent of what the step must read) over the bandwidth of a device
copy measured here; "% bw" is that floor over the time. --sweep also times other tilings of the
fused kernels (rows a pass, then the gate/up kernel, then the down kernel, each with the best
before) and reports the fastest: how `ExpertTiling`'s defaults are chosen. Table on stdout, JSON
to bench/results/moe_experts.json.

    python -m ballast.bench.moe_experts [--tokens 1 8 32 128 256] [--sweep] [--fp8 [--w8a8-sweep]]

--w8a8-sweep (with --fp8) times the FP8 x FP8 grouped experts (`w8a8_triton`, what the engine runs
from 256 token x expert pairs) at each of W8A8_TILES' expert tilings, the shared expert included as
on the grouped side: the decode sizes of 32-128 streams (issue 48) choose between the paths here.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ballast.bench.paged_attention import copy_bandwidth, fastest, graph_time
from ballast.models.blocks import moe
from ballast.models.kernels import moe_experts_triton, moe_triton
from ballast.models.kernels.fp8_triton import Tiles
from ballast.models.kernels.moe_experts_triton import ExpertTiling, Fp8Scales, KernelTiling, SharedExpert
from ballast.models.layers import fp8
from torch import nn

RESULTS = Path(__file__).parent / "results" / "moe_experts.json"
# name: (experts, top-k, hidden, expert width), from builtin.py's Qwen3-Next configs
SHAPES = {"qwen3-next-80b": (512, 10, 2048, 512), "qwen3-next-6b": (26, 10, 2048, 512)}
L2_BYTES = 50 * 2**20
BLOCK = (128, 128)  # --fp8: the scale block of the FP8 releases


@dataclasses.dataclass
class Layers:
    """--layers MoE layers of one shape and one batch's routing for each."""

    x: torch.Tensor  # [T, H]
    gate_up: list[torch.Tensor]  # [E, 2I, H] per layer
    down: list[torch.Tensor]  # [E, H, I] per layer
    ids: list[torch.Tensor]  # [T, k] per layer
    weights: list[torch.Tensor]  # [T, k] per layer
    shared: list[SharedExpert]  # the shared expert of each layer (both real models have one)
    expert_bytes: float  # mean bytes of the experts a layer reads: the routed ones and the shared
    scales: list[Fp8Scales] | None = None  # --fp8: each layer's block scales (the shared's in it)
    modules: list[moe.Experts] | None = None  # --fp8: the layers as `Experts` (the torch side)


def make_layers(shape: str, tokens: int, count: int, float8: bool = False, device: str = "cuda") -> Layers:
    experts, top_k, hidden, inter = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(tokens)
    dev, bf16 = device, torch.bfloat16

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=dev, generator=gen) * 0.02).to(bf16)

    def weight(*size: int) -> torch.Tensor:
        """bf16 ~N(0, 0.02), or float8 ~N(0, 1) standing for it with every block scale 0.02."""
        if not float8:
            return rand(*size)
        return torch.randn(*size, device=dev, generator=gen, dtype=bf16).to(fp8.FP8)

    def scale(w: torch.Tensor) -> torch.Tensor:
        rows, cols = w.shape[-2:]
        grid = (*w.shape[:-2], -(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
        return torch.full(grid, 0.02, device=dev)

    x = rand(tokens, hidden) * 50
    gate_up = [weight(experts, 2 * inter, hidden) for _ in range(count)]
    down = [weight(experts, hidden, inter) for _ in range(count)]
    ids, weights, shared, touched = [], [], [], 0
    for _ in range(count):
        logits = torch.randn(tokens, experts, device=dev, generator=gen).to(bf16)
        w, e = moe.route(logits, top_k, normalize=True)
        ids.append(e)
        weights.append(w)
        s_gu, s_dn = weight(2 * inter, hidden), weight(hidden, inter)
        scales = (scale(s_gu), scale(s_dn)) if float8 else (None, None)
        shared.append(SharedExpert(s_gu, s_dn, rand(tokens, 1) * 50, *scales))
        touched += int(e.unique().numel()) + 1
    per_expert = 3 * hidden * inter * (1 if float8 else 2)
    layers = Layers(x, gate_up, down, ids, weights, shared, touched / count * per_expert)
    if float8:
        pairs = list(zip(gate_up, down, strict=True))
        layers.scales = [Fp8Scales(scale(gu), scale(dn), BLOCK) for gu, dn in pairs]
        layers.modules = [fp8_experts(gu, dn, sc) for (gu, dn), sc in zip(pairs, layers.scales, strict=True)]
    return layers


def fp8_experts(gate_up: torch.Tensor, down: torch.Tensor, scales: Fp8Scales) -> moe.Experts:
    """An `Experts` module holding these float8 weights (built on the meta device, then given them)."""
    experts, two_i, hidden = gate_up.shape
    with torch.device("meta"):
        module = moe.Experts(hidden, two_i // 2, experts)
    moe.convert_experts(module, scales.block)
    for name, t in (("gate_up_proj", gate_up), ("down_proj", down)):
        setattr(module, name, nn.Parameter(t, requires_grad=False))
    module.gate_up_proj_scale_inv = nn.Parameter(scales.gate_up, requires_grad=False)
    module.down_proj_scale_inv = nn.Parameter(scales.down, requires_grad=False)
    return module


def torch_side(layers: Layers, i: int) -> torch.Tensor:
    """Layer i the way the engine ran it off the fused path: routed experts, then the shared
    expert's own GEMMs, SwiGLU, gate and add."""
    x, e, w, s = layers.x, layers.ids[i], layers.weights[i], layers.shared[i]
    inter = s.down.shape[1]
    if layers.modules is None:
        routed = moe.experts_forward(x, e, w, layers.gate_up[i], layers.down[i], use_grouped_mm=True)
        h = torch.nn.functional.linear(x, s.gate_up)
        out = torch.nn.functional.linear(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:], s.down)
    else:
        assert s.gate_up_scale is not None and s.down_scale is not None
        routed = moe.fp8_experts_forward(layers.modules[i], x, e, w)
        h = fp8.fp8_linear(x, s.gate_up, s.gate_up_scale, BLOCK)
        act = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
        out = fp8.fp8_linear(act, s.down, s.down_scale, BLOCK)
    return routed.add_(torch.sigmoid(s.gate) * out)


def w8a8_side(layers: Layers, i: int, tiles: Tiles) -> torch.Tensor:
    """Layer i through the FP8 x FP8 grouped GEMMs (`w8a8_triton.experts_w8a8`, the path of 256
    pairs and more) at the given expert tiling, then the shared expert as `torch_side` runs it."""
    from ballast.models.kernels import w8a8_triton

    assert layers.modules is not None
    x, e, w, s, m = layers.x, layers.ids[i], layers.weights[i], layers.shared[i], layers.modules[i]
    r = moe.Routing.sort(e, m.gate_up_proj.shape[0])
    y = w8a8_triton.experts_w8a8(
        x, r.token, r.counts, m.gate_up_proj, m.gate_up_proj_scale_inv, m.down_proj, m.down_proj_scale_inv,
        BLOCK, tiles,
    )  # fmt: skip
    routed = r.combine(y, w.to(x.dtype), x.shape[0])
    assert s.gate_up_scale is not None and s.down_scale is not None
    inter = s.down.shape[1]
    h = fp8.fp8_linear(x, s.gate_up, s.gate_up_scale, BLOCK)
    out = fp8.fp8_linear(torch.nn.functional.silu(h[:, :inter]) * h[:, inter:], s.down, s.down_scale, BLOCK)
    return routed.add_(torch.sigmoid(s.gate) * out)


# --w8a8-sweep: expert tilings of the FP8 x FP8 GEMMs (rows, columns, K = the scale block, warps, stages)
W8A8_TILES = [
    Tiles(16, 128, 128, 4, 4),
    Tiles(32, 128, 128, 4, 4),
    Tiles(64, 64, 128, 4, 4),
    Tiles(64, 128, 128, 4, 4),
    Tiles(64, 256, 128, 8, 3),
    Tiles(128, 128, 128, 8, 3),
]


def w8a8_sweep(layers: Layers, repeats: int) -> tuple[Tiles, float, dict[str, float]]:
    """Every W8A8_TILES tiling of the FP8 x FP8 experts over the layers: the fastest, its time,
    and each one's us."""
    times: dict[str, float] = {}

    def time_of(tiles: Tiles) -> float:
        def run() -> None:
            for i in range(len(layers.ids)):
                w8a8_side(layers, i, tiles)

        t = graph_time(run, len(layers.ids), repeats)
        times[f"{tiles.block_m}x{tiles.block_n}/{tiles.warps}w{tiles.stages}s"] = 1e6 * t
        print(f"  w8a8 {1e6 * t:8.1f} us {tiles}", flush=True)
        return t

    best, t_best = fastest(W8A8_TILES, time_of)
    return best, t_best, times


def run_layers(layers: Layers, fused: bool, tiling: ExpertTiling | None = None) -> Callable[[], None]:
    def run() -> None:
        switch = moe_experts_triton.FUSED_EXPERTS
        moe_experts_triton.FUSED_EXPERTS = False  # the torch side must not take the fused path
        try:
            for i, (gu, dn, e, w, s) in enumerate(
                zip(layers.gate_up, layers.down, layers.ids, layers.weights, layers.shared, strict=True)
            ):
                if not fused:
                    torch_side(layers, i)
                    continue
                r = moe.Routing.sort(e, gu.shape[0])
                sc = layers.scales[i] if layers.scales is not None else None
                x = layers.x
                moe_experts_triton.experts_mlp(
                    x, r.token, r.order, r.counts, w, gu, dn, False, tiling, s, scales=sc
                )
        finally:
            moe_experts_triton.FUSED_EXPERTS = switch

    return run


def sweep(layers: Layers, repeats: int) -> tuple[ExpertTiling, float]:
    def time_of(tiling: ExpertTiling) -> float:
        t = graph_time(run_layers(layers, True, tiling), len(layers.ids), repeats)
        print(f"  {1e6 * t:8.1f} us {tiling}", flush=True)
        return t

    # Deeper pipelines for the narrower tiles: at one token a launch has ~88 programs (fewer
    # than the SMs), so bytes in flight (programs x stages x tile) bound its bandwidth. Float8
    # K steps stop at the 128-column scale block, so wider ones would repeat 128.
    widest_k = 128 if layers.scales is not None else 256
    kernels = [
        KernelTiling(n, k, w, s)
        for n, k, w, s in itertools.product((16, 32, 64, 128), (64, 128, 256), (4, 8), (3, 4, 6))
        if (w == 4 or (n == 128 and k > 64)) and k <= widest_k and (s < 6 or (n <= 64 and k <= 128))
    ]
    rows, _ = fastest((ExpertTiling(block_m=m) for m in (16, 32, 64)), time_of)
    best_gu, _ = fastest((dataclasses.replace(rows, gate_up=t) for t in kernels), time_of)
    return fastest((dataclasses.replace(best_gu, down=t) for t in kernels), time_of)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also time other tilings of the fused kernels")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=[1, 32], help="the batches --sweep tries")
    ap.add_argument("--fp8", action="store_true", help="float8 weights with 128 x 128 block scales")
    ap.add_argument(
        "--w8a8-sweep",
        action="store_true",
        help="with --fp8: the FP8 x FP8 experts at each tiling (W8A8_TILES)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and moe_triton.triton is not None):
        raise SystemExit("moe_experts needs CUDA and Triton")
    bandwidth = copy_bandwidth()
    print(f"device copy bandwidth: {bandwidth / 1e12:.2f} TB/s", flush=True)
    rows: list[dict[str, Any]] = []
    for shape in args.shapes:
        _, top_k, hidden, inter = SHAPES[shape]
        width = 1 if args.fp8 else 2  # bytes a weight
        count = max(2, -(-4 * L2_BYTES // (top_k * 3 * hidden * inter * width)))  # >= 4 L2s routed a replay
        for tokens in args.tokens:
            layers = make_layers(shape, tokens, count, args.fp8)
            floor = layers.expert_bytes / bandwidth
            row: dict[str, Any] = {"shape": shape, "tokens": tokens, "layers": count, "fp8": args.fp8}
            row["expert_mb"] = layers.expert_bytes / 1e6
            row["grouped_us"] = 1e6 * graph_time(run_layers(layers, False), count, args.repeats)
            row["fused_us"] = 1e6 * graph_time(run_layers(layers, True), count, args.repeats)
            if args.sweep and tokens in args.sweep_tokens:
                best, t_best = sweep(layers, max(3, args.repeats // 2))
                row["best_tiling"], row["best_us"] = dataclasses.asdict(best), 1e6 * t_best
            if args.w8a8_sweep and args.fp8:
                tiles, t_w8a8, row["w8a8_us_by_tiles"] = w8a8_sweep(layers, max(3, args.repeats // 2))
                row["w8a8_best_tiles"], row["w8a8_best_us"] = tiles._asdict(), 1e6 * t_w8a8
            for side in ("grouped", "fused", "best", "w8a8_best"):
                if f"{side}_us" in row:
                    row[f"{side}_bw_pct"] = 100 * floor / (row[f"{side}_us"] / 1e6)
            print(
                f"{shape} {tokens:>4} tokens: grouped {row['grouped_us']:8.1f} us "
                f"({row['grouped_bw_pct']:4.1f}% bw)  fused {row['fused_us']:8.1f} us "
                f"({row['fused_bw_pct']:4.1f}% bw)"
                + (f"  best {row['best_us']:8.1f} us {row['best_tiling']}" if "best_us" in row else "")
                + (
                    f"  w8a8 best {row['w8a8_best_us']:8.1f} us ({row['w8a8_best_bw_pct']:4.1f}% bw) "
                    f"{row['w8a8_best_tiles']}"
                    if "w8a8_best_us" in row
                    else ""
                ),
                flush=True,
            )
            rows.append(row)
            del layers
            torch.cuda.empty_cache()
    print("\n| shape | tokens | experts read MB | grouped us | fused us | fused / grouped | fused % of bw |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['shape']}{' FP8' if r['fp8'] else ''} | {r['tokens']} | {r['expert_mb']:.0f} | "
            f"{r['grouped_us']:.1f} | "
            f"{r['fused_us']:.1f} | {r['fused_us'] / r['grouped_us']:.2f} | {r['fused_bw_pct']:.0f}% |"
        )
    result = {
        "bench": "moe_experts",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "machine": platform.node(),
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "default_tiling": dataclasses.asdict(ExpertTiling()),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
