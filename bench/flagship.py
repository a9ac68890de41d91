"""The flagship's aims table in one call: one `ballast serve` of Qwen3-Next-80B-A3B FP8 (random
weights of the real shapes, builtin:qwen3-next-80b-a3b-fp8) measured over HTTP row by row, then
(where the deadline leaves room) the engine's prefill with the FP8 x FP8 experts off and on in one
process, and a second server start with the prompt budget (--max-itl-ms) for the 32 / 128 rows.

    python -m ballast.bench.flagship [--model builtin:qwen3-next-80b-a3b-fp8] [--deadline-s 540]
        [--budget-ms 60] [--prefill-lengths 1000 8000] [--rows first one peer 32 128]
    python -m ballast.bench.flagship --model builtin:tiny-qwen3-next --device cpu --tiny   # plumbing

Rows, in this order, on ONE server (streaming chat through the official client; a prompt of ~N
tokens has different words per request, so no two share more than the chat template):
- first: the first request after /ready of a prompt length not served before (~1k tokens, then
  ~3k) against a request of the same length sent right after (warm): TTFT of each (the aim: no
  compile after /ready, within 20%).
- one: 1 stream, ~1k-token prompts, 128 new tokens: TTFT, ITL (aims <= 200 ms, <= 4.3 ms).
- peer: the published peer's workload, 10 streams, 1k prompts, 1,024 new tokens (aim >= 1,300 tok/s;
  the peer 852.6 on one H200).
- 32, 128: N streams, ~1k-token prompts, 128 new tokens, temperature 0.7 (aims >= 1,600 tok/s with
  TTFT p99 <= 2 s and ITL p99 <= 60 ms; >= 2,400 tok/s with TTFT p99 <= 6 s), with % of the
  issue's throughput bound (3,400 tok/s at 32 streams, 6,300 at 128).
Then `prefill_ab` (bench/fp8_prefill's engine path: the issue's unresolved 1k regression) and the
budgeted server, each only if the time left before --deadline-s holds its estimate. The JSON is
rewritten after every row (a run cut short keeps what it measured). Table on stdout, JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from ballast.bench.checkpoint_dir import write_tokenizer
from ballast.bench.gpu_serve import load, prompt_text
from ballast.bench.http_load import free_port, one_stream, serve_command, server
from openai import AsyncOpenAI, NotFoundError

RESULTS = Path(__file__).parent / "results" / "flagship.json"
# The throughput bound per stream count (prefill at the FP8 peak plus decode steps at
# their expert bytes) and the aims (tok/s, TTFT p99 s, ITL p99 ms; None: no aim on it)
BOUND = {32: 3400.0, 128: 6300.0}
AIMS = {
    "one": (230.0, 0.2, 4.3),
    "peer": (1300.0, None, None),
    "32": (1600.0, 2.0, 60.0),
    "128": (2400.0, 6.0, None),
}
# the 6.2B cut's (26 experts): 128 streams >= 3,500 tok/s with TTFT p99 <= 4 s (no bound stated)
AIMS_6B = {"128": (3500.0, 4.0, None)}
# (streams, new tokens, requests) of each load row; 6.2B cut: 128 streams only (--rows 128)
LOADS = {"one": (1, 128, 4), "peer": (10, 1024, 10), "32": (32, 128, 64), "128": (128, 128, 128)}
PHASE_S = {"prefill_ab": 120.0, "budget": 150.0}  # what a later phase is planned to take (80B)
ROW_S = {"first": 15.0, "one": 10.0, "peer": 30.0, "32": 25.0, "128": 45.0}  # and each row


class Run:
    """The result so far, written to --out after every row."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = time.monotonic()
        self.result: dict[str, Any] = {
            "bench": "flagship",
            "model": args.model,
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "rows": [],
        }

    def left_s(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.started)

    def save(self) -> None:
        self.args.out.parent.mkdir(parents=True, exist_ok=True)
        self.args.out.write_text(json.dumps(self.result, indent=2, default=str) + "\n")

    def add(self, row: dict[str, Any]) -> None:
        self.result["rows"].append(row)
        self.save()
        print(line(row), flush=True)


def line(r: dict[str, Any]) -> str:
    if r["row"] == "first":
        return (
            f"  first request of ~{r['prompt_tokens']} tokens after /ready: TTFT "
            f"{1e3 * r['cold_ttft_s']:.0f} ms, warm {1e3 * r['warm_ttft_s']:.0f} ms "
            f"({r['cold_over_warm']:.2f}x)"
        )
    return (
        f"  {r['label']:>12}: {r['tok_s']:8.1f} tok/s  TTFT p50/p99 {r['ttft_p50_s']:.3f}/"
        f"{r['ttft_p99_s']:.3f} s  "
        f"ITL p50/p99 {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms  dropped {r['dropped']} {r['errors']}"
    )


