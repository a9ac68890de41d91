"""FP8 weight GEMMs at decode and prefill sizes, one kernel at a time (CUDA): our Triton weight-only
FP8 kernel in several tilings against cuBLAS bf16 on the dequantized weight and
`torch._scaled_mm` with 1x128 activation / 128x128 weight block scales and our FP8 x FP8 Triton
kernel (FP8 activations, quantized per call; timed with the quantization), on Llama-3.1-8B's
projections. Each timing replays a CUDA
graph (triton.testing.do_bench_cudagraph), as the engine's decode does; GB/s counts the weight
bytes each variant reads. Max error is relative to the output's scale, against float32.

    python -m ballast.bench.fp8_gemm [--rows 1 32 128 2048]

Table on stdout, JSON to bench/results/fp8_gemm.json.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from ballast.models.layers.fp8 import dequantize_blocks, quantize_blocks
from torch import Tensor

RESULTS = Path(__file__).parent / "results" / "fp8_gemm.json"
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
BLOCK = (128, 128)


def variants(m: int) -> dict[str, Any]:
    from ballast.models.kernels.fp8_triton import Tiles, tiles_for

    out: dict[str, Any] = {"default": tiles_for(m, BLOCK)}
    if m > 128:
        return out
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    for bn in (32, 64, 128):
        for split in (1, 4):
            for w_nk in (False, True):
                if bm >= 128 and (bn < 64 or split > 1):
                    continue
                bk = 64 if bm >= 128 and bn >= 128 else 128
                warps = 8 if bm * bn >= 128 * 128 else 4
                name = f"m{bm} n{bn} k{bk} s{split}{' nk' if w_nk else ''}"
                out[name] = Tiles(bm, bn, bk, warps, 4 if bm <= 32 else 3, split, w_nk)
    return out


def time_us(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=30)) * 1e3


def bench_shape(name: str, n: int, k: int, m: int) -> list[dict[str, Any]]:
    from ballast.models.kernels.fp8_triton import Tiles, block_fp8_matmul, dequantize
    from ballast.models.kernels.w8a8_triton import quantize_rows, w8a8_matmul

    dev = torch.device("cuda")
    torch.manual_seed(0)
    w, scale = quantize_blocks(torch.randn(n, k, device=dev) * 0.02, BLOCK)
    dense = dequantize_blocks(w, scale, BLOCK, torch.bfloat16)
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    want = x.float() @ dense.float().T
    rows = []

    def record(variant: str, fn: Callable[[], Tensor], weight_bytes: int) -> None:
        try:
            err = ((fn().float() - want).abs().max() / want.abs().max()).item()
            us = time_us(fn)
        except Exception as e:  # noqa: BLE001 - a variant this build cannot run is a row, not a crash
            rows.append({"shape": name, "m": m, "variant": variant, "error": str(e).splitlines()[0][:80]})
            return
        rows.append(
            {
                "shape": name,
                "m": m,
                "variant": variant,
                "us": us,
                "gbps": weight_bytes / us / 1e3,
                "max_err": err,
            }
        )

    record("cuBLAS bf16", lambda: F.linear(x, dense), 2 * n * k)
    w_t = w.T  # column-major [K, N], as _scaled_mm takes its second operand
    scale_t = scale.T.contiguous()

    def scaled() -> Tensor:
        q, s = quantize_rows(x)
        return torch._scaled_mm(q, w_t, scale_a=s, scale_b=scale_t, out_dtype=torch.bfloat16)

    def scaled_outer() -> Tensor:  # the same with the activation scales M-major
        q, s = quantize_rows(x)
        return torch._scaled_mm(q, w_t, scale_a=s.T.contiguous().T, scale_b=scale_t, out_dtype=torch.bfloat16)

    record("_scaled_mm w8a8", scaled, n * k)
    record("_scaled_mm w8a8 outer", scaled_outer, n * k)
    record("dequantize + cuBLAS", lambda: F.linear(x, dequantize(w, scale, BLOCK, torch.bfloat16)), n * k)
    for tiles in (
        [Tiles(64, 128, 128, 4, 4), Tiles(128, 128, 128, 8, 3), Tiles(128, 256, 128, 8, 3)] if m >= 16 else []
    ):
        record(
            f"w8a8 m{tiles.block_m} n{tiles.block_n}", partial(w8a8_matmul, x, w, scale, BLOCK, tiles), n * k
        )
    for variant, tiles in variants(m).items():
        record("triton " + variant, partial(block_fp8_matmul, x, w, scale, BLOCK, tiles), n * k)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 128, 2048])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES))
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = [r for m in args.rows for s in args.shapes for r in bench_shape(s, *SHAPES[s], m)]
    print("| shape | M | variant | us | weight GB/s | max err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['shape']} | {r['m']} | {r['variant']} | {r['error']} | | |")
        else:
            print(
                f"| {r['shape']} | {r['m']} | {r['variant']} | {r['us']:.1f} | {r['gbps']:.0f} | "
                f"{r['max_err']:.1e} |"
            )
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        if "us" in r and r["variant"].startswith("triton") and r["max_err"] < 2e-2:
            key = (r["shape"], r["m"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    print(
        "\nbest Triton tiling per shape: "
        + "; ".join(f"{s} M={m}: {r['variant']}" for (s, m), r in best.items())
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
