"""Decode steps on CUDA with and without decode graphs: the same engine, the same built-in models
and batches, side by side in one run.

Each side loads the model (bf16), prefills `--batches` sequences, then times `--steps` greedy
decode steps through `Engine.step` (forward + sampling, as the scheduler drives it). Table on
stdout, JSON to bench/results/decode_graphs.json.

    python -m ballast.bench.decode_graphs [--models builtin:tiny-qwen3.5-moe ...]
        [--batches 1 8 32] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan

RESULTS = Path(__file__).parent / "results" / "decode_graphs.json"
MODELS = ["builtin:tiny-llama", "builtin:tiny-qwen3-next", "builtin:tiny-qwen3.5-moe"]
PROMPT_LEN = 32


def decode_ms(engine: Engine, batch: int, steps: int) -> float:
    """Median milliseconds of one decode step of `batch` sequences."""
    greedy = SamplingParams(temperature=0.0)
    sampling = dict.fromkeys(range(batch), greedy)
    prompt = tuple(range(5, 5 + PROMPT_LEN))
    res = engine.step(
        StepPlan(prefills=tuple(PrefillChunk(s, prompt, 0, True) for s in range(batch)), sampling=sampling)
    )
    last = {o.slot: o.token_id for o in res.outputs}
    times = []
    for i in range(steps):
        plan = StepPlan(
            decodes=tuple(DecodeToken(s, last[s], PROMPT_LEN + i) for s in range(batch)), sampling=sampling
        )
        t0 = time.perf_counter()
        for o in engine.step(plan).outputs:
            last[o.slot] = o.token_id
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1000 * times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("decode graphs are a CUDA feature: no CUDA device here")
    if args.steps < 2 or min(args.batches) < 1:
        parser.error("--steps must be >= 2 and every batch >= 1")
    max_len = PROMPT_LEN + args.steps + 1
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for graphs in (False, True):
            cfg = EngineConfig(
                model=model,
                device="cuda",
                dtype="bfloat16",
                max_num_seqs=max(args.batches),
                max_model_len=max(max_len, 256),
                cuda_graphs=graphs,
            )
            t0 = time.perf_counter()
            engine = Engine.load(cfg)
            load_s = time.perf_counter() - t0
            try:
                dg = engine.runner.graph_runner.graphs
                captured, held = (dg.captured, dg.held_bytes) if dg is not None else (0, 0)
                for batch in args.batches:
                    decode_ms(engine, batch, 4)  # warm-up (first-call costs out of the timing)
                    ms = decode_ms(engine, batch, args.steps)
                    rows.append(
                        {
                            "model": model,
                            "graphs": graphs,
                            "captured": captured,
                            "held_bytes": held,
                            "load_s": load_s,
                            "batch": batch,
                            "step_ms": ms,
                            "tok_s": batch * 1000 / ms,
                        }
                    )
            finally:
                engine.shutdown()

    print(
        f"decode step on {torch.cuda.get_device_name()}, bf16, median of {args.steps} steps (forward + "
        "sampling)"
    )
    print(
        f"{'model':<26} {'batch':>5} {'eager ms':>9} {'graph ms':>9} {'eager tok/s':>12} "
        f"{'graph tok/s':>12} {'speedup':>8}"
    )
    for model in args.models:
        for batch in args.batches:
            e = next(r for r in rows if r["model"] == model and r["batch"] == batch and not r["graphs"])
            g = next(r for r in rows if r["model"] == model and r["batch"] == batch and r["graphs"])
            print(
                f"{model:<26} {batch:>5} {e['step_ms']:>9.2f} {g['step_ms']:>9.2f} {e['tok_s']:>12.0f} "
                f"{g['tok_s']:>12.0f} {e['step_ms'] / g['step_ms']:>7.2f}x"
            )
    for model in args.models:
        g = next(r for r in rows if r["model"] == model and r["graphs"])
        e = next(r for r in rows if r["model"] == model and not r["graphs"])
        print(
            f"{model}: {g['captured']} graphs captured, holding {g['held_bytes'] / 2**20:.1f} MiB; "
            f"load {e['load_s']:.2f} s eager, {g['load_s']:.2f} s with capture"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "bench": "decode_graphs",
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "steps": args.steps,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
