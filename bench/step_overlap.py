"""Batch-1 decode through the engine vs one stream over HTTP, with step overlap on and off.

    python -m ballast.bench.step_overlap [--model builtin:tiny-llama] [--device cpu|cuda]
                                         [--new-tokens 128] [--repeats 3] [--tokenizer DIR]

Engine side, in this process: one sequence decoded `new_tokens` steps,
  - "engine step()": each plan names the token the previous step returned (one step at a time);
  - "engine pipelined": every decode plan submitted at once with LAST_SAMPLED tokens, so each
    step is launched before the previous one's tokens are back (the engine's best case).
HTTP side: `ballast serve` on the same model, one streaming chat completion at a time, with
BALLAST_OVERLAP=1 and =0. The end of sequence is biased away (logit_bias -100) on both sides so
every run decodes exactly `new_tokens` tokens. Decode rate over HTTP is (completion tokens - 1) /
(time from the first content chunk to the last): a chunk may carry several tokens (the
detokenizer holds a token back until its text is whole, which random weights on a 128k-token
vocabulary do often), so chunks undercount; a first chunk of k tokens overstates the rate by
(k - 1) / (tokens - 1). Time to first token is reported apart.

The aim (issue 10): one stream over HTTP within 15% of the engine's own batch-1 rate. Prints a
table and writes bench/results/step_overlap.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx
import torch
from ballast.bench.http_load import GiB, free_port, serve_command, server, write_meminfo
from ballast.bench.paged_decode import free_device_memory
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import LAST_SAMPLED, DecodeToken, PrefillChunk, SamplingParams, StepPlan

RESULTS = Path(__file__).resolve().parent / "results"
QUESTION = "Write a long story about a lighthouse keeper and the ships she guided home."


class EngineRates(NamedTuple):
    rates: dict[str, float]  # median decode tok/s of one sequence: one step at a time, pipelined
    first_token_ms: float  # median ms from submitting the prompt (a fresh prefill) to its token
    eos: list[int]


def engine_rates(cfg: EngineConfig, new_tokens: int, repeats: int, question: str = QUESTION) -> EngineRates:
    """The engine's own batch-1 figures for the chat of `question`."""
    engine = Engine.load(cfg)
    try:
        tok = engine.tokenizer
        eos = sorted(tok.eos_token_ids)
        prompt = tuple(tok.apply_chat_template([{"role": "user", "content": question}]))
        params = SamplingParams(temperature=0.0, logit_bias=tuple((e, -100.0) for e in eos))
        rates: dict[str, list[float]] = {"engine step()": [], "engine pipelined": []}
        first_ms: list[float] = []
        for run in range(repeats + 1):  # the first run of each warms up (kernels, graphs, allocator)
            for mode, timed in rates.items():
                rate, first_s = _decode_once(
                    engine, prompt, params, new_tokens, pipelined=mode == "engine pipelined"
                )
                if run:
                    timed.append(rate)
                    first_ms.append(1e3 * first_s)
        medians = {mode: statistics.median(v) for mode, v in rates.items()}
        return EngineRates(medians, statistics.median(first_ms), eos)
    finally:
        engine.shutdown()
        del engine
        free_device_memory()


def _decode_once(
    engine: Engine, prompt: tuple[int, ...], params: SamplingParams, new_tokens: int, pipelined: bool
) -> tuple[float, float]:
    """(decode tok/s after the first token, seconds from submitting the prefill to its token)."""
    sampling = {0: params}
    start = time.perf_counter()
    first = engine.submit(StepPlan(prefills=(PrefillChunk(0, prompt, 0, True),), sampling=sampling)).result()
    first_s = time.perf_counter() - start
    token, pos = first.outputs[0].token_id, len(prompt)
    start = time.perf_counter()
    if pipelined:
        futures = [
            engine.submit(StepPlan(decodes=(DecodeToken(0, LAST_SAMPLED, pos + i),), sampling=sampling))
            for i in range(new_tokens - 1)
        ]
        for f in futures:
            f.result()
    else:
        for i in range(new_tokens - 1):
            res = engine.submit(
                StepPlan(decodes=(DecodeToken(0, token, pos + i),), sampling=sampling)
            ).result()
            token = res.outputs[0].token_id
    elapsed = time.perf_counter() - start
    engine.submit(StepPlan(release=(0,))).result()
    return (new_tokens - 1) / elapsed, first_s


