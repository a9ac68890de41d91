"""FP8 weights on one GPU: decode of built-in random-weight models held in bf16 and with their decoder
projections in float8 (128 x 128 block scales, the FP8 releases' layout), side by side in one run:
Llama-3.1-8B-shaped (`builtin:llama-8b` vs `builtin:llama-8b-fp8`) and the Qwen3-Next-80B-A3B
shape in FP8 (`builtin:qwen3-next-80b-a3b-fp8`: 48 layers, 512 experts top-10; its bf16 twin is
~160 GB and does not fit one H200).

Each engine is loaded through `Engine.load` (the memory layer admits its bytes), every slot is
prefilled to the context, then decode steps are timed after warm-up (CUDA graphs on), as in
`paged_decode`. Roofline: the bytes a step must read (weights as held - float8 where kept - the
experts the batch is expected to touch, KV, recurrent state) over the measured copy bandwidth.

    python -m ballast.bench.fp8_decode [--models llama-8b llama-8b-fp8 qwen3-next-80b-a3b-fp8]
        [--batches 1 32 128] [--context 2048] [--steps 16]

Table on stdout, JSON to bench/results/fp8_decode.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from ballast.bench.paged_decode import (
    FIT_MARGIN,
    copy_bandwidth,
    decode_positions,
    free_bytes,
    free_device_memory,
    kv_need,
    ours,
    random_prompts,
    read_model,
)
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.memory.types import GiB
from ballast.models.arch.builtin import builtin_config

RESULTS = Path(__file__).parent / "results" / "fp8_decode.json"


def bench(name: str, args: argparse.Namespace, bandwidth: float) -> list[dict[str, Any]]:
    cfg = builtin_config(name)
    config = EngineConfig(
        model="builtin:" + name,
        device="cuda",
        max_num_seqs=max(args.batches),
        max_model_len=decode_positions(args.context, args.steps) + 16,
        prefill_chunk_tokens=4096,
    )
    engine = Engine.load(config)
    rows = []
    try:
        rm = read_model(engine, cfg)
        print(f"{name}: {rm.weights_bytes / GiB:.1f} GiB of weights held", flush=True)
        for batch in args.batches:
            row: dict[str, Any] = {"model": name, "batch": batch, "context": args.context}
            row["weights_gib"] = rm.weights_bytes / GiB
            need = kv_need(rm, batch, decode_positions(args.context, args.steps) + 4, 16)
            if need > free_bytes(engine.device) - FIT_MARGIN:
                row["ours"] = "does not fit"
                rows.append(row)
                continue
            vocab = int(cfg["vocab_size"])
            result = ours(engine, random_prompts(batch, args.context, vocab, seed=batch), args.steps, 4096)
            floor = rm.step_bytes(batch, args.context + args.steps / 2) / bandwidth
            result.pop("tokens")
            row["ours"] = {
                **result,
                "floor_s": floor,
                "roofline_pct": 100 * floor / result["step_s"],
                "served_roofline_pct": 100 * floor / result["served_step_s"],
            }
            print(
                f"  batch {batch}: {result['tok_s']:.0f} tok/s ({result['served_tok_s']:.0f} pipelined as "
                f"served), step {result['step_s'] * 1e3:.2f} ms, "
                f"{row['ours']['roofline_pct']:.0f}% of roofline, graphs {result['graphs']}",
                flush=True,
            )
            rows.append(row)
    finally:
        engine.shutdown()
        del engine
        free_device_memory()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["llama-8b", "llama-8b-fp8", "qwen3-next-80b-a3b-fp8"])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = [row for name in args.models for row in bench(name, args, bandwidth)]
    print(f"\ncopy bandwidth {bandwidth / 1e12:.2f} TB/s, context {args.context}")
    print(
        "| model | weights GiB | batch | tok/s | step ms | floor ms | % roofline "
        "| tok/s pipelined (as served) | % roofline | graphs |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        o = r["ours"]
        if isinstance(o, dict):
            print(
                f"| {r['model']} | {r['weights_gib']:.1f} | {r['batch']} | {o['tok_s']:.0f} | "
                f"{o['step_s'] * 1e3:.2f} | {o['floor_s'] * 1e3:.2f} | {o['roofline_pct']:.0f}% | "
                f"{o['served_tok_s']:.0f} | {o['served_roofline_pct']:.0f}% | {o['graphs']} |"
            )
        else:
            print(f"| {r['model']} | {r['weights_gib']:.1f} | {r['batch']} | {o} | | | | | | |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"bandwidth": bandwidth, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
