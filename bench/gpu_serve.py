"""HTTP streaming chat against `ballast serve` and `transformers serve --continuous-batching` on the
same random-weight Hugging Face directory: throughput, TTFT and ITL p50/p99 per stream count.

    python -m ballast.bench.gpu_serve [--model DIR | --shape llama-3b] [--quick]
    python -m ballast.bench.gpu_serve --shape tiny-llama --device cpu --streams 1 4 --prompt-tokens 200 \\
        --new-tokens 16 --reference none                         # a check of the plumbing on the CPU
    python -m ballast.bench.gpu_serve --model builtin:qwen3-next-80b-a3b --reference none \\
        --streams 1 32 --ballast-args "--tensor-parallel-size 2"  # a built-in shape (random weights)

A built-in model is served with the committed SmolLM2 tokenizer (bench/tokenizer, written under
--work-dir) unless --tokenizer names another directory: the GPU host has no network.

Each stream is one streaming chat completion through the official `openai` client: a user
message of ~--prompt-tokens tokens (different words per request, so no two prompts share more than
the chat template's system prompt) and --new-tokens new tokens, greedy (or at --temperature).
At each stream count N the bench keeps N requests in flight until --requests-per-stream x N have
run (at least --min-requests) after one warm-up request. Throughput is completion tokens over the
wall time of that load; TTFT is from sending the request to the first content chunk; ITL is the
gap between content chunks. Where 1 is among the stream counts, the engine's own batch-1 decode
rate on the same model is measured first in this process (`step_overlap.engine_rates`: one step
at a time and pipelined), and one stream's decode rate over HTTP is reported against it (the
issue's aim: >= 0.85).
Defaults: 1/8/32/128/256 streams, ~1,000-token prompts, 256 new tokens, the Llama-3B shape
written by bench/checkpoint_dir. `--quick`: 1/32/128 streams, one request per stream (two at 1),
and the reference at most at 128. Both servers are started here on free ports and stopped after;
`transformers` must be on PATH next to this Python. Table on stdout, JSON to
bench/results/gpu_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from ballast.bench.checkpoint_dir import write_tokenizer
from ballast.bench.gpu_prefix import WORDS, ensure_dir
from ballast.bench.http_load import Outcome, free_port, one_stream, pct, serve_command, server
from ballast.bench.step_overlap import engine_rates
from ballast.engine.config import EngineConfig
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

RESULTS = Path(__file__).parent / "results" / "gpu_serve.json"


def prompt_text(i: int, tokens: int) -> str:
    rng = random.Random(i)
    words = " ".join(rng.choice(WORDS) for _ in range(max(1, int(tokens * 0.9))))
    return f"Request {i}. Summarise these notes in one long paragraph: {words}"


def server_ttft(base: str) -> tuple[float, float] | None:
    """(sum, count) of ballast's time-to-first-token histogram (first token at the HTTP handler,
    before detokenizing), or None where the server has no such metric (transformers serve)."""
    response = httpx.get(base + "/metrics", timeout=30)
    if response.status_code != 200:
        return None
    found = {}
    for family in text_string_to_metric_families(response.text):
        if family.name == "ballast_time_to_first_token_seconds":
            for sample in family.samples:
                found[sample.name.rsplit("_", 1)[-1]] = sample.value
    return (found["sum"], found["count"]) if {"sum", "count"} <= found.keys() else None


async def load(
    base: str, model: str, streams: int, requests: int, args: argparse.Namespace
) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=1800, max_retries=0)
    gate = asyncio.Semaphore(streams)
    offset = random.Random(streams).randrange(1 << 20)  # fresh prompts at every level

    async def gated(i: int) -> Outcome:
        async with gate:
            return await one_stream(
                client, model, prompt_text(offset + i, args.prompt_tokens), args.new_tokens, args.temperature
            )

    await one_stream(client, model, prompt_text(-1, args.prompt_tokens), 4)  # warm-up
    before = server_ttft(base)
    start = time.perf_counter()
    outs = await asyncio.gather(*(gated(i) for i in range(requests)))
    wall = time.perf_counter() - start
    await client.close()
    after = server_ttft(base)
    server_mean = None
    if before is not None and after is not None and after[1] > before[1]:
        server_mean = (after[0] - before[0]) / (after[1] - before[1])
    ok = [o for o in outs if not o.error]
    itl = [x for o in ok for x in o.itl_s]
    # A stream's decode rate: tokens after the first over the time from the first content chunk
    # to the last (a chunk may carry several tokens, so chunks are not counted).
    decode = [(o.tokens - 1) / sum(o.itl_s) for o in ok if o.itl_s and sum(o.itl_s) > 0]
    tokens = sum(o.tokens for o in ok)
    return {
        "streams": streams,
        "requests": requests,
        "completed": len(ok),
        "dropped": len(outs) - len(ok),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50_s": pct([o.ttft_s for o in ok], 50),
        "ttft_p99_s": pct([o.ttft_s for o in ok], 99),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p99_ms": 1e3 * pct(itl, 99),
        "stream_decode_tok_s": pct(decode, 50) if decode else 0.0,
        "server_ttft_mean_s": server_mean,
        "errors": sorted({o.error for o in outs if o.error})[:3],
    }


def run_levels(base: str, model: str, levels: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n in levels:
        requests = max(args.min_requests, args.requests_per_stream * n)
        row = asyncio.run(load(base, model, n, requests, args))
        print(
            f"  {n:>3} streams: {row['tok_s']:8.1f} tok/s  TTFT p50/p99 {row['ttft_p50_s']:.3f}/"
            f"{row['ttft_p99_s']:.3f} s  ITL p50/p99 {row['itl_p50_ms']:.1f}/{row['itl_p99_ms']:.1f} ms  "
            f"dropped {row['dropped']} {row['errors']}",
            flush=True,
        )
        rows.append(row)
    return rows


def run_ballast(model_dir: Path | str, args: argparse.Namespace) -> list[dict[str, Any]]:
    port = free_port()
    cmd = serve_command(str(model_dir), port, "--max-num-seqs", str(max(args.streams)), "--max-queue", "4096")
    cmd += ["--device", args.device, *args.ballast_args.split()]
    if args.tokenizer is not None:
        cmd += ["--tokenizer", str(args.tokenizer)]
    log = args.server_logs / "ballast.log" if args.server_logs else None
    with server(cmd, {}, "/ready", port, timeout_s=900, log_path=log) as base:
        served = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        print(f"ballast serve ({' '.join(cmd[4:])})", flush=True)
        return run_levels(base, served, args.streams, args)


def run_transformers(model_dir: Path | str, args: argparse.Namespace) -> list[dict[str, Any]]:
    port = free_port()
    exe = str(Path(sys.executable).parent / "transformers")
    cmd = [exe, "serve", "--continuous-batching", "--port", str(port), *args.reference_args.split()]
    cmd.append(str(model_dir))
    levels = [n for n in args.streams if n <= args.reference_max_streams]
    log = args.server_logs / "transformers.log" if args.server_logs else None
    with server(cmd, {"HF_HUB_OFFLINE": "1"}, "/health", port, timeout_s=900, log_path=log) as base:
        print(f"transformers serve ({' '.join(cmd[1:])})", flush=True)
        return run_levels(base, str(model_dir), levels, args)


def table(result: dict[str, Any]) -> str:
    lines = [
        f"\n{result['model']}: ~{result['prompt_tokens']}-token prompts, {result['new_tokens']} new tokens",
        "| server | streams | tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | completed | dropped |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("ballast", "transformers"):
        for r in result.get(name, []):
            lines.append(
                f"| {name} | {r['streams']} | {r['tok_s']:.1f} | {1e3 * r['ttft_p50_s']:.0f} / "
                f"{1e3 * r['ttft_p99_s']:.0f} | {r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | "
                f"{r['completed']} | {r['dropped']} |"
            )
    one = next((r for r in result.get("ballast", []) if r["streams"] == 1), None)
    if one is not None and result.get("engine"):
        rates = result["engine"]
        lines.append(
            f"1 stream decodes {one['stream_decode_tok_s']:.1f} tok/s over HTTP = "
            + ", ".join(
                f"{one['stream_decode_tok_s'] / v:.2f} of the {k} rate ({v:.1f})" for k, v in rates.items()
            )
        )
        if one.get("server_ttft_mean_s") is not None:
            lines.append(
                f"time to first token of a ~{result['prompt_tokens']}-token prompt, idle: engine "
                f"{result['engine_first_token_ms']:.1f} ms, server (first token at the HTTP handler, "
                f"mean) {1e3 * one['server_ttft_mean_s']:.1f} ms, client (first content chunk, p50) "
                f"{1e3 * one['ttft_p50_s']:.1f} ms"
            )
    ours = {r["streams"]: r["tok_s"] for r in result.get("ballast", [])}
    for r in result.get("transformers", []):
        if r["streams"] in ours and r["tok_s"] > 0:
            lines.append(
                f"{r['streams']} streams: ballast {ours[r['streams']] / r['tok_s']:.2f}x transformers serve"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument(
        "--model", help="a Hugging Face directory or builtin:NAME (default: write --shape's directory)"
    )
    ap.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer directory for ballast serve")
    ap.add_argument("--shape", default="llama-3b", help="bench/checkpoint_dir shape to write")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/ballast-bench-models"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--streams", type=int, nargs="+", default=None, help="default 1 8 32 128 256")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0, help="of every request (0: greedy)")
    ap.add_argument("--requests-per-stream", type=int, default=None, help="default 2 (--quick 1)")
    ap.add_argument("--min-requests", type=int, default=None, help="default 4 (--quick 2)")
    ap.add_argument("--reference", choices=["transformers", "none"], default="transformers")
    ap.add_argument("--reference-max-streams", type=int, default=None, help="default all (--quick 128)")
    ap.add_argument("--ballast-args", default="", help="more `ballast serve` flags, one string")
    ap.add_argument("--reference-args", default="", help="more `transformers serve` flags, one string")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--no-engine-rate",
        action="store_true",
        help="skip the engine's own batch-1 rate (it loads the model a second time, on one device)",
    )
    ap.add_argument(
        "--server-logs", type=Path, help="a directory for both servers' output (ballast.log, ...)"
    )
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    args.streams = args.streams or ([1, 32, 128] if args.quick else [1, 8, 32, 128, 256])
    args.requests_per_stream = args.requests_per_stream or (1 if args.quick else 2)
    args.min_requests = args.min_requests or (2 if args.quick else 4)
    args.reference_max_streams = args.reference_max_streams or (128 if args.quick else max(args.streams))
    if args.server_logs:
        args.server_logs.mkdir(parents=True, exist_ok=True)
    if args.model and args.model.startswith("builtin:") and args.reference != "none":
        ap.error("transformers serve cannot serve a built-in model: pass --reference none")
    if args.model and args.model.startswith("builtin:") and args.tokenizer is None:
        args.tokenizer = args.work_dir / "smollm2-tokenizer"
        args.tokenizer.mkdir(parents=True, exist_ok=True)
        write_tokenizer(args.tokenizer)
    model_dir: Path | str = (
        (args.model if args.model.startswith("builtin:") else Path(args.model))
        if args.model
        else ensure_dir(args.shape, args.work_dir, args.device)
    )
    result: dict[str, Any] = {
        "bench": "gpu_serve",
        "model": args.model or args.shape,
        "ballast_args": args.ballast_args,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
    }
    # the engine's own batch-1 rate and TTFT on the same model, for the 1-stream aims
    if 1 in args.streams and not args.no_engine_rate:
        cfg = EngineConfig(
            model=str(model_dir),
            device=args.device,
            max_num_seqs=8,
            tokenizer=None if args.tokenizer is None else str(args.tokenizer),
        )
        question = prompt_text(0, args.prompt_tokens)  # the size the streams send
        result["engine"], result["engine_first_token_ms"], _ = engine_rates(
            cfg, args.new_tokens, repeats=2, question=question
        )
        print(f"engine, batch 1: {result['engine']}", flush=True)
    result["ballast"] = run_ballast(model_dir, args)
    if args.reference == "transformers":
        result["transformers"] = run_transformers(model_dir, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