def http_rates(args: argparse.Namespace, eos: list[int], overlap: bool, root: Path) -> dict[str, float]:
    port = free_port()
    cmd = serve_command(args.model, port, "--device", args.device, "--max-num-seqs", str(args.max_num_seqs))
    cmd += ["--tokenizer", args.tokenizer] if args.tokenizer else []
    env = {"BALLAST_MEMORY_ROOT": str(root), "BALLAST_OVERLAP": "1" if overlap else "0"}
    with server(cmd, env, "/ready", port) as base:
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        # One client for every run: a new httpx client builds an SSL context (~20 ms here), which
        # an earlier version of this bench counted into the time to first token.
        with httpx.Client(timeout=600) as client:
            runs = [_stream_once(client, base, model, eos, args.new_tokens) for _ in range(args.repeats + 1)]
        runs = runs[1:]
    return {
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        "tokens": min(r["tokens"] for r in runs),
    }


def _stream_once(
    client: httpx.Client, base: str, model: str, eos: list[int], new_tokens: int
) -> dict[str, float]:
    body = {
        "model": model,
        "stream": True,
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "logit_bias": {str(e): -100 for e in eos},
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": QUESTION}],
    }
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    with client.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if len(stamps) < 2:
        raise RuntimeError(f"the stream carried {len(stamps)} content chunks; nothing to time")
    return {
        "decode_tok_s": (tokens - 1) / (stamps[-1] - stamps[0]),
        "ttft_ms": (stamps[0] - start) * 1e3,
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:tiny-llama")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side (median); one more warms up")
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (for a builtin:<shape> model)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    cfg = EngineConfig(
        model=args.model,
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        max_model_len=2048,
        tokenizer=args.tokenizer,
    )
    engine, first_token_ms, eos = engine_rates(cfg, args.new_tokens, args.repeats)
    result: dict[str, object] = {
        "bench": "step_overlap",
        "model": args.model,
        "device": args.device,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
        "torch": torch.__version__,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "cpus": os.cpu_count(),
        "engine": engine,
        "engine_first_token_ms": first_token_ms,
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_meminfo(root, 64 * GiB, 48 * GiB)  # level OK whatever else runs on the host
        result["http"] = {
            "overlap on": http_rates(args, eos, True, root),
            "overlap off": http_rates(args, eos, False, root),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_overlap.json").write_text(json.dumps(result, indent=2))
    print(table(result))
    return 0


def table(result: dict[str, object]) -> str:
    engine = result["engine"]
    http = result["http"]
    assert isinstance(engine, dict) and isinstance(http, dict)
    base = engine["engine step()"]
    lines = [
        f"step_overlap: {result['model']} on {result['gpu'] or result['device']}, batch 1, "
        f"{result['new_tokens']} new tokens, median of {result['repeats']}",
        "| path | decode tok/s | vs engine step() | TTFT ms |",
        "|---|---|---|---|",
    ]
    for mode, rate in engine.items():
        ttft = f"{result['engine_first_token_ms']:.1f}" if mode == "engine step()" else ""
        lines.append(f"| {mode} | {rate:.1f} | {rate / base:.2f} | {ttft} |")
    for mode, figures in http.items():
        rate = figures["decode_tok_s"]
        lines.append(f"| HTTP, {mode} | {rate:.1f} | {rate / base:.2f} | {figures['ttft_ms']:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
