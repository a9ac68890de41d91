"""Where a decode step's time goes: the torch profiler over a few decode steps of every slot, per
built-in model, with the step's wall time beside the GPU time of its kernels.

    python -m ballast.bench.decode_profile [--models llama-8b qwen3-next-80b-a3b-fp8]
        [--batch 1 32] [--context 2048] [--steps 4] [--device cuda]
    python -m ballast.bench.decode_profile --prefill 1024 --batch 1 --models llama-8b   # a TTFT's prefill
    python -m ballast.bench.decode_profile --mixed 128 --models llama-8b   # decodes beside a new prompt
    python -m ballast.bench.decode_profile --models qwen3-next-6b --no-eager --moe-kernel grouped fused
    python -m ballast.bench.decode_profile --prefill 1000 --chunk 1024 --models qwen3-next-6b-fp8 \
        --fp8-activations off on   # FP8 prefill: weight-only against FP8 x FP8

Each model is loaded through `Engine.load`, every slot is prefilled to --context, warmed up, then
--steps decode steps run under `torch.profiler` twice: with the engine's CUDA graphs (what the
server runs: the kernel list as the graph replays it) and eagerly (cuda_graphs off: the same
kernels, each launched from Python, so the gap between wall and GPU time is the host's share).
Per mode: wall ms a step, GPU-busy ms a step (kernel time summed), kernels a step, and the top
kernels by time. Table on stdout, JSON to bench/results/decode_profile.json.

`--prefill N` profiles prefill instead: --steps times, --batch fresh prompts of N tokens each go
through the engine in steps of at most --chunk tokens, as the scheduler feeds a new request, and
are released; wall is the time to every first token (an idle server's TTFT less tokenizing and
HTTP), with the model's FLOPs beside the dense bf16 peak (--peak-tflops, the H200's 989). Two
modes as for decode: an engine with graphs (a lone prompt's chunk then replays a prefill graph
where the model allows, `engine/prefill_graphs`) and one without (--no-eager: the first only).

`--mixed N` profiles decode steps that each carry a new N-token prompt beside the --batch decodes
(a request arriving at a busy server), on an engine with decode and prefill graphs (such a step may
replay a prefill graph and a decode graph; the line says how many did) and on one with decode
graphs only (the step runs eagerly).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ballast.bench.paged_decode import free_device_memory, prefill, random_prompts, read_model, sync
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.models.arch.builtin import builtin_config
from ballast.models.kernels import moe_experts_triton, w8a8_triton
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile

RESULTS = Path(__file__).parent / "results" / "decode_profile.json"
GREEDY = SamplingParams(temperature=0.0)
WARMUP = 3


def profile_steps(
    engine: Engine, batch: int, context: int, steps: int, vocab: int, mixed: int = 0
) -> dict[str, Any]:
    """Prefill `batch` slots to `context`, warm up, profile `steps` decode steps; release.
    mixed > 0: every step also carries a new prompt of that many tokens in slot `batch` (released
    after it), as a step does when a request arrives while others decode: eagerly, or as a prefill
    graph's replay and a decode graph's where the engine judges that pays (`split_replays`)."""
    device = torch.device(engine.device)
    last = prefill(engine, random_prompts(batch, context, vocab, seed=batch), 4096)
    sampling = dict.fromkeys(range(batch + (mixed > 0)), GREEDY)
    prompts = iter(random_prompts(WARMUP + 2 * steps, max(mixed, 1), vocab, seed=-1).tolist())
    pos = context

    def step() -> None:
        nonlocal pos
        chunk = (PrefillChunk(batch, tuple(next(prompts)), 0, True),) if mixed else ()
        decodes = tuple(DecodeToken(s, last[s], pos) for s in range(batch))
        result = engine.submit(StepPlan(prefills=chunk, decodes=decodes, sampling=sampling)).result()
        for out in result.outputs:
            if out.slot < batch:
                last[out.slot] = out.token_id
        if mixed:
            engine.submit(StepPlan(release=(batch,))).result()
        pos += 1

    for _ in range(WARMUP):
        step()
    split_before = engine.runner.graph_runner.split_replays
    result = _timed(step, steps, device)
    result["split_replays"] = engine.runner.graph_runner.split_replays - split_before
    result["mixed_steps"] = 2 * steps  # _timed runs them twice: unprofiled, then profiled
    engine.submit(StepPlan(release=tuple(range(batch)))).result()
    return result


TOP_KERNELS = 40  # kernels kept per mode: the hybrid step's tail of small kernels is the target


def _tables(prof: profile, wall: float, steps: int) -> dict[str, Any]:
    """Wall (as profiled), GPU-busy time and kernel count per step, the top kernels and the top host ops."""
    kernels: dict[str, list[float]] = {}  # name -> [count, microseconds]
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(evt.name, [0, 0.0])
            k[0] += 1
            k[1] += evt.device_time
    busy_us = sum(v[1] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    # The host's side: where a step's CPU time goes (self time of each op, every thread, the
    # engine's included), which is what an eager step waits on.
    host = sorted(
        (e for e in prof.key_averages() if e.self_cpu_time_total > 0), key=lambda e: -e.self_cpu_time_total
    )
    return {
        "wall_ms": wall * 1e3,
        "gpu_busy_ms": busy_us / steps / 1e3,
        "kernels_per_step": sum(v[0] for v in kernels.values()) / steps,
        "top": [
            {
                "kernel": name[:90],
                "per_step": n / steps,
                "ms_per_step": us / steps / 1e3,
                "pct": 100 * us / busy_us,
            }
            for name, (n, us) in top[:TOP_KERNELS]
        ]
        if busy_us
        else [],
        "host_top": [
            {
                "op": e.key[:90],
                "per_step": e.count / steps,
                "self_cpu_ms_per_step": e.self_cpu_time_total / steps / 1e3,
            }
            for e in host[:15]
        ],
    }


def profile_prefills(
    engine: Engine, batch: int, tokens: int, chunk: int, steps: int, vocab: int
) -> dict[str, Any]:
    """Prefill `batch` fresh prompts of `tokens` tokens `steps` times (after one warm-up) under the
    profiler, releasing the slots after each; the same figures as `profile_steps`, per prefill."""
    device = torch.device(engine.device)
    release = StepPlan(release=tuple(range(batch)))

    def once(seed: int) -> None:
        prefill(engine, random_prompts(batch, tokens, vocab, seed=seed), chunk)
        engine.submit(release).result()

    seeds = iter(range(1 << 30))
    once(next(seeds))
    return _timed(lambda: once(next(seeds)), steps, device)


def _timed(fn: Callable[[], None], steps: int, device: torch.device) -> dict[str, Any]:
    """`fn` run `steps` times unprofiled (wall_ms: the profiler's own cost per op is not small),
    then `steps` times under the profiler (the tables, profiled_wall_ms); per run."""
    sync(device)
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    wall = (time.perf_counter() - t) / steps
    with profile(activities=_activities(device), experimental_config=_all_threads()) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        sync(device)
        profiled = (time.perf_counter() - t) / steps
    return {**_tables(prof, profiled, steps), "profiled_wall_ms": profiled * 1e3, "wall_ms": wall * 1e3}


def _activities(device: torch.device) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def _all_threads() -> Any:
    """Profile CPU ops on every thread (the engine runs steps on its own), where this torch can."""
    try:
        return _ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # an older torch: the calling thread only (the host table then stays empty)
        return None


def bench(name: str, args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    """Profile `name`: decode with graphs, then eagerly (one engine each), or prefill in each
    --chunk size (one engine); its entry is in `results` (and the JSON) after each mode, so a run
    cut short keeps what it measured."""
    cfg = builtin_config(name)
    # one entry per batch size: each engine serves them all in turn (one load, not one a batch)
    outs: dict[int, dict[str, Any]] = {}
    for batch in args.batch:
        out = outs[batch] = {"model": name, "batch": batch, "compile": args.compile}
        out.update({"prefill_tokens": args.prefill} if args.prefill else {"context": args.context})
        results.append(out)
    # (decode graphs, prefill graphs) per engine: both, and neither (eager); for --mixed both, and
    # decode graphs alone (its mixed steps run eagerly; the first's may replay the two graphs).
    arms = [(True, True), (True, False) if args.mixed else (False, False)][: 1 if args.no_eager else 2]
    ways = [(a, k, f) for a in arms for k in args.moe_kernel for f in args.fp8_activations]
    for (graphs, prefill_graphs), kernel, fp8_act in ways:
        moe_experts_triton.FUSED_EXPERTS = kernel == "fused"
        w8a8_triton.ENABLED = fp8_act == "on"
        suffix = f", {kernel} experts" if args.moe_kernel != ["grouped"] else ""
        suffix += f", FP8 x FP8 {fp8_act}" if len(args.fp8_activations) > 1 else ""
        engine = Engine.load(
            EngineConfig(
                model="builtin:" + name,
                device=args.device,
                max_num_seqs=max(args.batch) + (args.mixed > 0),
                max_model_len=max(args.prefill, args.context + WARMUP + 2 * args.steps) + 16,
                prefill_chunk_tokens=max(args.chunk) if args.prefill else 4096,
                cuda_graphs=graphs and args.device == "cuda",
                prefill_graphs=prefill_graphs,
                compile=args.compile,
            )
        )
        try:
            for batch, out in outs.items():
                profile_batch(engine, name, cfg, args, batch, graphs, suffix, out, results)
        finally:
            engine.shutdown()
            del engine
            free_device_memory()


def profile_batch(
    engine: Engine,
    name: str,
    cfg: dict[str, Any],
    args: argparse.Namespace,
    batch: int,
    graphs: bool,
    suffix: str,
    out: dict[str, Any],
    results: list[dict[str, Any]],
) -> None:
    """One engine's modes at one batch size into `out` (prefill: one per --chunk)."""
    vocab = int(cfg["vocab_size"])
    if args.prefill:
        flops = 2 * active_parameters(engine, cfg) * batch * args.prefill
        for chunk in args.chunk:
            with_graph = graphs and engine.runner.graph_runner.prefill_graphs is not None
            mode = f"prefill in chunks of {chunk}, {'prefill graphs' if with_graph else 'eager'}{suffix}"
            if mode in out:  # no prefill graph on either engine (the CPU, a hybrid model)
                continue
            r = out[mode] = profile_prefills(engine, batch, args.prefill, chunk, args.steps, vocab)
            r["pct_of_peak"] = 100 * flops / (r["wall_ms"] * 1e-3) / (args.peak_tflops * 1e12)
            report(args, results, out, mode)
        return
    if args.mixed:
        split = engine.runner.graph_runner.prefill_graphs is not None
        mode = f"decode + {args.mixed}-token prefill, {'prefill graphs' if split else 'eager'}"
    else:
        mode = "graphs" if graphs else "eager"
    mode += suffix
    if mode in out:  # no prefill graph on either engine (the CPU, a hybrid model)
        return
    out[mode] = profile_steps(engine, batch, args.context, args.steps, vocab, args.mixed)
    report(args, results, out, mode)


def report(args: argparse.Namespace, results: list[dict[str, Any]], out: dict[str, Any], mode: str) -> None:
    r = out[mode]
    name = f"{out['model']} batch {out['batch']}"
    write(args, results)
    print(
        f"{name} {mode}: {r['wall_ms']:.2f} ms wall ({r['profiled_wall_ms']:.2f} profiled), "
        f"{r['gpu_busy_ms']:.2f} ms GPU busy, {r['kernels_per_step']:.0f} kernels"
        + (
            f", {r['split_replays']} of {r['mixed_steps']} as two graphs' replays"
            if "split_replays" in r
            else ""
        ),
        flush=True,
    )


def active_parameters(engine: Engine, cfg: dict[str, Any]) -> float:
    """Parameters one token multiplies through (the embedding table is a lookup; an MoE layer
    counts its top-k experts), from the bytes held over the model's element size."""
    rm = read_model(engine, cfg)
    dense = rm.weights_bytes - rm.embed_bytes - rm.moe_layers * rm.experts * rm.expert_bytes
    active = dense + rm.moe_layers * rm.top_k * rm.expert_bytes
    return active / engine.runner.model.model.embed_tokens.weight.element_size()


def write(args: argparse.Namespace, results: list[dict[str, Any]]) -> None:
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": _gpu(args.device), "results": results}, indent=2) + "\n")


def print_table(results: list[dict[str, Any]]) -> None:
    for r in results:
        for mode, m in ((k, v) for k, v in r.items() if isinstance(v, dict)):
            if "prefill_tokens" in r:
                what = (
                    f"{mode}, {r['prefill_tokens']} tokens: {m['wall_ms']:.2f} ms to the first tokens "
                    f"({m['pct_of_peak']:.0f}% of the bf16 peak)"
                )
            else:
                what = f"context {r['context']}, {mode}: {m['wall_ms']:.2f} ms a step"
            print(
                f"\n{r['model']} (compile {r['compile']}), batch {r['batch']}, {what}; profiled "
                f"{m['profiled_wall_ms']:.2f} ms wall, {m['gpu_busy_ms']:.2f} ms GPU busy "
                f"({100 * m['gpu_busy_ms'] / m['profiled_wall_ms']:.0f}%), "
                f"{m['kernels_per_step']:.0f} kernels"
            )
            print("| kernel | per step | ms a step | % of GPU time |\n|---|---|---|---|")
            for k in m["top"]:
                print(f"| `{k['kernel']}` | {k['per_step']:.0f} | {k['ms_per_step']:.3f} | {k['pct']:.1f} |")
            print("| host op (self CPU time) | per step | ms a step |\n|---|---|---|")
            for h in m["host_top"]:
                print(f"| `{h['op']}` | {h['per_step']:.0f} | {h['self_cpu_ms_per_step']:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=["llama-8b", "qwen3-next-80b-a3b-fp8"])
    ap.add_argument("--batch", type=int, nargs="+", default=[32], help="batch sizes, on one engine each")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prefill", type=int, default=0, help="profile prefills of this many tokens instead")
    ap.add_argument(
        "--chunk", type=int, nargs="+", default=[512], help="prefill tokens a step, each in turn (--prefill)"
    )
    ap.add_argument(
        "--mixed", type=int, default=0, help="each decode step also prefills a new prompt of N tokens"
    )
    ap.add_argument("--no-eager", action="store_true", help="decode with the engine's graphs only")
    ap.add_argument(
        "--moe-kernel",
        nargs="+",
        choices=["grouped", "fused"],
        default=["grouped"],
        help="MoE expert kernels, each in turn: torch's grouped GEMM, or moe_experts_triton.experts_mlp",
    )
    ap.add_argument(
        "--fp8-activations",
        nargs="+",
        choices=["on", "off"],
        default=["on"],
        help="FP8 linears and experts at prefill sizes: FP8 x FP8 (w8a8_triton) or weight-only, each in turn",
    )
    ap.add_argument("--compile", type=lambda v: v.lower() in ("1", "true", "yes"), default=True)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (--prefill)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    for name in args.models:
        bench(name, args, results)
    print_table(results)


def _gpu(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" and torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
