"""Preemption on a GPU: moving a 4k-token sequence out of the KV pool to pinned host buffers and
back (park + resume) against recomputing it (prefilling its tokens again), on the same engine and
the same sequence, for a Llama-3-8B-shaped (and optionally Qwen3-Next-shaped) model with random
weights. The resumed and the recomputed sequence must sample the same next token.

    python -m ballast.bench.preemption [--models llama-8b qwen3-next] [--tokens 4096] [--repeats 3]

Table on stdout, JSON to bench/results/preemption.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from ballast.bench.paged_decode import hf_random_model, model_config
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import CheckpointRestore, PrefillChunk, SamplingParams, StepPlan
from ballast.memory.types import MiB

RESULTS = Path(__file__).parent / "results" / "preemption.json"
GREEDY = SamplingParams(temperature=0.0)


def sync() -> None:
    torch.cuda.synchronize()


def prefill(engine: Engine, slot: int, tokens: tuple[int, ...], chunk: int) -> int:
    """Prefill tokens into a fresh sequence in slot; returns the sampled next token."""
    out = -1
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        last = start + len(part) == len(tokens)
        res = engine.step(
            StepPlan(prefills=(PrefillChunk(slot, part, start, last),), sampling={slot: GREEDY})
        )
        if last:
            out = res.outputs[0].token_id
    return out


def bench(name: str, n_tokens: int, repeats: int, chunk: int, work_dir: str | None) -> dict[str, Any]:
    cfg = model_config(name, False, 64)
    hf = hf_random_model(cfg, torch.device("cuda"), torch.bfloat16)
    work = tempfile.mkdtemp(prefix=f"ballast-preemption-{name}-", dir=work_dir)
    hf.save_pretrained(work)
    del hf
    torch.cuda.empty_cache()
    engine = Engine.load(
        EngineConfig(
            model=work,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=2,
            max_model_len=n_tokens + 64,
            prefill_chunk_tokens=chunk,
            cuda_graphs=False,
        ),
        prefix_cache=PrefixCacheConfig(fraction=0.0),
    )
    try:
        vocab = int(cfg["vocab_size"])
        tokens = tuple(
            torch.randint(3, vocab, (n_tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        )
        kv = engine.runner.kv
        assert kv is not None
        park_s, resume_s, recompute_s, copy_s = [], [], [], []
        orders = engine._steps._orders
        apply_restores = orders.restore

        def timed_restores(plan: StepPlan) -> tuple[int, frozenset[int]]:
            """The resume's copy alone (blocks and states back from pinned memory), apart from the
            forward of the step it starts."""
            if not plan.restores:
                return apply_restores(plan)
            sync()
            t = time.perf_counter()
            out = apply_restores(plan)
            sync()
            copy_s.append(time.perf_counter() - t)
            return out

        orders.restore = timed_restores  # type: ignore[method-assign]
        for _ in range(repeats):
            engine.step(StepPlan(release=(0, 1)))
            sync()
            t0 = time.perf_counter()
            want = prefill(engine, 0, tokens, chunk)
            sync()
            recompute_s.append(time.perf_counter() - t0)
            fed = tokens[:-1]  # the state after n - 1 tokens, as a preempted decode leaves it
            engine.step(StepPlan(release=(0,)))
            prefill(engine, 0, fed, chunk)
            sync()
            t0 = time.perf_counter()
            assert engine._cache.parked.park(0, fed, kv)
            park_s.append(time.perf_counter() - t0)
            engine.step(StepPlan(release=(0,)))
            sync()
            t0 = time.perf_counter()
            res = engine.step(
                StepPlan(
                    prefills=(PrefillChunk(1, tokens[-1:], len(fed), True),),
                    restores=(CheckpointRestore(1, fed),),
                    sampling={1: GREEDY},
                )
            )
            sync()
            resume_s.append(time.perf_counter() - t0)
            assert res.outputs[0].token_id == want, "the resumed sequence sampled another token"
        moved = len(kv.table(1)) * kv.layout.block_bytes + engine.runner.fixed_bytes // 3
        row = {
            "model": name,
            "tokens": n_tokens,
            "moved_mib": moved / MiB,
            "park_ms": 1e3 * min(park_s),
            "resume_copy_ms": 1e3 * min(copy_s),
            "resume_ms": 1e3 * min(resume_s),
            "recompute_ms": 1e3 * min(recompute_s),
        }
        row["swap_ms"] = row["park_ms"] + row["resume_ms"]
        row["speedup"] = row["recompute_ms"] / row["swap_ms"]
        row["gbps"] = 2 * moved / ((row["park_ms"] + row["resume_copy_ms"]) / 1e3) / 1e9
        return row
    finally:
        engine.shutdown()
        for p in Path(work).iterdir():
            p.unlink()
        Path(work).rmdir()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama-8b"], choices=["llama-8b", "qwen3-next"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("preemption bench: needs CUDA (parking moves KV from the GPU to pinned host memory)")
    rows = [bench(m, args.tokens, args.repeats, args.prefill_chunk, args.work_dir) for m in args.models]
    print(
        f"preemption of one {args.tokens}-token sequence on {torch.cuda.get_device_name()}, best of "
        f"{args.repeats}"
    )
    print(
        "resume = copy back + the step that samples the next token; recompute = prefill again + the same "
        "token"
    )
    print(
        "model        moved MiB  park ms  copy back ms  resume ms  swap ms  recompute ms  speedup  copy GB/s"
    )
    for r in rows:
        print(
            f"{r['model']:<12} {r['moved_mib']:9.1f} {r['park_ms']:8.1f} {r['resume_copy_ms']:13.1f} "
            f"{r['resume_ms']:10.1f} {r['swap_ms']:8.1f} {r['recompute_ms']:13.1f} {r['speedup']:7.1f}x "
            f"{r['gbps']:10.1f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"rows": rows, "device": torch.cuda.get_device_name()}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
