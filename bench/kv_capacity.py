"""Capacity at one fixed memory budget: how many concurrent sequences of a realistic mix fit with
the paged KV pool against static slots (every slot holding max_model_len tokens of KV, as before
the pool).

The mix: prompts log-uniform in 100..4000 tokens (many short prompts, a long tail: closer to chat
and RAG traffic than a uniform spread, which --dist uniform gives) plus 256 new tokens, seeded.
Static slots reserve max_model_len = 4096 + 256 positions each.

(a) Analytic, for real shapes (costs from ballast's own layer specs, built on the meta device):
    Llama-3-8B (bf16), Qwen3-Next-80B-A3B (transformers' Qwen3NextConfig defaults, bf16 KV and
    conv state, float32 recurrent state) and SmolLM2-135M (the default model, float32 on CPU).
    static = floor(budget / (max_model_len x kv_bytes_per_token + state_per_slot));
    paged = how many requests of the mix, taken in order, fit when each costs
    ceil((prompt + 256) / 32) blocks of KV + its slot's recurrent state; "steady" = budget / mean
    cost over the whole mix.
(b) Measured on the CPU: the real Scheduler + Engine serve the mix (lengths scaled by --scale so
    the CPU can run it) under a MemWatch whose host tree (a temp dir) holds exactly the bytes of 4
    static slots of KV, plus one prefill chunk's activations (admission charges those too), less
    what the pool holds: the tree is rewritten as the pool grows and shrinks, as MemAvailable
    would move on a real host. The model is random-weight with SmolLM2-135M's KV per token (30
    layers x 3 KV heads x 64, float32) and narrow everywhere else, so the run is bound by memory,
    not by the CPU. A client resubmits requests the server refuses (HTTP 503 would carry
    Retry-After). Recorded: the peak of sequences running at once (scheduler.active_slots,
    sampled), the pool's peak bytes, preemptions, refusals; every request must complete.

    python -m ballast.bench.kv_capacity [--budgets-gib 16 64] [--requests 10000] [--dist log-uniform]
                                        [--measured-requests 64] [--scale 0.25] [--seed 0]

Table on stdout, JSON to bench/results/kv_capacity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from ballast.bench.http_load import write_meminfo
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.kv.blocks import blocks_for
from ballast.engine.plan import SamplingParams
from ballast.memory.config import MemoryConfig
from ballast.memory.device import StaticDeviceReader
from ballast.memory.specs import kv_bytes_per_token, state_bytes_per_slot
from ballast.memory.types import GiB, MiB
from ballast.memory.watch import MemWatch
from ballast.models.arch.builtin import init_random
from ballast.models.arch.registry import build_model
from ballast.models.kv_store import BLOCK_SIZE
from ballast.models.layers.state import dtype_bytes
from ballast.models.weights.default_model import default_model_path
from ballast.models.weights.gguf_loader import build_tokenizer, read_gguf
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.errors import Refused
from ballast.scheduler.request import FinishEvent, GenerationRequest
from ballast.scheduler.scheduler import Scheduler
from safetensors.torch import save_file

RESULTS = Path(__file__).parent / "results" / "kv_capacity.json"
PROMPT_MIN, PROMPT_MAX, NEW_TOKENS = 100, 4000, 256
MAX_MODEL_LEN = 4096 + NEW_TOKENS
# A window operators commonly configure (and the 64 x 8k case): static slots reserve it whole.
WIDE_MODEL_LEN = 8192
STATIC_SLOTS_MEASURED = 4
GREEDY = SamplingParams(temperature=0.0)

LLAMA3_8B: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
SMOLLM2_135M: dict[str, Any] = {  # as the default model's GGUF states it
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
}
# SmolLM2-135M's attention KV (30 layers x 3 KV heads x 64) on a model narrow everywhere else
# (hidden 96, 3 query heads), so a CPU serves the mix in seconds and memory, not compute, binds.
# 3 query heads also keep admission's activation charge (attention scores grow with query heads)
# small beside the KV budget, as on a real model of this KV size.
CAPACITY_MODEL: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 96,
    "intermediate_size": 128,
    "num_attention_heads": 3,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def qwen3_next_80b() -> dict[str, Any]:
    """transformers' Qwen3NextConfig defaults, which are Qwen3-Next-80B-A3B's."""
    from transformers import Qwen3NextConfig

    return {**Qwen3NextConfig().to_dict(), "model_type": "qwen3_next"}


@dataclass(frozen=True)
class Shape:
    name: str
    dtype: str
    kv_bytes_per_token: int
    state_bytes_per_slot: int

    @property
    def block_bytes(self) -> int:
        return BLOCK_SIZE * self.kv_bytes_per_token


def shape_of(name: str, hf_config: Mapping[str, Any], dtype: torch.dtype) -> Shape:
    """Per-token KV and per-slot recurrent state as the engine charges them (its layer specs)."""
    model = build_model(hf_config, dtype=dtype, device="meta")
    specs = model.layer_specs(dtype_bytes(dtype))  # type: ignore[operator]
    return Shape(
        name, str(dtype).removeprefix("torch."), kv_bytes_per_token(specs), state_bytes_per_slot(specs)
    )


def request_mix(n: int, seed: int, dist: str, scale: float = 1.0) -> list[int]:
    """n prompt lengths in PROMPT_MIN..PROMPT_MAX (times scale), log-uniform or uniform, seeded."""
    rng = random.Random(seed)
    lo, hi = PROMPT_MIN * scale, PROMPT_MAX * scale
    if dist == "uniform":
        return [round(rng.uniform(lo, hi)) for _ in range(n)]
    return [round(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in range(n)]


def static_slots(budget: int, shape: Shape, max_model_len: int) -> int:
    return budget // (max_model_len * shape.kv_bytes_per_token + shape.state_bytes_per_slot)


def paged_cost(shape: Shape, prompt: int, new_tokens: int) -> int:
    return blocks_for(prompt + new_tokens, BLOCK_SIZE) * shape.block_bytes + shape.state_bytes_per_slot


def paged_in_order(budget: int, shape: Shape, prompts: Sequence[int], new_tokens: int) -> int:
    """Requests of the mix, taken in order, that fit the budget together."""
    used = 0
    for i, p in enumerate(prompts):
        used += paged_cost(shape, p, new_tokens)
        if used > budget:
            return i
    return len(prompts)


def analytic(budgets: Sequence[int], prompts: Sequence[int]) -> list[dict[str, Any]]:
    shapes = [
        shape_of("Llama-3-8B", LLAMA3_8B, torch.bfloat16),
        shape_of("Qwen3-Next-80B-A3B", qwen3_next_80b(), torch.bfloat16),
        shape_of("SmolLM2-135M", SMOLLM2_135M, torch.float32),
    ]
    rows = []
    for shape in shapes:
        mean_cost = sum(paged_cost(shape, p, NEW_TOKENS) for p in prompts) / len(prompts)
        for budget in budgets:
            static = static_slots(budget, shape, MAX_MODEL_LEN)
            wide = static_slots(budget, shape, WIDE_MODEL_LEN)
            paged = paged_in_order(budget, shape, prompts, NEW_TOKENS)
            rows.append(
                {
                    **asdict(shape),
                    "budget_gib": budget / GiB,
                    "static": static,
                    "paged": paged,
                    "steady": budget / mean_cost,
                    "ratio": paged / static if static else math.inf,
                    "static_8k": wide,
                    "ratio_8k": paged / wide if wide else math.inf,
                }
            )
    return rows


# --- (b) measured -----------------------------------------------------------------------------


def write_capacity_model(path: Path) -> None:
    """An HF directory the engine loads: CAPACITY_MODEL with seeded random weights, and the default
    model's tokenizer (same vocabulary) so the scheduler can detokenize."""
    path.mkdir(parents=True, exist_ok=True)
    model = build_model(CAPACITY_MODEL)
    init_random(model, seed=0)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(CAPACITY_MODEL, indent=2))
    build_tokenizer(read_gguf(default_model_path()).metadata).save_pretrained(str(path))


