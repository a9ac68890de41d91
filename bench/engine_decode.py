"""Decode throughput and load time of the default model (SmolLM2-135M-Instruct GGUF) on the CPU:
ballast's Engine (submit/step, sampler included; --cpu-weights auto holds the GGUF's blocks for the
block kernel where it builds, dense float32; its engine thread sized by engine/threads.py) against
transformers' `generate` on the same GGUF in float32 (--threads, or torch's default), same prompts,
same lengths, greedy.

Two throughput figures per batch size: end to end (prefill + all new tokens, what a user waits
for) and decode only (transformers: generate(N) minus generate(1); ours: the decode steps' time).
Load: our `Engine.load` (read, dequantize, build, profile, allocate) against transformers'
`from_pretrained(gguf_file=...)`. Ours loads first, so it also pays the process's first-use
imports. Each throughput figure is the best of --repeats runs, ours and transformers alternating,
so a burst of load from another process on a shared box hits both sides alike and the best run
is the one least disturbed (timeit's rule). The load average is printed with the table. One run
of this script; table on stdout, JSON to bench/results/engine_decode.json.

    python -m ballast.bench.engine_decode [--batches 1 8] [--new-tokens 64] [--prompt-len 24]
        [--repeats 3] [--threads N] [--cpu-weights auto|blocks|dense]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.models.layers.core import ONEDNN_MAX_ROWS, onednn_linear_available
from ballast.models.weights.default_model import default_model_path

RESULTS = Path(__file__).parent / "results" / "engine_decode.json"
GREEDY = SamplingParams(temperature=0.0)
TOPICS = [
    "the history of Paris",
    "how bees make honey",
    "why the sky is blue",
    "a recipe for bread",
    "the rules of chess",
    "how rain forms",
    "the life of a star",
    "how a bicycle works",
]


def read_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of one pass reading a buffer far larger than the caches: at batch 8 a decode step
    reads every weight once, so weights_bytes / this is the floor of a step's time."""
    buf = torch.ones(nbytes // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def prompts(engine: Engine, batch: int, length: int) -> list[list[int]]:
    """`batch` chat prompts cut to exactly `length` tokens (no padding needed on either side)."""
    tok = engine.tokenizer
    out = []
    for i in range(batch):
        ids = tok.apply_chat_template(
            [{"role": "user", "content": f"Write a long essay about {TOPICS[i % len(TOPICS)]}, please."}]
        )
        if len(ids) < length:
            raise ValueError(f"prompt {i} has only {len(ids)} tokens; lower --prompt-len")
        out.append(ids[-length:])
    return out


def ours(
    engine: Engine, batch_prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, list[list[int]]]:
    """(end-to-end seconds, decode-only seconds, tokens per sequence) through Engine.submit."""
    sampling = dict.fromkeys(range(len(batch_prompts)), GREEDY)
    t0 = time.perf_counter()
    res = engine.submit(
        StepPlan(
            prefills=tuple(PrefillChunk(s, tuple(p), 0, True) for s, p in enumerate(batch_prompts)),
            sampling=sampling,
        )
    ).result()
    tokens = [[o.token_id] for o in res.outputs]
    t1 = time.perf_counter()
    length = len(batch_prompts[0])
    for step in range(new_tokens - 1):
        plan = StepPlan(
            decodes=tuple(DecodeToken(s, tokens[s][-1], length + step) for s in range(len(batch_prompts))),
            sampling=sampling,
        )
        for o in engine.submit(plan).result().outputs:
            tokens[o.slot].append(o.token_id)
    t2 = time.perf_counter()
    engine.submit(StepPlan(release=tuple(sampling))).result()
    return t2 - t0, t2 - t1, tokens


@torch.inference_mode()
def transformers_run(
    model: Any, batch_prompts: list[list[int]], new_tokens: int
) -> tuple[float, float, list[list[int]]]:
    ids = torch.tensor(batch_prompts)
    kwargs: dict[str, Any] = {
        "do_sample": False,
        "pad_token_id": 0,
        "eos_token_id": None,
        "attention_mask": torch.ones_like(ids),
    }
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
    t1 = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    t2 = time.perf_counter()
    return t2 - t1, max((t2 - t1) - (t1 - t0), 1e-9), out[:, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the best counts")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument(
        "--cpu-weights", choices=("auto", "blocks", "dense"), default="auto", help="our --cpu-weights"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads < 0 or args.new_tokens < 2 or min(args.batches) < 1 or args.repeats < 1:
        parser.error("--threads >= 0, --new-tokens >= 2, --repeats >= 1 and batches >= 1 are required")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = default_model_path()

    t0 = time.perf_counter()
    engine = Engine.load(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            cpu_weights=args.cpu_weights,
            max_num_seqs=max(args.batches),
            max_model_len=args.prompt_len + args.new_tokens + 8,
            prefill_chunk_tokens=256,
        )
    )
    ours_load = time.perf_counter() - t0

    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    hf_load = time.perf_counter() - t0

    load_before = os.getloadavg()
    bandwidth = read_bandwidth()
    weights = engine.load_report.weights_bytes
    rows = []
    for batch in args.batches:
        ps = prompts(engine, batch, args.prompt_len)
        ours(engine, ps, 4)  # warm-up
        transformers_run(hf, ps, 4)
        o_runs, h_runs = [], []
        for _ in range(args.repeats):
            o_runs.append(ours(engine, ps, args.new_tokens))
            h_runs.append(transformers_run(hf, ps, args.new_tokens))
        o_e2e, o_dec = min(r[0] for r in o_runs), min(r[1] for r in o_runs)
        h_e2e, h_dec = min(r[0] for r in h_runs), min(r[1] for r in h_runs)
        o_tok, h_tok = o_runs[0][2], h_runs[0][2]
        new = batch * args.new_tokens
        decoded = batch * (args.new_tokens - 1)
        rows.append(
            {
                "batch": batch,
                "ours_tok_s": new / o_e2e,
                "transformers_tok_s": new / h_e2e,
                "speedup": h_e2e / o_e2e,
                "ours_decode_tok_s": decoded / o_dec,
                "transformers_decode_tok_s": decoded / h_dec,
                "decode_speedup": h_dec / o_dec,
                "same_tokens": o_tok == h_tok,
                "bandwidth_floor_decode_tok_s": batch * bandwidth / weights,
            }
        )
    engine.shutdown()
    load_after = os.getloadavg()

    print(
        f"default model ({path.name}) on CPU, float32 activations, ours --cpu-weights {args.cpu_weights} "
        f"({engine.load_report.weights_bytes / 1e6:.0f} MB of weights), {torch.get_num_threads()} threads, "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, best of {args.repeats}; "
        f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} CPUs"
    )
    gemm = (
        f"oneDNN up to {ONEDNN_MAX_ROWS} rows, else torch BLAS" if onednn_linear_available() else "torch BLAS"
    )
    print(
        f"linears: {gemm}; read bandwidth {bandwidth / 1e9:.1f} GB/s over {weights / 1e6:.0f} MB of weights "
        f"-> decode floor {bandwidth / weights:.1f} steps/s"
    )
    print(
        f"load: ours {ours_load:.2f}s (model read+dequantize+build {engine.load_report.load_s:.2f}s), "
        f"transformers {hf_load:.2f}s"
    )
    print(
        f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>9} {'x':>6} | {'ours decode':>12} {'HF decode':>10} "
        f"{'x':>6} | same tokens"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ours_tok_s']:>11.1f} {r['transformers_tok_s']:>9.1f} "
            f"{r['speedup']:>5.2f}x | "
            f"{r['ours_decode_tok_s']:>12.1f} {r['transformers_decode_tok_s']:>10.1f} "
            f"{r['decode_speedup']:>5.2f}x | {r['same_tokens']}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "bench": "engine_decode",
        "model": path.name,
        "dtype": "float32",
        "cpu_weights": args.cpu_weights,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_average_1m": [load_before[0], load_after[0]],
        "machine": platform.machine(),
        "linears": gemm,
        "read_bandwidth_bytes_s": bandwidth,
        "weights_bytes": weights,
        "load_s": {"ours": ours_load, "ours_model_only": engine.load_report.load_s, "transformers": hf_load},
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
