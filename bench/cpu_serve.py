"""The default model served on the CPU, side by side in one run: `ballast serve` (one server per
--weights form: --cpu-weights blocks, the default, and dense; FORM+bf16 with
--cpu-prefill bfloat16; FORM/512 with --prefill-chunk-tokens 512),
llama.cpp's server on the same GGUF
(--llama-server: a `llama-server` binary, one side per --llama-threads value; --llama-python: a
Python with llama-cpp-python[server]), and transformers' `generate` (batch 1, the same weights in
float32, in this process).

    python -m ballast.bench.cpu_serve [--rounds 3] [--new-tokens 128] [--llama-server PATH]
        [--llama-python PATH] [--llama-threads 2] [--long-prompt-words 1500]
        [--weights blocks dense blocks+bf16 dense+bf16]

llama-server runs as `-m GGUF --host 127.0.0.1 --port P -t THREADS -c 32768 -np 8 -kvu`: 8 slots
over one KV buffer of 8 x 4,096 positions, as each ballast server's `--max-num-seqs 8
--max-model-len 4096`; its chat template is the one in the GGUF (jinja, its default).

Every server is started once, then each round measures every side in turn (interleaved, so a
burst of load from other processes on a shared box hits all of them alike), and the table gives
the median over rounds. Measures, through the official `openai` client, streaming chat:
- one stream: decode tok/s (tokens after the first over the time after the first);
- the same while another process keeps one core busy (a spinning child pinned to the last CPU);
- 8 streams at once: aggregate completion tok/s;
- TTFT of a long prompt (distinct in every request, so no prefix cache serves it).
The load average is recorded with every figure. Table on stdout, JSON to
bench/results/cpu_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
from ballast.bench.http_load import Outcome, free_port, one_stream, serve_command, server
from openai import AsyncOpenAI

RESULTS = Path(__file__).resolve().parent / "results" / "cpu_serve.json"
# --weights: the flags of each ballast side
FORMS = {
    "blocks": ["--cpu-weights", "blocks"],  # the default where the kernel builds (models/kernels/)
    "blocks+bf16": ["--cpu-weights", "blocks", "--cpu-prefill", "bfloat16"],
    "dense": ["--cpu-weights", "dense"],
    "dense+bf16": ["--cpu-weights", "dense", "--cpu-prefill", "bfloat16"],
    # Every step at most 512 prompt tokens (the CPU default before a lone prompt took 2,048).
    "dense/512": ["--cpu-weights", "dense", "--prefill-chunk-tokens", "512"],
    "blocks+bf16/512": [
        "--cpu-weights",
        "blocks",
        "--cpu-prefill",
        "bfloat16",
        "--prefill-chunk-tokens",
        "512",
    ],
}
WORDS = ["river", "stone", "lantern", "orchard", "harbor", "meadow"]
WORDS += ["copper", "violin", "glacier", "ember", "thistle", "compass"]


def spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


@contextmanager
def busy_core() -> Iterator[int]:
    """Another process spinning on the last CPU this process may use, for the block."""
    cpu = max(os.sched_getaffinity(0))
    proc = multiprocessing.get_context("spawn").Process(target=spin, args=(cpu,), daemon=True)
    proc.start()
    try:
        time.sleep(0.5)
        yield cpu
    finally:
        proc.terminate()
        proc.join()


def long_prompt(words: int, salt: int) -> str:
    rng = random.Random(salt)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"Note {salt}: {body}\nIn one sentence, which word appears most often above?"


async def one_stream_rate(base: str, model: str, new_tokens: int) -> float:
    """Decode tok/s of one streaming chat (tokens after the first over the time after it)."""
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=600, max_retries=0)
    start = time.perf_counter()
    out = await one_stream(client, model, "Write a long story about a lighthouse keeper.", new_tokens)
    await client.close()
    tokens = tokens_of(out)
    if out.error or tokens < 2:
        raise RuntimeError(f"{base}: stream failed: {out.error or tokens}")
    after_first = time.perf_counter() - start - out.ttft_s
    return (tokens - 1) / after_first


def tokens_of(out: Outcome) -> int:
    """Completion tokens from the usage chunk; a server that sends none (llama-cpp-python's)
    streams one token per chunk, so its chunks are counted."""
    return out.tokens or len(out.itl_s) + 1


async def streams_rate(base: str, model: str, n: int, new_tokens: int) -> float:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=600, max_retries=0)
    topics = ["a lighthouse", "the ocean", "a robot", "autumn", "a train", "the moon", "a key", "a map"]
    start = time.perf_counter()
    outs = await asyncio.gather(
        *(
            one_stream(client, model, f"Write a long story about {topics[i % 8]}.", new_tokens)
            for i in range(n)
        )
    )
    wall = time.perf_counter() - start
    await client.close()
    return sum(tokens_of(o) for o in outs if not o.error) / wall


async def ttft(base: str, model: str, text: str) -> float:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=600, max_retries=0)
    out = await one_stream(client, model, text, 2)
    await client.close()
    if out.error:
        raise RuntimeError(f"{base}: {out.error}")
    return out.ttft_s


def transformers_rate(new_tokens: int) -> Callable[[], float]:
    """transformers' generate, batch 1, greedy, on our float32 load of the same GGUF: decode
    tok/s as (generate(N) - generate(1)) over N - 1 tokens."""
    from ballast.engine.config import EngineConfig
    from ballast.engine.runner.loading import load
    from transformers import LlamaConfig, LlamaForCausalLM

    dense = load(
        EngineConfig(model="default", device="cpu", cpu_weights="dense"), torch.device("cpu"), torch.float32
    )
    config = {k: v for k, v in dense.hf_config.items() if k != "seed"}
    ref = LlamaForCausalLM(LlamaConfig(**config)).eval()
    ref.load_state_dict(dense.model.state_dict(), strict=False)
    ref.tie_weights()
    tok = dense.tokenizer.get()
    ids = torch.tensor(
        [
            tok.apply_chat_template(
                [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
            )
        ]
    )
    kw: dict[str, Any] = {"do_sample": False, "eos_token_id": None, "pad_token_id": 0}

    def run() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            ref.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            t1 = time.perf_counter()
            ref.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
            t2 = time.perf_counter()
        return (new_tokens - 1) / ((t2 - t1) - (t1 - t0))

    return run


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--long-prompt-words", type=int, default=1500)
    p.add_argument("--llama-server", type=Path, default=None, help="a llama.cpp `llama-server` binary")
    p.add_argument("--llama-python", type=Path, default=None, help="a Python with llama-cpp-python[server]")
    p.add_argument(
        "--llama-threads", type=int, nargs="+", default=[2], help="llama.cpp's -t; several: a side each"
    )
    p.add_argument(
        "--weights",
        nargs="+",
        choices=tuple(FORMS),
        default=["blocks", "dense"],
        help="the --cpu-weights forms to serve, a server each (+bf16: with --cpu-prefill bfloat16)",
    )
    p.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout of ballast (its repository root): its dense server beside ours, a "
        "before/after in the same run",
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    from ballast.models.weights.default_model import default_model_path

    gguf = default_model_path()
    rows: dict[str, dict[str, list[float]]] = {}
    loads: list[float] = []
    with ExitStack() as stack:
        sides: dict[str, tuple[str, str]] = {}  # name -> (base url, model name)
        variants: list[tuple[str, list[str], dict[str, str]]] = [
            (f"ballast ({form})", FORMS[form], {}) for form in args.weights
        ]
        if args.baseline is not None:
            env = {"PYTHONPATH": str(args.baseline.resolve())}
            variants.insert(0, (f"baseline {args.baseline.name} (dense)", ["--cpu-weights", "dense"], env))
        for name, extra, env in variants:
            port = free_port()
            # a long queue wait: on a box this loaded a stream may wait long for a slot (no 429)
            args_ = ["--max-num-seqs", "8", "--max-model-len", "4096", "--max-queue-wait-s", "600"]
            cmd = serve_command("default", port, *args_, *extra)
            if env:  # -P: the baseline's tree, not this working directory, comes first on the path
                cmd = [cmd[0], "-P", *cmd[1:]]
            sides[name] = (stack.enter_context(server(cmd, env, "/ready", port)), gguf.stem)
        for threads in map(str, args.llama_threads if args.llama_server is not None else ()):
            port = free_port()
            cmd = [str(args.llama_server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                   "-t", threads, "-c", str(8 * 4096), "-np", "8", "-kvu"]  # fmt: skip
            base = stack.enter_context(server(cmd, {}, "/health", port))
            sides[f"llama-server -t {threads}"] = (base, gguf.stem)
        if args.llama_python is not None:
            port = free_port()
            threads = str(args.llama_threads[0])
            cmd = [str(args.llama_python), "-m", "llama_cpp.server", "--model", str(gguf),
                   "--port", str(port), "--n_threads", threads, "--n_threads_batch", threads,
                   "--n_ctx", "4096", "--chat_format", "chatml"]  # fmt: skip
            sides["llama.cpp server"] = (stack.enter_context(server(cmd, {}, "/v1/models", port)), gguf.stem)
        hf = transformers_rate(args.new_tokens)
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name, (base, model) in sides.items():
                got = rows.setdefault(name, {})
                got.setdefault("one stream tok/s", []).append(
                    asyncio.run(one_stream_rate(base, model, args.new_tokens))
                )
                with busy_core():
                    got.setdefault("one stream, a core busy", []).append(
                        asyncio.run(one_stream_rate(base, model, args.new_tokens))
                    )
                got.setdefault("8 streams tok/s", []).append(asyncio.run(streams_rate(base, model, 8, 64)))
                text = long_prompt(args.long_prompt_words, salt=1000 * r + len(got))
                got.setdefault("long prompt TTFT s", []).append(asyncio.run(ttft(base, model, text)))
            t = rows.setdefault("transformers generate (batch 1)", {})
            t.setdefault("one stream tok/s", []).append(hf())
            with busy_core():
                t.setdefault("one stream, a core busy", []).append(hf())
            loads.append(os.getloadavg()[0])
            print(f"round {r + 1}/{args.rounds} done, load average {loads[-1]:.1f}", flush=True)
            write_report(args, gguf.name, rows, loads)
    measures = ["one stream tok/s", "one stream, a core busy", "8 streams tok/s", "long prompt TTFT s"]
    print(
        f"\ndefault model ({gguf.name}) on CPU, {os.cpu_count()} CPUs, median of {args.rounds} interleaved "
        f"rounds; load average {min(loads):.1f}-{max(loads):.1f}; {args.new_tokens} new tokens per stream; "
        f"long prompt {args.long_prompt_words} words"
    )
    print(f"{'side':34s}" + "".join(f"{m:>26s}" for m in measures))
    for name, got in rows.items():
        cells = [f"{statistics.median(got[m]):.2f}" if m in got else "-" for m in measures]
        print(f"{name:34s}" + "".join(f"{c:>26s}" for c in cells))
    write_report(args, gguf.name, rows, loads)
    print(f"wrote {args.out}")
    return 0


def write_report(
    args: argparse.Namespace, model: str, rows: dict[str, dict[str, list[float]]], loads: list[float]
) -> None:
    """The JSON so far (rewritten after every round, so a failed round keeps the ones before)."""
    report = {
        "bench": "cpu_serve",
        "model": model,
        "rounds": args.rounds,
        "new_tokens": args.new_tokens,
        "long_prompt_words": args.long_prompt_words,
        "cpu_weights": args.weights,
        "llama_server": str(args.llama_server) if args.llama_server else None,
        "llama_threads": args.llama_threads if args.llama_server or args.llama_python else None,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "torch": torch.__version__,
        "load_average_1m": loads,
        "rows": {
            n: {m: {"median": statistics.median(v), "runs": v} for m, v in g.items()} for n, g in rows.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
