"""HTTP load: streaming chat through the official `openai` client against a real server.

    python -m ballast.bench.http_load [--model default] [--concurrency 1 8 32] [--new-tokens 32]
                                      [--reference transformers]

Starts `ballast serve` (and, with --reference transformers, `transformers serve
--continuous-batching` on the same GGUF) on free localhost ports, runs the same streaming chat
load at each concurrency against each, then measures time-to-503 at CRITICAL: the memory tree the
ballast server reads (BALLAST_MEMORY_ROOT, a temp dir) is rewritten to CRITICAL and fresh requests
are timed until their refusal. Prints a table and writes bench/results/http_load.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from openai import APIStatusError, AsyncOpenAI

RESULTS = Path(__file__).resolve().parent / "results"
TOPICS = [
    "a lighthouse",
    "the ocean",
    "a small robot",
    "autumn leaves",
    "a train journey",
    "the moon",
    "a lost key",
    "a mountain village",
    "bread baking",
    "a chess game",
    "rain in a city",
    "an old map",
]
GiB = 1 << 30


def write_meminfo(root: Path, total: int, available: int) -> None:
    """A minimal /proc tree for the server's MemWatch (no cgroup, no PSI pressure)."""
    proc = root / "proc"
    (proc / "pressure").mkdir(parents=True, exist_ok=True)
    for rel, text in (
        ("meminfo", f"MemTotal: {total // 1024} kB\nMemAvailable: {available // 1024} kB\n"),
        (
            "pressure/memory",
            "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        ),
    ):
        tmp = proc / (rel + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, proc / rel)


def serve_command(model: str, port: int, *args: str) -> list[str]:
    """`ballast serve --model MODEL` on localhost:PORT in a child of this Python, with more CLI
    arguments and its access log off."""
    head = [sys.executable, "-m", "ballast.server.cli", "serve", "--model", model, "--port", str(port)]
    return [*head, "--log-level", "warning", *args]


@contextmanager
def server(
    cmd: list[str],
    env: dict[str, str],
    ready_path: str,
    port: int,
    timeout_s: float = 300.0,
    log_path: Path | None = None,
) -> Iterator[str]:
    """The server `cmd` started, waited for (`ready_path` answering 200) and stopped after; its
    output goes to log_path where given (a temporary file otherwise, shown if it fails to start)."""
    with open(log_path, "w+") if log_path is not None else tempfile.TemporaryFile(mode="w+") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"{cmd[0]} exited during start-up:\n{log.read()[-3000:]}")
                try:
                    if httpx.get(base + ready_path, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{cmd} not ready within {timeout_s} s")
                time.sleep(0.5)
            yield base
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Outcome:
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""
    text: str = ""  # the streamed answer
    wall_s: float = 0.0  # from sending to the stream's end


async def one_stream(
    client: AsyncOpenAI, model: str, text: str, new_tokens: int, temperature: float = 0.0
) -> Outcome:
    """One streaming chat of `text` as the user message: TTFT, ITL, completion tokens."""
    out = Outcome()
    start = time.perf_counter()
    last = start
    try:
        stream = await client.chat.completions.create(
            model=model,
            stream=True,
            max_tokens=new_tokens,
            temperature=temperature,
            stream_options={"include_usage": True},
            messages=[{"role": "user", "content": text}],
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].delta.content:
                out.text += chunk.choices[0].delta.content
                if out.ttft_s == 0.0:
                    out.ttft_s = now - start
                else:
                    out.itl_s.append(now - last)
                last = now
            if chunk.usage is not None:
                out.tokens = chunk.usage.completion_tokens
        out.wall_s = time.perf_counter() - start
    except Exception as exc:  # a dropped stream is a result here, not a crash of the bench
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    return out


def story(topic: str) -> str:
    return f"Write a long story about {topic}."


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


async def load(base: str, model: str, concurrency: int, requests: int, new_tokens: int) -> dict[str, float]:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=600, max_retries=0)
    gate = asyncio.Semaphore(concurrency)

    async def gated(i: int) -> Outcome:
        async with gate:
            return await one_stream(client, model, story(TOPICS[i % len(TOPICS)]), new_tokens)

    await one_stream(client, model, story("warm-up"), 4)
    start = time.perf_counter()
    outs = await asyncio.gather(*(gated(i) for i in range(requests)))
    wall = time.perf_counter() - start
    await client.close()
    ok = [o for o in outs if not o.error]
    itl = [x for o in ok for x in o.itl_s]
    return {
        "concurrency": concurrency,
        "requests": requests,
        "completed": len(ok),
        "dropped": len(outs) - len(ok),
        "tokens": sum(o.tokens for o in ok),
        "wall_s": wall,
        "tok_s": sum(o.tokens for o in ok) / wall,
        "ttft_p50_s": pct([o.ttft_s for o in ok], 50),
        "ttft_p99_s": pct([o.ttft_s for o in ok], 99),
        "itl_p50_ms": 1e3 * pct(itl, 50),
        "itl_p99_ms": 1e3 * pct(itl, 99),
        "errors": sorted({o.error for o in outs if o.error})[:3],  # type: ignore[dict-item]
    }