class EmulatedHost:
    """The temp /proc tree a MemWatch reads: MemAvailable = reserve + the fixed headroom less what
    the KV pool holds, re-read (poll_now) whenever the pool's bytes change and at least every
    `max_age_s`, as MemWatch's poll would see a real host's MemAvailable move."""

    TOTAL = 64 * GiB

    def __init__(self, root: Path, reserve: int, headroom: int) -> None:
        self.root, self.reserve, self.headroom = root, reserve, headroom
        self.config = MemoryConfig(root=str(root), host_reserve_bytes=reserve)
        self.write(0)
        self.watch = MemWatch(self.config, StaticDeviceReader())
        self.watch.poll_now()
        self._held = 0
        self._at = time.monotonic()

    def write(self, held: int) -> None:
        write_meminfo(self.root, self.TOTAL, self.reserve + max(0, self.headroom - held))

    def set_headroom(self, headroom: int) -> None:
        self.headroom = headroom
        self.write(self._held)
        self.watch.poll_now()

    def follow(self, held: int, max_age_s: float = 0.05) -> None:
        if held != self._held or time.monotonic() - self._at >= max_age_s:
            self._held, self._at = held, time.monotonic()
            self.write(held)
            self.watch.poll_now()


@dataclass
class ClientTally:
    completed: int = 0
    refusals: int = 0
    capped: int = 0
    tokens: int = 0
    retrying: int = 0  # clients waiting out a Retry-After now


