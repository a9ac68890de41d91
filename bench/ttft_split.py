"""Where an idle server's time to first token goes: timestamps along one request's path, with the
prefill graphs on and off.

    python -m ballast.bench.ttft_split [--model DIR | --shape llama-3b] [--requests 20]
    python -m ballast.bench.ttft_split --shape tiny-llama --device cpu --arms on   # the plumbing

Per arm (`--prefill-graphs true` / `false`), `ballast serve` runs in a child process started
through this module (`--serve-probed FILE`), which wraps the functions that mark a request's path
and writes their timestamps to FILE when the server exits: the HTTP protocol receiving bytes, the
chat handler's template and tokenizing (`chat_built`), the engine thread's `launch` and `finish` of
a step, the scheduler's `_apply` of a result, the request's mailbox receiving its first token, and
the ASGI `send` of the response. The client is the official openai client, one stream: after
--warmup requests, --requests streaming chats, each a new ~--prompt-tokens-token message (no two
prompts share more than the template's system prompt), 4 new tokens, greedy, 0.3 s apart (an
idle server each time). Both sides stamp with time.perf_counter (CLOCK_MONOTONIC: one clock for
every process of the host), so the server's marks fall between the client's send and its first
content chunk. Segments, median over requests:

- client to server: the openai client building and sending the request, until uvicorn reads it;
- HTTP to handler: parsing, validation, up to `chat_built`;
- template + tokenize: `chat_built` (a worker thread);
- to the engine: submitting, scheduling, until the engine thread starts launching the step;
- prefill launch (host): the engine thread launching the prompt's step (eager: every kernel;
  graph: staging the inputs and one replay); the first step, where a prompt takes more than one
  (the CPU's 512-token chunk);
- to the token: after the launch until the token reaches the request's mailbox (the GPU finishing
  the step, the token's copy, the next step's launch where it went first, the scheduler's apply);
- to the write: the handler formatting the chunk until the ASGI send;
- to the client: the chunk through the socket and the client's parsing.

Table on stdout, JSON to bench/results/ttft_split.json.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from ballast.bench.gpu_prefix import ensure_dir
from ballast.bench.gpu_serve import prompt_text
from ballast.bench.http_load import free_port, serve_command, server

RESULTS = Path(__file__).parent / "results" / "ttft_split.json"
SEGMENTS = (
    "client to server",
    "HTTP to handler",
    "template + tokenize",
    "to the engine",
    "prefill launch (host)",
    "to the token",
    "to the write",
    "to the client",
)

# --- the server side: marks along the path ------------------------------------------------------

_marks: list[tuple[float, str]] = []


def _wrap(owner: Any, name: str, mark: str, after: bool = False) -> None:
    """Stamp `mark>` when owner.name is called (and `mark<` when it returns, where `after`)."""
    fn = getattr(owner, name)
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def stamped_async(*a: Any, **k: Any) -> Any:
            _marks.append((time.perf_counter(), mark + ">"))
            return await fn(*a, **k)

        setattr(owner, name, stamped_async)
        return

    @functools.wraps(fn)
    def stamped(*a: Any, **k: Any) -> Any:
        _marks.append((time.perf_counter(), mark + ">"))
        out = fn(*a, **k)
        if after:
            _marks.append((time.perf_counter(), mark + "<"))
        return out

    setattr(owner, name, stamped)


def serve_probed(out: Path, argv: list[str]) -> int:
    """`ballast serve argv` with the path's functions stamped; the stamps go to `out` at exit."""
    try:
        import uvicorn.protocols.http.httptools_impl as http
    except ImportError:  # no httptools: uvicorn speaks HTTP through h11
        import uvicorn.protocols.http.h11_impl as http  # type: ignore[no-redef]
    import ballast.engine.engine as engine
    import ballast.scheduler.request as request
    import ballast.scheduler.scheduler as scheduler
    import ballast.server.completions as completions
    import uvicorn
    from ballast.server.cli import main as cli_main

    protocol = getattr(http, "HttpToolsProtocol", None) or http.H11Protocol  # type: ignore[attr-defined]
    _wrap(protocol, "data_received", "recv")
    _wrap(http.RequestResponseCycle, "send", "send")
    _wrap(completions, "chat_built", "chat_job", after=True)  # the prompt, in a worker thread
    _wrap(engine.Engine, "launch", "launch", after=True)
    _wrap(engine.Engine, "finish", "finish", after=True)
    _wrap(scheduler.Scheduler, "_apply", "apply", after=True)
    _wrap(request.Mailbox, "put", "mailbox")

    def dump() -> None:
        out.write_text("".join(f"{t:.7f} {m}\n" for t, m in _marks))

    # uvicorn re-raises a SIGTERM after its graceful shutdown, and the default action ends the
    # process without atexit: the stamps are written as the shutdown finishes.
    shutdown = uvicorn.Server.shutdown

    async def shutdown_then_dump(self: uvicorn.Server, *a: Any, **k: Any) -> None:
        try:
            await shutdown(self, *a, **k)
        finally:
            dump()

    uvicorn.Server.shutdown = shutdown_then_dump  # type: ignore[method-assign]
    atexit.register(dump)
    return cli_main(argv)