async def time_to_503(base: str, model: str, n: int) -> dict[str, float]:
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=30, max_retries=0)
    times: list[float] = []
    statuses: dict[str, int] = {}
    retry_after: set[str] = set()
    for _ in range(n):
        start = time.perf_counter()
        try:
            await client.chat.completions.create(
                model=model, max_tokens=8, messages=[{"role": "user", "content": "hi"}]
            )
            statuses["200"] = statuses.get("200", 0) + 1
        except APIStatusError as exc:
            times.append(time.perf_counter() - start)
            statuses[str(exc.status_code)] = statuses.get(str(exc.status_code), 0) + 1
            retry_after.add(exc.response.headers.get("retry-after", ""))
    await client.close()
    return {
        "requests": n,
        "statuses": statuses,  # type: ignore[dict-item]
        "retry_after": sorted(retry_after),  # type: ignore[dict-item]
        "p50_ms": 1e3 * pct(times, 50),
        "p99_ms": 1e3 * pct(times, 99),
    }


def run_levels(base: str, model: str, args: argparse.Namespace) -> list[dict[str, float]]:
    rows = []
    for c in args.concurrency:
        row = asyncio.run(load(base, model, c, max(args.min_requests, 2 * c), args.new_tokens))
        print(
            f"  c={c:<3} {row['tok_s']:7.1f} tok/s  ttft p50/p99 "
            f"{row['ttft_p50_s']:.2f}/{row['ttft_p99_s']:.2f} s"
            f"  itl p50/p99 {row['itl_p50_ms']:.0f}/{row['itl_p99_ms']:.0f} ms  dropped {row['dropped']} "
            f"{row['errors']}",
            flush=True,
        )
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--reference", choices=["none", "transformers"], default="none")
    ap.add_argument("--refusals", type=int, default=200, help="requests timed at CRITICAL")
    args = ap.parse_args(argv)

    result: dict[str, object] = {
        "bench": "http_load",
        "model": args.model,
        "new_tokens": args.new_tokens,
        "cpus": os.cpu_count(),
        "loadavg_before": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_meminfo(root, 16 * GiB, 12 * GiB)  # OK
        port = free_port()
        cmd = serve_command(args.model, port, "--max-num-seqs", str(args.max_num_seqs), "--max-queue", "1024")
        with server(cmd, {"BALLAST_MEMORY_ROOT": str(root)}, "/ready", port) as base:
            served = httpx.get(base + "/v1/models").json()["data"][0]["id"]
            print(f"ballast ({served}, --max-num-seqs {args.max_num_seqs})", flush=True)
            result["ballast"] = run_levels(base, served, args)
            write_meminfo(root, 16 * GiB, GiB)  # CRITICAL: available under the 2.4 GiB reserve
            time.sleep(1.0)  # > 2 MemWatch polls
            refusals = asyncio.run(time_to_503(base, served, args.refusals))
            result["ballast_time_to_503"] = refusals
            print(
                f"  CRITICAL: time to 503 p50 {refusals['p50_ms']:.2f} ms  p99 {refusals['p99_ms']:.2f} ms  "
                f"statuses {refusals['statuses']}  Retry-After {refusals['retry_after']}",
                flush=True,
            )

    if args.reference == "transformers":
        model_dir = reference_dir()
        port = free_port()
        cmd = [
            str(Path(sys.executable).parent / "transformers"),
            "serve",
            "--continuous-batching",
            "--port",
            str(port),
            str(model_dir),
        ]
        with server(cmd, {"HF_HUB_OFFLINE": "1"}, "/health", port, timeout_s=600) as base:
            print("transformers serve --continuous-batching (same weights, float32)", flush=True)
            result["transformers"] = run_levels(base, str(model_dir), args)

    result["loadavg_after"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "http_load.json").write_text(json.dumps(result, indent=2, default=str))
    print(table(result))
    return 0


def reference_dir() -> Path:
    """The default model as a Hugging Face directory for `transformers serve` (its GGUF path needs
    `architectures`, which the file lacks, and transformers will not save a GGUF-loaded model).
    Written once from our GGUF loader, whose tensors equal transformers' dequantization exactly."""
    from ballast.models.weights.default_model import default_model_path
    from ballast.models.weights.gguf_loader import load_gguf
    from safetensors.torch import save_file

    gguf = default_model_path()
    out = gguf.parent / "hf-reference"
    if not (out / "model.safetensors").exists():
        model = load_gguf(gguf)
        out.mkdir(exist_ok=True)
        config = {**model.config, "architectures": ["LlamaForCausalLM"], "torch_dtype": "float32"}
        (out / "config.json").write_text(json.dumps(config, indent=2))
        model.tokenizer.save_pretrained(out)
        save_file({k: v.contiguous() for k, v in model.tensors.items()}, str(out / "model.safetensors"))
    return out


def table(result: dict[str, object]) -> str:
    lines = [
        "",
        "| server | concurrency | tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | completed | dropped |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("ballast", "transformers"):
        for row in result.get(name, []):  # type: ignore[attr-defined]
            lines.append(
                f"| {name} | {row['concurrency']} | {row['tok_s']:.1f} | {row['ttft_p50_s']:.2f} / "
                f"{row['ttft_p99_s']:.2f} "
                f"| {row['itl_p50_ms']:.0f} / {row['itl_p99_ms']:.0f} | {row['completed']} | "
                f"{row['dropped']} |"
            )
    refusals = result.get("ballast_time_to_503")
    if isinstance(refusals, dict):
        lines.append(
            f"\ntime to 503 at CRITICAL: p50 {refusals['p50_ms']:.2f} ms, p99 {refusals['p99_ms']:.2f} ms "
            f"over {refusals['requests']} requests ({refusals['statuses']})"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