async def serve_mix(
    sched: Scheduler, prompts: Sequence[int], new_tokens: int, seed: int, tally: ClientTally
) -> None:
    """Submit every request at once; resubmit any the server refuses, after its Retry-After."""
    rng = random.Random(seed)

    async def retry(after: float) -> None:
        tally.refusals += 1
        tally.retrying += 1
        await asyncio.sleep(after)
        tally.retrying -= 1

    async def one(i: int, n: int) -> None:
        req = GenerationRequest(
            f"r{i}", tuple(rng.randrange(100, 49000) for _ in range(n)), GREEDY, new_tokens
        )
        while True:
            try:
                handle = sched.submit(req)
            except Refused as e:
                await retry(getattr(e, "retry_after_s", 0.05))
                continue
            ev = None
            async for event in handle:
                if isinstance(event, FinishEvent):
                    ev = event
                    break
            if ev is None:
                raise RuntimeError(f"request {req.request_id} ended without a finish event")
            if ev.reason == "error":
                await retry(getattr(ev.error, "retry_after_s", 0.05))
                continue
            if ev.reason not in ("length", "stop"):
                raise RuntimeError(f"request {req.request_id} ended with {ev.reason}")
            tally.completed += 1
            tally.capped += int(ev.capped)
            tally.tokens += ev.completion_tokens
            return

    await asyncio.gather(*(one(i, n) for i, n in enumerate(prompts)))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    scale = args.scale
    max_len = round(MAX_MODEL_LEN * scale)
    new_tokens = max(1, round(NEW_TOKENS * scale))
    prompts = request_mix(args.measured_requests, args.seed, args.dist, scale)
    shape = shape_of("capacity model", CAPACITY_MODEL, torch.float32)
    kv_budget = STATIC_SLOTS_MEASURED * max_len * shape.kv_bytes_per_token
    with tempfile.TemporaryDirectory(prefix="ballast-kv-capacity-") as tmp:
        model_dir, root = Path(tmp) / "model", Path(tmp) / "root"
        write_capacity_model(model_dir)
        root.mkdir()
        host = EmulatedHost(root, reserve=MiB, headroom=4 * GiB)  # room to load; narrowed below
        cfg = EngineConfig(
            model=str(model_dir),
            device="cpu",
            max_num_seqs=len(prompts),
            max_model_len=max_len,
            prefill_chunk_tokens=args.chunk,
            kv_segment_bytes=2 * shape.block_bytes,
        )
        engine = Engine.load(cfg, host.watch, prefix_cache=PrefixCacheConfig(fraction=0.0))
        kv = engine.runner.kv
        assert kv is not None
        activations = engine.cost_model.activation_bytes_per_prefill_token * args.chunk
        host.set_headroom(kv_budget + activations)
        sched = Scheduler(
            engine,
            SchedulerConfig(
                max_num_seqs=len(prompts), max_queue=len(prompts), retry_after_s=0.05, request_timeout_s=0
            ),
            memwatch=host.watch,
        )
        tally = ClientTally()
        peak = {"running": 0, "bytes": 0}
        saturated: list[int] = []  # running sequences, sampled while requests were kept waiting
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                held, running = kv.bytes_held, sched.active_slots
                peak["running"] = max(peak["running"], running)
                peak["bytes"] = max(peak["bytes"], held)
                if sched.queue_depth or tally.retrying:
                    saturated.append(running)
                host.follow(held)
                await asyncio.sleep(0.002)

        await sched.start()
        sampler = asyncio.ensure_future(sample())
        t0 = time.perf_counter()
        try:
            await serve_mix(sched, prompts, new_tokens, args.seed, tally)
        finally:
            wall = time.perf_counter() - t0
            done.set()
            await sampler
            await sched.stop()
            engine.shutdown()
    static = kv_budget // (max_len * shape.kv_bytes_per_token)
    return {
        "model": {**asdict(shape), "config": CAPACITY_MODEL},
        "scale": scale,
        "max_model_len": max_len,
        "new_tokens": new_tokens,
        "requests": len(prompts),
        "prompt_tokens": sum(prompts),
        "kv_budget_bytes": kv_budget,
        "activation_allowance_bytes": activations,
        "segment_bytes": kv.layout.segment_bytes,
        "static_slots": static,
        "analytic_paged_in_order": paged_in_order(kv_budget, shape, prompts, new_tokens),
        "peak_running": peak["running"],
        "peak_pool_bytes": peak["bytes"],
        "mean_running_saturated": sum(saturated) / max(1, len(saturated)),
        "ratio": peak["running"] / static,
        "completed": tally.completed,
        "refusals": tally.refusals,
        "capped": tally.capped,
        "completion_tokens": tally.tokens,
        "preemptions": engine.slot_kv.preemptions,
        "wall_s": wall,
    }