# --- the client side and the split -------------------------------------------------------------


def client(
    base: str, model: str, requests: int, warmup: int, prompt_tokens: int
) -> list[tuple[float, float]]:
    """(sent, first content chunk) per request, perf_counter seconds; warm-up requests left out."""
    from openai import OpenAI

    api = OpenAI(base_url=base + "/v1", api_key="none")
    rows = []
    for i in range(warmup + requests):
        time.sleep(0.3)  # idle between requests
        sent = time.perf_counter()
        first = None
        stream = api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt_text(10_000 + i, prompt_tokens)}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        if i >= warmup and first is not None:
            rows.append((sent, first))
    return rows


def split(marks: list[tuple[float, str]], rows: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Each request's segments (ms) from the marks inside its window."""
    out: dict[str, list[float]] = {s: [] for s in (*SEGMENTS, "total")}
    for sent, first in rows:
        seen: dict[str, float] = {}
        for t, m in marks:
            if sent <= t <= first:
                seen.setdefault(m, t)
        need = ("recv>", "chat_job>", "chat_job<", "launch>", "launch<", "mailbox>", "send>")
        if any(k not in seen for k in need):
            continue  # a mark outside the window (clock or ordering): not this request's path
        points = [sent, *(seen[k] for k in need), first]
        for name, a, b in zip(SEGMENTS, points[:-1], points[1:], strict=True):
            out[name].append(1e3 * (b - a))
        out["total"].append(1e3 * (first - sent))
    return out


def run_arm(model_dir: Path | str, prefill_graphs: str, args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    stamps = args.work_dir / f"ttft_split_marks_{prefill_graphs}.txt"
    stamps.unlink(missing_ok=True)
    cmd = serve_command(str(model_dir), port, "--device", args.device, "--prefill-graphs", prefill_graphs)
    if args.tokenizer is not None:
        cmd += ["--tokenizer", str(args.tokenizer)]
    head = [sys.executable, "-m", "ballast.bench.ttft_split", "--serve-probed", str(stamps), "--"]
    probed = head + cmd[cmd.index("serve") :]
    with server(probed, {}, "/ready", port, timeout_s=900) as base:
        import httpx

        served = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        rows = client(base, served, args.requests, args.warmup, args.prompt_tokens)
    for _ in range(100):  # the child writes its stamps as it exits
        if stamps.exists():
            break
        time.sleep(0.1)
    marks = [(float(t), m) for t, m in (line.split() for line in stamps.read_text().splitlines())]
    segments = split(marks, rows)
    return {
        "prefill_graphs": prefill_graphs,
        "requests": len(segments["total"]),
        "median_ms": {k: statistics.median(v) if v else None for k, v in segments.items()},
        "p90_ms": {k: _p90(v) for k, v in segments.items()},
        "per_request_ms": segments,
    }


def _p90(v: list[float]) -> float | None:
    return sorted(v)[max(0, int(0.9 * len(v)) - 1)] if v else None


def table(arms: list[dict[str, Any]]) -> str:
    def fmt(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    head = (
        "| segment (median ms) | " + " | ".join(f"prefill graphs {a['prefill_graphs']}" for a in arms) + " |"
    )
    lines = [head, "|---|" + "---|" * len(arms)]
    for name in (*SEGMENTS, "total"):
        cells = " | ".join(fmt(a["median_ms"][name]) for a in arms)
        lines.append(f"| {name} | {cells} |")
    lines.append("| total p90 | " + " | ".join(fmt(a["p90_ms"]["total"]) for a in arms) + " |")
    lines.append("| requests | " + " | ".join(str(a["requests"]) for a in arms) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-probed"]:
        sys.exit(serve_probed(Path(argv[1]), argv[3:] if argv[2:3] == ["--"] else argv[2:]))
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", help="a Hugging Face directory (default: write --shape's directory)")
    ap.add_argument("--tokenizer", type=Path, help="a Hugging Face tokenizer directory for ballast serve")
    ap.add_argument("--shape", default="llama-3b", help="bench/checkpoint_dir shape to write")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/ballast-bench-models"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--arms", nargs="+", choices=["on", "off"], default=["on", "off"])
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model_dir: Path | str = (
        Path(args.model) if args.model else ensure_dir(args.shape, args.work_dir, args.device)
    )
    arms = [run_arm(model_dir, {"on": "true", "off": "false"}[a], args) for a in args.arms]
    print(f"idle time to first token of a ~{args.prompt_tokens}-token prompt ({args.model or args.shape})")
    print(table(arms))
    result = {
        "bench": "ttft_split",
        "model": args.model or args.shape,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "prompt_tokens": args.prompt_tokens,
        "arms": arms,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