async def warm_client(client: AsyncOpenAI) -> None:
    """The client's own first-call costs (lazy imports, the connection: ~0.6 s measured on the CPU,
    most of a tiny model's first TTFT) spent on calls the engine never sees: a model list, and a
    streaming chat the server refuses (404, no such model)."""
    await client.models.list()
    try:
        stream = await client.chat.completions.create(
            model="no-such-model", stream=True, max_tokens=1, messages=[{"role": "user", "content": "x"}]
        )
        async for _ in stream:
            pass
    except NotFoundError:
        pass


async def first_request(base: str, model: str, tokens: int, temperature: float, warm: int) -> dict[str, Any]:
    """TTFT of the first request of ~`tokens` prompt tokens, then of `warm` more of that length
    (other words: no prefix hit), one at a time."""
    client = AsyncOpenAI(base_url=base + "/v1", api_key="bench", timeout=1800, max_retries=0)
    await warm_client(client)
    seed = 10_000 + tokens
    outs = []
    for i in range(1 + warm):
        outs.append(await one_stream(client, model, prompt_text(seed + i, tokens), 8, temperature))
    await client.close()
    errors = sorted({o.error for o in outs if o.error})
    cold, rest = outs[0].ttft_s, [o.ttft_s for o in outs[1:]]
    warm_s = statistics.median(rest) if rest else float("nan")
    return {
        "row": "first",
        "prompt_tokens": tokens,
        "cold_ttft_s": cold,
        "warm_ttft_s": warm_s,
        "warm_all_s": rest,
        "cold_over_warm": cold / warm_s if warm_s > 0 else float("nan"),
        "errors": errors,
    }


def load_row(base: str, model: str, key: str, args: argparse.Namespace, label: str) -> dict[str, Any]:
    streams, new, requests = LOADS[key]
    if args.tiny:  # the plumbing on the CPU: the same rows, a few tokens each
        streams, new, requests = min(streams, 4), min(new, 8), min(requests, 4)
    ns = argparse.Namespace(prompt_tokens=args.prompt_tokens, new_tokens=new, temperature=args.temperature)
    row = asyncio.run(load(base, model, streams, requests, ns))
    row.update(row=key, label=label, new_tokens=new)
    bound = None if cut(args.model) else BOUND.get(streams)
    row["pct_of_bound"] = 100 * row["tok_s"] / bound if bound else None
    return row


def cut(model: str) -> bool:
    """The 6.2B cut (qwen3-next-6b*) rather than the 80B: its own aims, no stated bound."""
    return "qwen3-next-6b" in model


def serve(args: argparse.Namespace, run: Run, rows: list[str], label: str, extra: list[str]) -> None:
    """One server start, the rows on it; its time to /ready in the result."""
    port = free_port()
    max_seqs = 4 if args.tiny else 128
    cmd = serve_command(args.model, port, "--max-num-seqs", str(max_seqs), "--max-queue", "4096")
    # info: start-up's lines (the load, the graphs, the warm-up's steps and time) in the server's log
    cmd += ["--device", args.device, "--max-model-len", str(args.max_model_len), "--log-level", "info"]
    cmd += extra
    if args.tokenizer is not None:
        cmd += ["--tokenizer", str(args.tokenizer)]
    log = args.out.parent / f"flagship_{label}_server.log"
    t = time.monotonic()
    with server(cmd, {}, "/ready", port, timeout_s=max(60.0, run.left_s()), log_path=log) as base:
        ready = time.monotonic() - t
        run.result.setdefault("ready_s", {})[label] = ready
        run.save()
        served = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        print(f"ballast serve {' '.join(cmd[4:])}: ready in {ready:.1f} s", flush=True)
        run.result.setdefault("startup", {})[label] = startup_lines(log)
        run.save()
        for key in rows:
            if run.left_s() < (0.1 if args.tiny else 1.0) * ROW_S[key]:
                run.result.setdefault("skipped", []).append(f"{key} ({label}): {run.left_s():.0f} s left")
                run.save()
                continue
            if key == "first":
                for n in args.first_lengths:
                    run.add(asyncio.run(first_request(base, served, n, args.temperature, args.warm_repeats)))
            else:
                run.add(load_row(base, served, key, args, key if label == "default" else f"{key}, {label}"))