def print_tables(
    rows: Sequence[dict[str, Any]], measured: dict[str, Any] | None, args: argparse.Namespace
) -> None:
    print(
        f"(a) analytic: {args.requests:,} requests, prompts {args.dist} {PROMPT_MIN}..{PROMPT_MAX} + "
        f"{NEW_TOKENS} new, "
        f"static slots of {MAX_MODEL_LEN} tokens, blocks of {BLOCK_SIZE}, seed {args.seed}"
    )
    print(
        f"{'model':<20} {'dtype':>8} {'KV/token':>9} {'state/slot':>11} {'budget':>7} {'static':>7} "
        f"{'paged':>7} "
        f"{'steady':>7} {'ratio':>6} {'static@8k':>9} {'ratio@8k':>8}"
    )
    for r in rows:
        print(
            f"{r['name']:<20} {r['dtype']:>8} {r['kv_bytes_per_token'] / 1024:>7.1f}Ki "
            f"{r['state_bytes_per_slot'] / MiB:>9.2f}Mi "
            f"{r['budget_gib']:>5.0f}Gi {r['static']:>7} {r['paged']:>7} {r['steady']:>7.1f} "
            f"{r['ratio']:>5.2f}x "
            f"{r['static_8k']:>9} {r['ratio_8k']:>7.2f}x"
        )
    if measured is None:
        return
    m = measured
    print(
        f"\n(b) measured, real Scheduler + Engine on CPU: {m['requests']} requests, lengths x{m['scale']:g} "
        f"(prompts {args.dist} {round(PROMPT_MIN * m['scale'])}..{round(PROMPT_MAX * m['scale'])} + "
        f"{m['new_tokens']} new, "
        f"max_model_len {m['max_model_len']}), KV budget {m['kv_budget_bytes'] / MiB:.1f} MiB "
        f"(+ {m['activation_allowance_bytes'] / MiB:.1f} MiB for one prefill chunk), segments of "
        f"{m['segment_bytes'] / MiB:.2f} MiB"
    )
    print(
        f"{'static slots':>12} {'paged peak':>11} {'ratio':>6} {'mean saturated':>15} "
        f"{'analytic in order':>18} "
        f"{'peak pool':>10} {'completed':>10} {'refusals':>9} {'capped':>7} {'preempted':>10} {'wall':>6}"
    )
    print(
        f"{m['static_slots']:>12} {m['peak_running']:>11} {m['ratio']:>5.2f}x "
        f"{m['mean_running_saturated']:>15.1f} "
        f"{m['analytic_paged_in_order']:>18} "
        f"{m['peak_pool_bytes'] / MiB:>7.1f}MiB {m['completed']:>6}/{m['requests']:<3} {m['refusals']:>9} "
        f"{m['capped']:>7} {m['preemptions']:>10} {m['wall_s']:>5.1f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets-gib", type=float, nargs="+", default=[16, 64])
    parser.add_argument("--requests", type=int, default=10_000, help="analytic mix size")
    parser.add_argument("--dist", choices=["log-uniform", "uniform"], default="log-uniform")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measured-requests", type=int, default=64, help="0 skips the measured part")
    parser.add_argument("--scale", type=float, default=0.25, help="measured lengths: the mix's times this")
    parser.add_argument("--chunk", type=int, default=256, help="measured engine's prefill chunk tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.requests < 1 or args.measured_requests < 0 or not 0 < args.scale <= 1 or args.chunk < 1:
        parser.error("need --requests >= 1, --measured-requests >= 0, 0 < --scale <= 1, --chunk >= 1")

    prompts = request_mix(args.requests, args.seed, args.dist)
    rows = analytic([int(b * GiB) for b in args.budgets_gib], prompts)
    measured = asyncio.run(measure(args)) if args.measured_requests else None
    print_tables(rows, measured, args)
    if measured is not None and measured["completed"] != measured["requests"]:
        raise SystemExit(f"only {measured['completed']} of {measured['requests']} requests completed")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "bench": "kv_capacity",
        "mix": {
            "dist": args.dist,
            "prompt_min": PROMPT_MIN,
            "prompt_max": PROMPT_MAX,
            "new_tokens": NEW_TOKENS,
            "requests": args.requests,
            "seed": args.seed,
            "mean_prompt": sum(prompts) / len(prompts),
        },
        "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE,
        "qwen3_next_config": "transformers Qwen3NextConfig() defaults",
        "analytic": rows,
        "measured": measured,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
