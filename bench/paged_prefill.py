"""Paged prefill attention on CUDA: our Triton kernel reading a prompt's K/V from scattered blocks,
against torch's flash attention (SDPA, flash backend only) on the same K/V held contiguous, for
one prompt of each length in one layer of each shape, causal.

Shapes: Llama-3.1-8B (32 query heads, 8 KV heads, head dim 128) and Qwen3-Next (16 query heads,
2 KV heads, head dim 256), bf16, 32-token blocks in random order. Timed with CUDA events, the
median of --repeats calls after a warm-up (prefill steps run eagerly in the engine, not from
graphs). TFLOP/s counts the causal half: 2 matmuls x 2 FLOPs x Hq x D x L^2 / 2, against the
dense bf16 peak (--peak-tflops, the H200's 989). --sweep also times other tilings of ours and
reports the fastest: how `choose_prefill_tiling` in models/kernels/paged_triton.py is to be chosen.
Table on stdout, JSON to bench/results/paged_prefill.json.

    python -m ballast.bench.paged_prefill [--lengths 1024 4096 8192] [--sweep]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from ballast.bench.paged_attention import fastest
from ballast.models.kernels.paged_triton import (
    PrefillTiling,
    choose_prefill_tiling,
    paged_prefill,
    triton_available,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

RESULTS = Path(__file__).parent / "results" / "paged_prefill.json"
SHAPES = {"llama-8b": (32, 8, 128), "qwen3-next": (16, 2, 256)}
BLOCK = 32


def event_time(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of one call of `fn`, after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def make_problem(
    hq: int, hkv: int, dim: int, length: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16
) -> dict[str, Any]:
    """One prompt's q, its K/V contiguous ([1, H, L, D]) and the same K/V in a shuffled block pool."""
    gen = torch.Generator(device=device).manual_seed(length + dim)
    q = torch.randn(length, hq, dim, dtype=dtype, device=device, generator=gen)
    k = torch.randn(length, hkv, dim, dtype=dtype, device=device, generator=gen)
    v = torch.randn(length, hkv, dim, dtype=dtype, device=device, generator=gen)
    blocks = math.ceil(length / BLOCK)
    pool = torch.zeros(blocks, 1, BLOCK, 2 * hkv, dim, dtype=dtype, device=device)
    table = torch.randperm(blocks, device=device).to(torch.int32)
    for b in range(blocks):
        rows = slice(b * BLOCK, min(length, (b + 1) * BLOCK))
        n = rows.stop - rows.start
        pool[int(table[b]), 0, :n, :hkv] = k[rows]
        pool[int(table[b]), 0, :n, hkv:] = v[rows]
    return {
        "q": q,
        "k": k.transpose(0, 1)[None].contiguous(),
        "v": v.transpose(0, 1)[None].contiguous(),
        "pool": pool,
        "kv_ptrs": torch.tensor([pool.data_ptr()], device=device),
        "table": table[None],
        "seg_blocks": blocks,
    }


def ours(p: dict[str, Any], hkv: int, tiling: PrefillTiling | None, out: torch.Tensor) -> Callable[[], None]:
    length, _, dim = p["q"].shape
    zero = torch.zeros(1, dtype=torch.int64, device=p["q"].device)
    cu = torch.tensor([0, length], dtype=torch.int64, device=p["q"].device)

    def run() -> None:
        paged_prefill(
            p["q"],
            out,
            p["kv_ptrs"],
            p["kv_ptrs"],  # not quantized: the scale table is never read
            p["table"],
            zero,
            zero,
            cu,
            layer=0,
            num_layers=1,
            seg_blocks=p["seg_blocks"],
            block_size=BLOCK,
            num_kv_heads=hkv,
            kv_dtype=p["q"].dtype,
            sm_scale=dim**-0.5,
            max_len=length,
            max_ctx=length,
            tiling=tiling,
        )

    return run


def flash(p: dict[str, Any], out: list[torch.Tensor]) -> Callable[[], None]:
    """torch's flash attention; K/V repeated to every query head where its build takes no GQA."""
    q = p["q"].transpose(0, 1)[None]  # [1, Hq, L, D]
    k, v = p["k"], p["v"]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        try:
            F.scaled_dot_product_attention(
                q[:, :, :16], k[:, :, :16], v[:, :, :16], is_causal=True, enable_gqa=True
            )
        except RuntimeError:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    gqa = k.shape[1] != q.shape[1]

    def run() -> None:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out[:] = [F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)]

    return run


def sweep(p: dict[str, Any], hkv: int, out: torch.Tensor, repeats: int) -> tuple[PrefillTiling, float]:
    tilings = (
        PrefillTiling(block_m=m, block_n=n, num_warps=w, num_stages=st)
        for m, n, w, st in itertools.product((32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    )
    return fastest(tilings, lambda tiling: event_time(ours(p, hkv, tiling, out), repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--sweep", action="store_true", help="also time other tilings of ours")
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not (torch.cuda.is_available() and triton_available()):
        raise SystemExit("paged_prefill needs CUDA and Triton")
    rows = []
    print(
        "| shape | prompt | ours ms | ours TFLOP/s (% peak) | flash ms | flash TFLOP/s | flash ms / ours "
        "| max |diff| |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for shape, length in itertools.product(args.shapes, args.lengths):
        hq, hkv, dim = SHAPES[shape]
        p = make_problem(hq, hkv, dim, length)
        out = torch.empty_like(p["q"])
        ref: list[torch.Tensor] = []
        t_ours = event_time(ours(p, hkv, None, out), args.repeats)
        t_flash = event_time(flash(p, ref), args.repeats)
        diff = float((out - ref[0][0].transpose(0, 1)).abs().max())
        flops = 4 * hq * dim * length * length / 2
        row = {
            "shape": shape,
            "prompt": length,
            "tiling": choose_prefill_tiling(dim, torch.bfloat16).__dict__,
            "ours_ms": 1e3 * t_ours,
            "flash_ms": 1e3 * t_flash,
            "ours_tflops": flops / t_ours / 1e12,
            "flash_tflops": flops / t_flash / 1e12,
            "max_abs_diff": diff,
        }
        if args.sweep:
            best, t_best = sweep(p, hkv, out, max(3, args.repeats // 2))
            row.update(best_tiling=best.__dict__, best_ms=1e3 * t_best, best_tflops=flops / t_best / 1e12)
        rows.append(row)
        pct = 100 * row["ours_tflops"] / args.peak_tflops
        print(
            f"| {shape} | {length} | {row['ours_ms']:.3f} | {row['ours_tflops']:.0f} ({pct:.0f}%) | "
            f"{row['flash_ms']:.3f} | {row['flash_tflops']:.0f} | {t_flash / t_ours:.2f}x | {diff:.3g} |",
            flush=True,
        )
        if args.sweep:
            print(
                f"  fastest tiling {row['best_tiling']}: {row['best_ms']:.3f} ms, "
                f"{row['best_tflops']:.0f} TFLOP/s"
            )
        del p, out, ref
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "bench": "paged_prefill",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "peak_tflops": args.peak_tflops,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
