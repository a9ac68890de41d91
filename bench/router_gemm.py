"""The MoE router + shared-expert gate GEMM on CUDA: its output computed as x . W^T (rows E + 1
wide) against W . x^T handed back transposed (`FusedLinears(transposed=True)`, the engine's form).

An output row of E + 1 bf16 values (27 for the 6B cut, 513 for Qwen3-Next-80B) is not 16-byte
aligned, and cuBLAS then picks unvectorised kernels (a 32-row cutlass sm75 kernel of ~6.4 us a
layer in the session-11 decode profile); W . x^T's rows are the token count wide. Timed as
CUDA-graph replays over --layers distinct router weights (L2-cold), median per layer; the bound
is the weight bytes over a device copy's bandwidth. Table on stdout, JSON to
bench/results/router_gemm.json.

    python -m ballast.bench.router_gemm [--tokens 1 8 32 128 1024]
"""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ballast.bench.paged_attention import copy_bandwidth, graph_time

RESULTS = Path(__file__).resolve().parent / "results" / "router_gemm.json"
SHAPES = {"qwen3-next-6b": (27, 2048), "qwen3-next-80b": (513, 2048)}  # experts + shared gate, hidden


def form(
    weights: list[torch.Tensor], x: torch.Tensor, outs: dict[str, torch.Tensor], kind: str
) -> Callable[[], None]:
    """One GEMM a layer in `kind`'s form; the last output lands in outs[kind]."""

    def run() -> None:
        for w in weights:
            outs[kind] = torch.nn.functional.linear(x, w) if kind == "rows" else torch.mm(w, x.t()).t()

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 1024])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("router_gemm needs CUDA")
    bandwidth = copy_bandwidth()
    rows: list[dict[str, Any]] = []
    print("| shape | tokens | x . W^T us | W . x^T us | ratio | W . x^T % of copy bw |")
    print("|---|---|---|---|---|---|")
    for shape, (width, hidden) in SHAPES.items():
        weights = [
            torch.randn(width, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(args.layers)
        ]
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
            outs: dict[str, torch.Tensor] = {}
            t_rows = graph_time(form(weights, x, outs, "rows"), args.layers, args.repeats)
            t_trans = graph_time(form(weights, x, outs, "transposed"), args.layers, args.repeats)
            torch.testing.assert_close(outs["rows"], outs["transposed"], atol=0.5, rtol=2e-2)
            floor = width * hidden * 2 / bandwidth
            row = {
                "shape": shape,
                "tokens": tokens,
                "rows_us": 1e6 * t_rows,
                "transposed_us": 1e6 * t_trans,
                "transposed_bw_pct": 100 * floor / t_trans,
            }
            rows.append(row)
            print(
                f"| {shape} | {tokens} | {row['rows_us']:.2f} | {row['transposed_us']:.2f} | "
                f"{t_trans / t_rows:.2f} | {row['transposed_bw_pct']:.0f}% |",
                flush=True,
            )
    result = {
        "bench": "router_gemm",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "machine": platform.node(),
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
