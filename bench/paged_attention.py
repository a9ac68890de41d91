"""Paged decode attention on CUDA for one Llama-8B-shaped layer (32 query heads, 8 KV heads, head
dim 128; `--shape qwen3-next`: 16, 2 and 256), bf16, 32-token blocks scattered at random over 4
segments: our Triton kernel reading the blocks in place, against the old path (gather each
sequence's K and V into contiguous [B, ctx, Hkv, D] tensors, then torch SDPA with enable_gqa).
`--graph-bucket` passes the kernel the context bucket a decode graph is captured for (the next
power of two above the context) as its host-side longest context, as the engine's graphs do.

Both sides are timed as CUDA-graph replays, the way the engine runs decode, and each replay walks
every layer of a pool sized to several times the L2 cache, so no layer's KV is still cached when it
is read again. Bandwidth is KV bytes read over kernel time, as a percentage of a device copy
measured here (copy_ of a 2 GiB tensor, read plus write bytes). --sweep also times other tilings
and reports the fastest, which is how the defaults in models/kernels/paged_triton.py were chosen. Table on
stdout, JSON to bench/results/paged_attention.json.

    python -m ballast.bench.paged_attention [--batches 1 32 128] [--contexts 2048 8192] [--sweep]
        [--shape llama-8b|qwen3-next] [--graph-bucket]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import platform
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from ballast.models.kernels.paged_triton import (
    DecodeTiling,
    choose_decode_tiling,
    paged_decode,
    triton_available,
)

RESULTS = Path(__file__).parent / "results" / "paged_attention.json"
T = TypeVar("T")
BLOCK = 32
# name: (query heads, KV heads, head dim) of one attention layer
SHAPES = {"llama-8b": (32, 8, 128), "qwen3-next": (16, 2, 256)}
SEGMENTS = 4
# Each replay reads at least this much KV, several times the H200's 60 MB L2.
MIN_WORKING_SET = 512 * 2**20


def copy_bandwidth(nbytes: int = 2 * 2**30, repeats: int = 10) -> float:
    """Bytes/s (read + write) of the best of `repeats` device copies: the ceiling a kernel that
    only streams memory can reach."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * nbytes / min(times)


def graph_time(fn: Callable[[], None], calls: int, repeats: int = 10) -> float:
    """Median seconds per call of `fn` (which makes `calls` calls) replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


@dataclasses.dataclass
class Case:
    """One (batch, context) problem: a pool of `layers` layers and the tables that address it."""

    batch: int
    ctx: int
    layers: int
    pool: torch.Tensor
    kv_ptrs: torch.Tensor
    block_table: torch.Tensor
    seg_blocks: int
    q: torch.Tensor
    out: torch.Tensor
    hkv: int
    max_ctx: int  # what the host tells the kernel: ctx, or a graph's context bucket

    @property
    def head_dim(self) -> int:
        return self.q.shape[-1]

    @property
    def kv_bytes(self) -> int:
        """KV bytes one layer's decode reads."""
        return self.batch * self.ctx * 2 * self.hkv * self.head_dim * self.pool.element_size()


def make_case(batch: int, ctx: int, shape: str = "llama-8b", graph_bucket: bool = False) -> Case:
    hq, hkv, head_dim = SHAPES[shape]
    layer_bytes = batch * ctx * 2 * hkv * head_dim * 2
    layers = max(2, math.ceil(MIN_WORKING_SET / layer_bytes))
    per_seq = ctx // BLOCK
    blocks = batch * per_seq
    seg_blocks = math.ceil(blocks / SEGMENTS)
    # Segments are views into one allocation so the gather baseline can index all blocks at once;
    # the kernel reads them through kv_ptrs exactly as it reads separate segments.
    pool = torch.empty(
        seg_blocks * SEGMENTS, layers, BLOCK, 2 * hkv, head_dim, dtype=torch.bfloat16, device="cuda"
    )
    pool.normal_()
    kv_ptrs = torch.tensor([pool[s * seg_blocks].data_ptr() for s in range(SEGMENTS)], device="cuda")
    table = torch.randperm(blocks, device="cuda").to(torch.int32).view(batch, per_seq)
    q = torch.randn(batch, hq, head_dim, dtype=torch.bfloat16, device="cuda")
    max_ctx = 1 << ctx.bit_length() if graph_bucket else ctx  # the smallest power of two above ctx
    return Case(batch, ctx, layers, pool, kv_ptrs, table, seg_blocks, q, torch.empty_like(q), hkv, max_ctx)


def ours(case: Case, tiling: DecodeTiling | None = None) -> Callable[[], None]:
    slots = torch.arange(case.batch, device="cuda")
    lens = torch.full((case.batch,), case.ctx, device="cuda")

    def run() -> None:
        for layer in range(case.layers):
            kw: dict[str, Any] = {
                "layer": layer,
                "num_layers": case.layers,
                "seg_blocks": case.seg_blocks,
                "block_size": BLOCK,
                "num_kv_heads": case.hkv,
                "kv_dtype": torch.bfloat16,
                "sm_scale": case.head_dim**-0.5,
                "max_ctx": case.max_ctx,
            }
            # Not quantized: the scale table is never read, so kv_ptrs stands in for it.
            tables = (case.kv_ptrs, case.kv_ptrs, case.block_table, slots, lens)
            paged_decode(case.q, case.out, *tables, **kw, tiling=tiling)

    return run


