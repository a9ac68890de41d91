"""CPU attention over the paged KV store: in place (models/layers/cpu_attention.py) against the gathering
reference it replaced (models/layers/attention.py: gather every block, then scaled_dot_product_attention),
the same store, queries and tables, interleaved, median of --repeats.

    python -m ballast.bench.cpu_attention [--contexts 512 1024 2048 4096] [--repeats 5] [--threads 1]

Shapes are the default model's (9 query heads, 3 KV heads, head dim 64): a 512-token prompt
chunk at the end of each context (the chunk every long prompt's last step carries), and a
decode step of 1 and of 8 sequences at that context. Tables in order and shuffled (one run per
block: the worst case for in place). Table on stdout, JSON to bench/results/cpu_attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from ballast.memory.specs import AttentionSpec
from ballast.models.base import ForwardBatch
from ballast.models.kv_store import SINK_BLOCK, KVStore
from ballast.models.layers.attention import attend_gathered, gather, padded_groups
from ballast.models.layers.cpu_attention import attend_in_place
from ballast.models.layers.state import PagedKV, allocate_states

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_attention.json"
HEADS, KV_HEADS, DIM, CHUNK = 9, 3, 64, 512


def gathered(store: KVStore, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    (group,) = padded_groups(batch)
    return attend_gathered(q, gather(store, 0, group.batch), group)


def timed(fn: Callable[[KVStore, torch.Tensor, ForwardBatch], object], *args: object) -> float:
    t = time.perf_counter()
    fn(*args)  # type: ignore[arg-type]
    return time.perf_counter() - t


def in_place(store: KVStore, q: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    return attend_in_place(store, 0, q, batch)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    spec = AttentionSpec(num_kv_heads=KV_HEADS, head_dim=DIM, dtype_bytes=4)
    for ctx in args.contexts:
        for shuffled in (False, True):
            state = allocate_states([spec], 8, ctx, "cpu", torch.float32)[0]
            assert isinstance(state, PagedKV)
            store = state.store
            host = store.host
            assert host is not None
            if shuffled:
                per = store.layout.max_blocks_per_seq
                order = torch.randperm(8 * per, generator=torch.Generator().manual_seed(0)) + SINK_BLOCK + 1
                for slot in range(8):
                    store.set_table(slot, 0, order[slot * per : (slot + 1) * per].tolist())
            host.kv[0].normal_()
            cases = {
                f"prefill chunk {min(CHUNK, ctx)}": [(0, [1] * min(CHUNK, ctx), ctx - min(CHUNK, ctx))],
                "decode x1": [(0, [1], ctx - 1)],
                "decode x8": [(s, [1], ctx - 1) for s in range(8)],
            }
            for name, seqs in cases.items():
                batch = ForwardBatch.build(seqs, torch.device("cpu"))
                q = torch.randn(batch.token_ids.shape[0], HEADS, DIM)
                with torch.inference_mode():
                    got = attend_in_place(store, 0, q, batch)
                    assert torch.allclose(got, gathered(store, q, batch), atol=1e-4, rtol=1e-4)
                    ours, ref = [], []
                    for _ in range(args.repeats):
                        ours.append(timed(in_place, store, q, batch))
                        ref.append(timed(gathered, store, q, batch))
                o, g = statistics.median(ours), statistics.median(ref)
                rows.append({"context": ctx, "tables": "shuffled" if shuffled else "in order", "case": name,
                             "in_place_ms": 1e3 * o, "gathered_ms": 1e3 * g, "speedup": g / o})  # fmt: skip
    load = os.getloadavg()[0]
    print(f"CPU attention, one layer of the default model's shape, {args.threads} thread(s), median of "
          f"{args.repeats}; load average {load:.1f} on {os.cpu_count()} CPUs")  # fmt: skip
    print(f"{'context':>7} {'tables':>9} {'case':>18} {'in place ms':>12} {'gathered ms':>12} {'x':>6}")
    for r in rows:
        print(f"{r['context']:>7} {r['tables']:>9} {r['case']:>18} {r['in_place_ms']:>12.2f} "
              f"{r['gathered_ms']:>12.2f} {r['speedup']:>5.2f}x")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"bench": "cpu_attention", "threads": args.threads, "load_average_1m": load,
              "repeats": args.repeats, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
