"""FP8 prefill GEMMs at Qwen3-Next-80B-A3B's shapes, every way side by side in one run (CUDA):
FP8 x FP8 (`models/w8a8_triton.py`: activations quantized per token and 128 columns, tensor-core
FP8 products, float32 sums) against the paths before it (dense: dequantize + cuBLAS bf16; experts:
the weight-only grouped kernel through bf16 products), `torch._scaled_mm` with the same block
scales, dequantizing every expert + `torch._grouped_mm`, and cuBLAS on weights held in bf16 (what
FP8 is to beat). Then, the 6.2B cut in FP8 (qwen3-next-6b-fp8) through the
engine with FP8 x FP8 off and on: the greedy tokens of a few 1k prompts and the prefill time at
1k and 8k (--engine adds the 80B: `qwen3-next-80b-a3b-fp8:1:1000,8000,32000:1`).

Each timing replays a CUDA graph (triton.testing.do_bench_cudagraph): GPU time, no launch gaps.
Per row: us, TFLOP/s with % of the H200's dense FP8 (1,979) and bf16 (989) peaks, the weight bytes
read with % of the copy bandwidth measured in the same run, and the error (norm of the difference
over the norm of a float32 reference on bf16 activations; FP8 activations alone bring ~2.5-4%).
A model line sums each path over the 80B's 48 layers (36 linear-attention, 12 attention, 48 MoE)
for one prefill of T tokens.

    python -m ballast.bench.fp8_prefill [--tokens 1024 8192] [--expert-tokens 128 1024 8192]
        [--engine qwen3-next-6b-fp8:4:1000,8000:24 qwen3-next-80b-a3b-fp8:1:1000,8000,32000:1]

Table on stdout, JSON to bench/results/fp8_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from ballast.models.layers.fp8 import FP8, dequantize_blocks, quantize_blocks
from torch import Tensor

RESULTS = Path(__file__).parent / "results" / "fp8_prefill.json"
BLOCK = (128, 128)
FP8_PEAK, BF16_PEAK = 1979e12, 989e12  # H200 SXM dense
HIDDEN, INTER, EXPERTS, TOP_K = 2048, 512, 512, 10
# (out, in) of each FP8 linear of the 80B and how many of it a forward runs
DENSE = {
    "linear-attn in_proj_qkvz": (12288, 2048, 36),
    "linear-attn in_proj_ba": (64, 2048, 36),
    "linear-attn out_proj": (2048, 4096, 36),
    "attn q|k|v": (9216, 2048, 12),
    "attn o_proj": (2048, 4096, 12),
    "shared expert gate|up": (1024, 2048, 48),
    "shared expert down": (2048, 512, 48),
}
MOE_LAYERS = 48
DEV = torch.device("cuda")


def time_us(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=40)) * 1e3


def copy_bandwidth() -> float:
    """Bytes a second of a 4 GiB device-to-device copy (read + write)."""
    src = torch.empty(1 << 32, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src))
    return 2 * src.numel() / (us * 1e-6)


def rel(got: Tensor, want: Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


class Rows:
    """The table: one dict a variant, with its timing, rates and error (or the error it raised)."""

    def __init__(self, bandwidth: float) -> None:
        self.rows: list[dict[str, Any]] = []
        self.bandwidth = bandwidth

    def record(
        self, what: str, m: int, variant: str, fn: Callable[[], Tensor], want: Callable[[Tensor], float],
        flops: float, weight_bytes: float,
    ) -> None:  # fmt: skip
        try:
            err = want(fn())
            us = time_us(fn)
        except Exception as e:  # noqa: BLE001 - a variant this build cannot run is a row, not a crash
            self.rows.append(
                {"what": what, "m": m, "variant": variant, "error": str(e).splitlines()[0][:100]}
            )
            print(f"{what} M={m} {variant}: {self.rows[-1]['error']}", flush=True)
            return
        row = {
            "what": what,
            "m": m,
            "variant": variant,
            "us": us,
            "tflops": flops / us / 1e6,
            "pct_fp8_peak": 100 * flops / (us * 1e-6) / FP8_PEAK,
            "pct_bf16_peak": 100 * flops / (us * 1e-6) / BF16_PEAK,
            "weight_gb": weight_bytes / 1e9,
            "pct_copy_bw": 100 * weight_bytes / (us * 1e-6) / self.bandwidth,
            "rel_err": err,
        }
        self.rows.append(row)
        print(
            f"{what} M={m} {variant}: {us:.1f} us, {row['tflops']:.0f} TFLOP/s, "
            f"{row['pct_copy_bw']:.0f}% copy bw, err {err:.3g}",
            flush=True,
        )


def bench_dense(rows: Rows, name: str, n: int, k: int, m: int) -> None:
    from ballast.models.kernels.fp8_triton import Tiles, block_fp8_matmul
    from ballast.models.kernels.w8a8_triton import quantize_rows, w8a8_matmul

    torch.manual_seed(n + k + m)
    w, scale = quantize_blocks(torch.randn(n, k, device=DEV) * 0.02, BLOCK)
    dense = dequantize_blocks(w, scale, BLOCK, torch.bfloat16)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    ref = x.float() @ dequantize_blocks(w, scale, BLOCK, torch.float32).T

    def err(y: Tensor) -> float:
        return rel(y, ref)

    flops = 2.0 * m * n * k
    rows.record(
        name,
        m,
        "before: dequantize + cuBLAS",
        lambda: block_fp8_matmul(x, w, scale, BLOCK),
        err,
        flops,
        n * k,
    )
    rows.record(name, m, "cuBLAS, weights held bf16", lambda: F.linear(x, dense), err, flops, 2 * n * k)
    w_t, scale_t = w.T, scale.T.contiguous()

    def scaled() -> Tensor:
        q, s = quantize_rows(x)
        return torch._scaled_mm(q, w_t, scale_a=s, scale_b=scale_t, out_dtype=torch.bfloat16)

    rows.record(name, m, "torch._scaled_mm blockwise", scaled, err, flops, n * k)
    for t in (None, Tiles(128, 256, 128, 8, 3), Tiles(128, 128, 128, 4, 4)):
        label = "new: FP8 x FP8" + ("" if t is None else f" m{t.block_m} n{t.block_n} w{t.warps} s{t.stages}")
        rows.record(name, m, label, partial(w8a8_matmul, x, w, scale, BLOCK, t), err, flops, n * k)


def bench_experts(rows: Rows, tokens: int) -> None:
    from ballast.models.blocks.moe import Routing
    from ballast.models.kernels import w8a8_triton
    from ballast.models.kernels.fp8_triton import Groups, Tiles, dequantize, grouped_fp8_matmul
    from ballast.models.layers import pointwise

    g = torch.Generator(device=DEV).manual_seed(tokens)
    gate_up = torch.randn((EXPERTS, 2 * INTER, HIDDEN), generator=g, device=DEV, dtype=torch.bfloat16).to(FP8)
    down = torch.randn((EXPERTS, HIDDEN, INTER), generator=g, device=DEV, dtype=torch.bfloat16).to(FP8)
    gu_s = 0.005 + 0.01 * torch.rand((EXPERTS, 2 * INTER // 128, HIDDEN // 128), generator=g, device=DEV)
    dn_s = 0.005 + 0.01 * torch.rand((EXPERTS, HIDDEN // 128, INTER // 128), generator=g, device=DEV)
    x = torch.randn(tokens, HIDDEN, generator=g, device=DEV, dtype=torch.bfloat16)
    choice = torch.rand(tokens, EXPERTS, generator=g, device=DEV).topk(TOP_K, dim=1).indices
    routing = Routing.sort(choice, EXPERTS)
    pairs = tokens * TOP_K
    used = int((routing.counts > 0).sum())
    counts = routing.counts.tolist()
    first = (routing.counts.cumsum(0) - routing.counts).tolist()
    # the float32 reference, one expert at a time
    want = torch.empty(pairs, HIDDEN, device=DEV)
    xr = x.float()[routing.token]
    for e in range(EXPERTS):
        a, b = first[e], first[e] + counts[e]
        if a == b:
            continue
        h = xr[a:b] @ dequantize_blocks(gate_up[e], gu_s[e], BLOCK, torch.float32).T
        want[a:b] = (F.silu(h[:, :INTER]) * h[:, INTER:]) @ dequantize_blocks(
            down[e], dn_s[e], BLOCK, torch.float32
        ).T
    del xr

    def err(y: Tensor) -> float:
        return rel(y, want)

    flops = 6.0 * pairs * HIDDEN * INTER
    weight_bytes = used * 3 * HIDDEN * INTER
    what = f"experts 512 x (2x{INTER}, {INTER}->{HIDDEN}) top-10"

    def before() -> Tensor:  # moe.fp8_experts_forward's grouped weight-only path
        r = x.index_select(0, routing.token)
        groups = Groups.plan(routing.counts, pairs, BLOCK)
        h = grouped_fp8_matmul(r, groups, gate_up, gu_s, BLOCK)
        return grouped_fp8_matmul(pointwise.silu_mul(h, INTER), groups, down, dn_s, BLOCK)

    offs = routing.counts.cumsum(0).to(torch.int32)

    def dequantize_all() -> Tensor:
        gu = dequantize(gate_up.view(-1, HIDDEN), gu_s.view(-1, HIDDEN // 128), BLOCK, torch.bfloat16)
        dn = dequantize(down.view(-1, INTER), dn_s.view(-1, INTER // 128), BLOCK, torch.bfloat16)
        h = torch._grouped_mm(
            x.index_select(0, routing.token), gu.view(EXPERTS, -1, HIDDEN).transpose(1, 2), offs=offs
        )
        return torch._grouped_mm(
            pointwise.silu_mul(h, INTER), dn.view(EXPERTS, HIDDEN, INTER).transpose(1, 2), offs=offs
        )

    rows.record(what, tokens, "before: weight-only grouped", before, err, flops, weight_bytes)
    rows.record(what, tokens, "dequantize all + torch._grouped_mm", dequantize_all, err, flops, weight_bytes)
    gu16 = dequantize_blocks(gate_up, gu_s, BLOCK, torch.bfloat16)
    dn16 = dequantize_blocks(down, dn_s, BLOCK, torch.bfloat16)

    def held_bf16() -> Tensor:
        h = torch._grouped_mm(x.index_select(0, routing.token), gu16.transpose(1, 2), offs=offs)
        return torch._grouped_mm(pointwise.silu_mul(h, INTER), dn16.transpose(1, 2), offs=offs)

    rows.record(what, tokens, "torch._grouped_mm, weights held bf16", held_bf16, err, flops, 2 * weight_bytes)
    for t in (None, Tiles(128, 128, 128, 8, 3), Tiles(64, 256, 128, 8, 3)):
        label = "new: FP8 x FP8" + ("" if t is None else f" m{t.block_m} n{t.block_n} w{t.warps} s{t.stages}")

        def new(t: Tiles | None = t) -> Tensor:
            return w8a8_triton.experts_w8a8(
                x, routing.token, routing.counts, gate_up, gu_s, down, dn_s, BLOCK, t
            )

        rows.record(what, tokens, label, new, err, flops, weight_bytes)


def model_lines(rows: list[dict[str, Any]], tokens: list[int]) -> list[dict[str, Any]]:
    """Per prefill of T tokens, each path's GEMM time summed over the 80B's layers: the old path,
    the new one, and the fastest variant of each GEMM."""
    out = []
    for m in tokens:
        line: dict[str, Any] = {"tokens": m}
        for pick in ("before", "new: FP8 x FP8", "fastest"):
            total = 0.0
            for what, count in [*((n, c) for n, (_, _, c) in DENSE.items()), ("experts", MOE_LAYERS)]:
                cands = [r for r in rows if r["m"] == m and r["what"].startswith(what) and "us" in r]
                if pick == "before":
                    cands = [r for r in cands if r["variant"].startswith("before")]
                elif pick != "fastest":
                    cands = [r for r in cands if r["variant"] == pick]
                cands = [r for r in cands if r["rel_err"] < 0.06 and "held bf16" not in r["variant"]]
                if not cands:
                    total = float("nan")
                    break
                total += count * min(r["us"] for r in cands)
            line[pick] = total / 1e3
        out.append(line)
    return out


def engine_prefill(
    model: str, prompts: int, lengths: list[int], new_tokens: int, rounds: int
) -> dict[str, Any]:
    """One engine (eager steps, so the switch takes effect at once), FP8 x FP8 off then on, `rounds`
    times (keys off, on, off_2, on_2, ...): per prompt length, the wall
    time of prefilling `prompts` random prompts (after one warm-up of that length) in chunks of
    up to 8,192 tokens, and their greedy tokens (the first, then `new_tokens` - 1 decode steps)."""
    from ballast.bench.paged_decode import GREEDY, free_device_memory, prefill, random_prompts
    from ballast.engine.config import EngineConfig, PrefixCacheConfig
    from ballast.engine.engine import Engine
    from ballast.engine.plan import DecodeToken, StepPlan
    from ballast.models.arch.builtin import builtin_config
    from ballast.models.kernels import w8a8_triton

    vocab = int(builtin_config(model)["vocab_size"])
    chunk = 8192
    t = time.perf_counter()
    engine = Engine.load(  # no prefix cache: every timed prefill computes its whole prompt
        EngineConfig(model="builtin:" + model, device="cuda", max_num_seqs=prompts, cuda_graphs=False,
                     max_model_len=max(lengths) + new_tokens + 16, prefill_chunk_tokens=chunk),
        prefix_cache=PrefixCacheConfig(fraction=0.0),
    )  # fmt: skip
    out: dict[str, Any] = {"model": model, "prompts": prompts, "load_s": time.perf_counter() - t}
    print(f"{model}: loaded in {out['load_s']:.1f} s", flush=True)
    release = StepPlan(release=tuple(range(prompts)))
    try:
        # off, on, then again `rounds` - 1 times: the old path's own run-to-run agreement, and
        # whether a difference outlasts the order the two ran in
        for key in [
            f"{side}{'' if r == 0 else f'_{r + 1}'}" for r in range(rounds) for side in ("off", "on")
        ]:
            w8a8_triton.ENABLED = key.startswith("on")
            side: dict[str, Any] = out.setdefault(key, {})
            for length in lengths:
                ids = random_prompts(prompts, length, vocab, seed=length)
                prefill(engine, random_prompts(prompts, length, vocab, seed=-length), chunk)  # warm-up
                engine.submit(release).result()
                torch.cuda.synchronize()
                t = time.perf_counter()
                last = prefill(engine, ids, chunk)
                torch.cuda.synchronize()
                wall = time.perf_counter() - t
                seqs = [[tok] for tok in last]
                for pos in range(length, length + new_tokens - 1):
                    decodes = tuple(DecodeToken(s, seqs[s][-1], pos) for s in range(prompts))
                    plan = StepPlan(decodes=decodes, sampling=dict.fromkeys(range(prompts), GREEDY))
                    for o in engine.submit(plan).result().outputs:
                        seqs[o.slot].append(o.token_id)
                engine.submit(release).result()
                side[str(length)] = {
                    "prefill_ms": wall * 1e3,
                    "tok_s": prompts * length / wall,
                    "tokens": seqs,
                }
                rate = prompts * length / wall
                print(
                    f"{model} FP8 x FP8 {key}: {prompts} x {length} tokens in {wall * 1e3:.1f} ms "
                    f"({rate:,.0f} tok/s)",
                    flush=True,
                )
    finally:
        engine.shutdown()
        free_device_memory()
    for n in map(str, lengths):
        off, on_ = out["off"][n]["tokens"], out["on"][n]["tokens"]
        out[f"same_sequences_{n}"] = sum(a == b for a, b in zip(off, on_, strict=True))
        out[f"same_first_tokens_{n}"] = sum(a[0] == b[0] for a, b in zip(off, on_, strict=True))
        if rounds > 1:
            out[f"off_repeatable_{n}"] = off == out["off_2"][n]["tokens"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[1024, 8192], help="rows of the dense GEMMs")
    ap.add_argument("--expert-tokens", type=int, nargs="*", default=[128, 1024, 8192])
    ap.add_argument(
        "--engine",
        nargs="+",
        default=["qwen3-next-6b-fp8:4:1000,8000:24:2"],
        help="MODEL:PROMPTS:LENGTHS:NEW_TOKENS[:ROUNDS]: prefill through the engine, FP8 x FP8 off and on",
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    table = Rows(bw)
    result: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "copy_tb_s": bw / 1e12, "rows": table.rows}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    for m in args.tokens:
        for name, (n, k, _) in DENSE.items():
            bench_dense(table, name, n, k, m)
        save()
    for m in args.expert_tokens:
        bench_experts(table, m)
        torch.cuda.empty_cache()
        save()
    result["model_ms"] = model_lines(table.rows, [m for m in args.tokens if m in args.expert_tokens])
    save()
    result["engine"] = []
    for spec in args.engine:
        model, prompts, lengths, new, *rounds = spec.split(":")
        try:
            run = engine_prefill(
                model,
                int(prompts),
                [int(n) for n in lengths.split(",")],
                int(new),
                int(rounds[0]) if rounds else 1,
            )
        except Exception as e:  # noqa: BLE001 - keep the kernel table when an engine run fails
            run = {"model": model, "error": repr(e)[:300]}
        result["engine"].append(run)
        save()
    print("\n| GEMM | M | variant | us | TFLOP/s | % FP8 peak | % bf16 peak | % copy bw | rel err |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in table.rows:
        if "error" in r:
            print(f"| {r['what']} | {r['m']} | {r['variant']} | {r['error']} | | | | | |")
        else:
            print(
                f"| {r['what']} | {r['m']} | {r['variant']} | {r['us']:.1f} | {r['tflops']:.0f} | "
                f"{r['pct_fp8_peak']:.1f} | {r['pct_bf16_peak']:.1f} | {r['pct_copy_bw']:.0f} | "
                f"{r['rel_err']:.3g} |"
            )
    print("\nThe 80B's FP8 GEMMs for one prefill (48 layers), ms:")
    for line in result["model_ms"]:
        print(f"  {line['tokens']} tokens: before {line['before']:.2f}, new {line['new: FP8 x FP8']:.2f}, "
              f"fastest per GEMM {line['fastest']:.2f}")  # fmt: skip
    for run in result["engine"]:
        print(f"\n{run['model']}:", {k: v for k, v in run.items() if not isinstance(v, dict)})
        for key in (k for k, v in run.items() if isinstance(v, dict)):
            for length, r in run.get(key, {}).items():
                print(
                    f"  FP8 x FP8 {key}, {length} tokens: {r['prefill_ms']:.1f} ms, {r['tok_s']:,.0f} tok/s"
                )
    save()


if __name__ == "__main__":
    main()