def gather_sdpa(case: Case, out: torch.Tensor) -> Callable[[], None]:
    """The old path: contiguous per-sequence K and V copies, then SDPA over them."""
    ids = case.block_table.long()
    hkv, d = case.hkv, case.head_dim

    def run() -> None:
        for layer in range(case.layers):
            rows = case.pool[:, layer]  # [blocks, BLOCK, 2Hkv, D]
            k = rows[:, :, :hkv][ids].reshape(case.batch, case.ctx, hkv, d)
            v = rows[:, :, hkv:][ids].reshape(case.batch, case.ctx, hkv, d)
            o = F.scaled_dot_product_attention(
                case.q[:, :, None], k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True
            )
            out.copy_(o[:, :, 0])

    return run


def fastest(tilings: Iterable[T], time_of: Callable[[T], float]) -> tuple[T, float]:
    """The tiling of least time and its time; one that does not fit (shared memory) is skipped."""
    best: tuple[T, float] | None = None
    for tiling in tilings:
        try:
            t = time_of(tiling)
        except Exception as e:
            print(f"  tiling {tiling} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            continue
        if best is None or t < best[1]:
            best = (tiling, t)
    assert best is not None
    return best


def sweep(case: Case, chosen: DecodeTiling) -> tuple[DecodeTiling, float]:
    """Fastest tiling near the chosen one, and its time."""
    splits = sorted({max(1, chosen.num_splits // 2), chosen.num_splits, chosen.num_splits * 2})
    tilings = (
        DecodeTiling(num_splits=s, block_n=n, num_warps=w, num_stages=st)
        for s, n, w, st in itertools.product(splits, (32, 64, 128), (4, 8), (2, 3))
    )
    return fastest(tilings, lambda tiling: graph_time(ours(case, tiling), case.layers, repeats=5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--sweep", action="store_true", help="also time tilings around the chosen one")
    parser.add_argument("--shape", choices=list(SHAPES), default="llama-8b")
    parser.add_argument("--graph-bucket", action="store_true", help="max_ctx as a decode graph passes it")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    hq, hkv, head_dim = SHAPES[args.shape]
    if not torch.cuda.is_available() or not triton_available():
        parser.error("needs CUDA and Triton")
    if min(args.batches) < 1 or min(args.contexts) < BLOCK or any(c % BLOCK for c in args.contexts):
        parser.error(f"batches >= 1 and contexts that are positive multiples of {BLOCK} are required")
    torch.manual_seed(0)
    copy_bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for batch, ctx in itertools.product(args.batches, args.contexts):
        case = make_case(batch, ctx, args.shape, args.graph_bucket)
        base_out = torch.empty_like(case.q)
        t_ours = graph_time(ours(case), case.layers)
        t_base = graph_time(gather_sdpa(case, base_out), case.layers)
        err = (case.out.float() - base_out.float()).abs().max().item()
        chosen = choose_decode_tiling(batch, hkv, case.max_ctx, torch.bfloat16, sms)
        row: dict[str, Any] = {
            "batch": batch,
            "ctx": ctx,
            "layers_per_replay": case.layers,
            "kv_bytes": case.kv_bytes,
            "ours_us": t_ours * 1e6,
            "gather_sdpa_us": t_base * 1e6,
            "speedup": t_base / t_ours,
            "ours_bw_pct": 100 * case.kv_bytes / t_ours / copy_bw,
            "max_abs_diff": err,
            "tiling": dataclasses.asdict(chosen),
        }
        if args.sweep:
            best, t_best = sweep(case, chosen)
            row |= {
                "best_tiling": dataclasses.asdict(best),
                "best_us": t_best * 1e6,
                "best_bw_pct": 100 * case.kv_bytes / t_best / copy_bw,
            }
        rows.append(row)
        print(f"  batch {batch} ctx {ctx}: {row}", flush=True)
        del case, base_out
        torch.cuda.empty_cache()

    name = torch.cuda.get_device_name(0)
    print(
        f"paged decode, Hq={hq} Hkv={hkv} D={head_dim} bf16, max_ctx "
        f"{'bucket' if args.graph_bucket else 'ctx'}, block {BLOCK}, {SEGMENTS} segments, on {name} "
        f"({sms} SMs); copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write); times per layer, "
        "CUDA-graph replay"
    )
    print(
        f"{'batch':>5} {'ctx':>5} {'KV MB':>7} | {'ours us':>8} {'% copy bw':>9} {'splits':>6} | "
        f"{'gather+SDPA us':>14} {'x':>6} | {'max diff':>8}"
        + (" | best tiling (us, % bw)" if args.sweep else "")
    )
    for r in rows:
        line = (
            f"{r['batch']:>5} {r['ctx']:>5} {r['kv_bytes'] / 1e6:>7.1f} | {r['ours_us']:>8.1f} "
            f"{r['ours_bw_pct']:>8.1f}% {r['tiling']['num_splits']:>6} | {r['gather_sdpa_us']:>14.1f} "
            f"{r['speedup']:>5.1f}x | {r['max_abs_diff']:>8.4f}"
        )
        if args.sweep:
            b = r["best_tiling"]
            line += (
                f" | s{b['num_splits']} n{b['block_n']} w{b['num_warps']} st{b['num_stages']} "
                f"({r['best_us']:.1f}, {r['best_bw_pct']:.1f}%)"
            )
        print(line)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "bench": "paged_attention",
        "device": name,
        "sms": sms,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "shape": {
            "name": args.shape,
            "hq": hq,
            "hkv": hkv,
            "head_dim": head_dim,
            "graph_bucket": args.graph_bucket,
            "dtype": "bfloat16",
            "block_size": BLOCK,
            "segments": SEGMENTS,
        },
        "copy_bandwidth_bytes_s": copy_bw,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