def startup_lines(log: Path) -> list[str]:
    """The server log's lines on what start-up did: the load, the graphs, the warm-up's steps."""
    keep = ("warm-up:", "graphs:", "ballast.engine.engine: engine:", "load estimate", "ready: serving")
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return [line[-300:] for line in lines if any(k in line for k in keep)][-8:]


def prefill_ab(args: argparse.Namespace) -> dict[str, Any]:
    """The engine's prefill of one prompt per length with the FP8 x FP8 experts off and on, in one
    process, alternating the sides `--ab-rounds` times: per side and length, the median of
    `--ab-repeats` timed prefills after one warm-up, and the kernels one prefill launches (from
    the profiler: more launches per layer would show there)."""
    from ballast.bench.paged_decode import free_device_memory, prefill, random_prompts
    from ballast.engine.config import EngineConfig, PrefixCacheConfig
    from ballast.engine.engine import Engine
    from ballast.engine.plan import StepPlan
    from ballast.models.arch.builtin import builtin_config
    from ballast.models.kernels import w8a8_triton

    name = args.model.removeprefix("builtin:")
    vocab = int(builtin_config(name)["vocab_size"])
    chunk = max(args.prefill_lengths)
    t = time.perf_counter()
    engine = Engine.load(  # eager steps (the switch takes effect at once); no prefix cache
        EngineConfig(model=args.model, device=args.device, max_num_seqs=1, cuda_graphs=False,
                     max_model_len=chunk + 16, prefill_chunk_tokens=chunk),
        prefix_cache=PrefixCacheConfig(fraction=0.0),
    )  # fmt: skip
    out: dict[str, Any] = {"load_s": time.perf_counter() - t, "from_rows": w8a8_triton.FROM_ROWS}
    release = StepPlan(release=(0,))
    cuda = args.device.startswith("cuda")

    def once(ids: torch.Tensor) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        prefill(engine, ids, chunk)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        engine.submit(release).result()
        return wall

    try:
        for r in range(args.ab_rounds):
            for side in ("off", "on"):
                w8a8_triton.ENABLED = side == "on"
                for n in args.prefill_lengths:
                    once(random_prompts(1, n, vocab, seed=-n))  # warm-up of this side and length
                    times = [once(random_prompts(1, n, vocab, seed=n + i)) for i in range(args.ab_repeats)]
                    entry = out.setdefault(side, {}).setdefault(str(n), {"ms": []})
                    entry["ms"] += [1e3 * x for x in times]
                    if r == 0:
                        ids = random_prompts(1, n, vocab, seed=7)
                        entry["profile"] = kernel_count(lambda ids=ids: once(ids), cuda)
        for side in ("off", "on"):
            for n, entry in out[side].items():
                entry["median_ms"] = statistics.median(entry["ms"])
                entry["tok_s"] = int(n) / (entry["median_ms"] / 1e3)
                print(f"  prefill {n} tokens, FP8 x FP8 experts {side}: {ab_line(entry)}", flush=True)
    finally:
        w8a8_triton.ENABLED = True
        engine.shutdown()
        free_device_memory()
    return out


def kernel_count(fn: Any, cuda: bool) -> dict[str, Any]:
    """The CUDA kernels one call of fn launches (torch's profiler): how many, their summed GPU time
    (against the wall: host-bound where the wall is much longer) and the five longest by name. On
    the CPU (the plumbing's check) the same over the CPU ops."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            fn()
        kernels = [e for e in prof.events() if e.device_type.name == ("CUDA" if cuda else "CPU")]
        by_name: dict[str, float] = {}
        for e in kernels:
            by_name[e.name[:60]] = by_name.get(e.name[:60], 0.0) + e.time_range.elapsed_us() / 1e3
    except Exception as e:  # noqa: BLE001 - the timings stand without their profile
        return {"error": repr(e)[:200]}
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
    top_ms = {k: round(v, 2) for k, v in top}
    return {"count": len(kernels), "gpu_ms": sum(by_name.values()), "top_ms": top_ms}


def ab_line(entry: dict[str, Any]) -> str:
    prof = entry.get("profile") or {}
    kernels = f"{prof['count']} kernels, {prof['gpu_ms']:.1f} ms GPU" if "count" in prof else str(prof)
    return (
        f"median {entry['median_ms']:.1f} ms of {len(entry['ms'])} ({entry['tok_s']:,.0f} tok/s; "
        f"{kernels}) {prof.get('top_ms', '')}"
    )


def table(result: dict[str, Any]) -> str:
    lines = [
        f"\n{result['model']} on {result['device']}; ready in "
        + ", ".join(f"{k} {v:.1f} s" for k, v in result.get("ready_s", {}).items()),
        "| row | tok/s | % of bound | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
        "aim (tok/s, TTFT p99 s, ITL p99 ms) | done |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        if r["row"] == "first":
            lines.append(
                f"| first request, ~{r['prompt_tokens']} tokens | | | cold {1e3 * r['cold_ttft_s']:.0f} / "
                f"warm {1e3 * r['warm_ttft_s']:.0f} ({r['cold_over_warm']:.2f}x) | | <= 1.2x warm | "
                f"{not r['errors']} |"
            )
            continue
        pct = "" if r.get("pct_of_bound") is None else f"{r['pct_of_bound']:.0f}%"
        aim = (AIMS_6B if cut(result["model"]) else AIMS).get(r["row"], ())
        lines.append(
            f"| {r['label']} ({r['streams']} streams, {r['new_tokens']} new) | {r['tok_s']:.1f} | {pct} | "
            f"{1e3 * r['ttft_p50_s']:.0f} / {1e3 * r['ttft_p99_s']:.0f} | {r['itl_p50_ms']:.1f} / "
            f"{r['itl_p99_ms']:.1f} | {', '.join('-' if a is None else f'{a:g}' for a in aim)} | "
            f"{r['completed']}/{r['requests']} |"
        )
    for label, found in result.get("startup", {}).items():
        lines += [f"start-up ({label}): {line}" for line in found if "warm-up:" in line][-1:]
    if result.get("skipped"):
        lines.append(f"skipped before the deadline: {'; '.join(result['skipped'])}")
    ab = result.get("prefill_ab")
    if isinstance(ab, dict) and "off" in ab:
        for n in ab["off"]:
            off, on = ab["off"][n], ab["on"][n]
            lines.append(f"engine prefill, {n} tokens, FP8 x FP8 experts off: {ab_line(off)}")
            lines.append(f"engine prefill, {n} tokens, FP8 x FP8 experts on: {ab_line(on)}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="builtin:qwen3-next-80b-a3b-fp8")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokenizer", type=Path, help="default: the committed SmolLM2 tokenizer, written here")
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/ballast-bench-models"))
    ap.add_argument("--rows", nargs="+", default=["first", "one", "peer", "32", "128"],
                    choices=["first", *LOADS])  # fmt: skip
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--first-lengths", type=int, nargs="+", default=[1000, 3000])
    ap.add_argument("--warm-repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--server-args", default="", help="more `ballast serve` flags for every start")
    ap.add_argument("--budget-ms", type=float, default=60.0, help="the second start's --max-itl-ms (0: none)")
    ap.add_argument("--budget-rows", nargs="*", default=["32", "128"], choices=list(LOADS))
    ap.add_argument("--prefill-lengths", type=int, nargs="*", default=[1000, 8000], help="none: no A/B")
    ap.add_argument("--ab-rounds", type=int, default=2)
    ap.add_argument("--ab-repeats", type=int, default=3)
    ap.add_argument("--deadline-s", type=float, default=540.0, help="later phases start only within it")
    ap.add_argument("--tiny", action="store_true", help="a few tokens a row (the plumbing, on the CPU)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.tokenizer is None and args.model.startswith("builtin:"):
        args.tokenizer = args.work_dir / "smollm2-tokenizer"
        args.tokenizer.mkdir(parents=True, exist_ok=True)
        write_tokenizer(args.tokenizer)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    extra = args.server_args.split()
    try:
        serve(args, run, args.rows, "default", extra)
        scale = 0.1 if args.tiny else 1.0
        if args.prefill_lengths and run.left_s() > scale * PHASE_S["prefill_ab"]:
            try:
                run.result["prefill_ab"] = prefill_ab(args)
            except Exception as e:  # noqa: BLE001 - the rows stand, and the budgeted start may still run
                run.result["prefill_ab"] = {"error": repr(e)[:300]}
            run.save()
        elif args.prefill_lengths:
            run.result.setdefault("skipped", []).append(f"the prefill A/B: {run.left_s():.0f} s left")
        if args.budget_ms > 0 and args.budget_rows and run.left_s() > scale * PHASE_S["budget"]:
            label = f"itl{args.budget_ms:g}ms"
            serve(args, run, args.budget_rows, label, [*extra, "--max-itl-ms", str(args.budget_ms)])
        elif args.budget_ms > 0:
            run.result.setdefault("skipped", []).append(f"the --max-itl-ms start: {run.left_s():.0f} s left")
    finally:
        run.result["wall_s"] = time.monotonic() - run.started
        run.save()
        print(table(run.result))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
