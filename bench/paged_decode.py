"""Decode on one GPU with the paged KV pool: Llama-3-8B-shaped and Qwen3-Next-shaped models with
random weights, batch 1/32/128 at contexts 2k and 8k; tokens/s, % of the HBM roofline, and
transformers' `generate` on the same weights.

Each model is built once by transformers with random weights on the GPU and saved as a Hugging
Face directory (a temp dir under --work-dir); our side loads that directory with
`Engine.load(EngineConfig(model=dir, device, dtype, max_num_seqs=max batch, max_model_len=max
context + steps + margin))` once per model (CUDA graphs on), prefills every slot to the context
through StepPlans (packed into steps of --prefill-chunk tokens), then times --steps decode steps
after two warm-up steps, and checks the decode graphs replayed. The reference is
`generate` on the same in-memory model: decode-only seconds = generate(steps + 1) - generate(1)
(`ballast.bench.hybrid_decode.hf_decode`), run where batch x context <= --reference-max-tokens.
Prefill beside it: every slot's prompt through our engine (after one step's worth of other prompts
has warmed the shapes) against generate(1) on the whole batch, both to the first token.

Roofline: a decode step must read the weights it uses (everything but the embedding table, of
which it reads one row per sequence; for MoE the shared part plus the experts the batch is
expected to touch, E x (1 - (1 - k/E)^batch) per layer under uniform routing), every sequence's
KV (context x KV bytes per token), and read and write every sequence's recurrent state (hybrid).
Divided by the device's copy bandwidth (a 2 GiB `copy_`, read + write both counted: 2 x bytes /
seconds) that is the step time floor; "% roofline" = floor / measured step time.

Qwen3-Next-shaped = Qwen3-Next-80B-A3B's shapes (transformers' Qwen3NextConfig defaults) with
--experts of its 512 experts (default 64: ~12B parameters, so the model and the transformers copy
fit one H200 together). Per token it computes what the 80B model does (top-10 + shared expert);
at batch 1 it reads the same bytes, at large batch fewer experts than the 80B model would touch.
Configurations whose KV does not fit the GPU are printed as "does not fit" (Llama-8B at batch 128
x 8k needs ~128 GiB of KV).

    python -m ballast.bench.paged_decode [--models llama-8b qwen3-next] [--batches 1 32 128]
        [--contexts 2048 8192] [--steps 32] [--quick] [--no-reference] [--experts 64]
    python -m ballast.bench.paged_decode --device cpu --tiny --batches 1 4 --contexts 64 200 --steps 8
                                                                    # plumbing check without a GPU

Table on stdout, JSON to bench/results/paged_decode.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ballast.bench.hybrid_decode import SMALL_HYBRID_MOE, hf_decode
from ballast.bench.kv_capacity import LLAMA3_8B, qwen3_next_80b
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import LAST_SAMPLED, DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.memory.types import GiB
from ballast.models.arch.builtin import builtin_config
from ballast.models.blocks.gated_delta import fla_installed
from ballast.models.blocks.moe import Experts
from torch import nn

RESULTS = Path(__file__).parent / "results" / "paged_decode.json"
GREEDY = SamplingParams(temperature=0.0)
WARMUP_STEPS = 2
LEN_MARGIN = 8  # positions past the last decode step, so the last context bucket covers it


def decode_positions(context: int, steps: int) -> int:
    """Positions a slot reaches in `ours`: the context, then for each of the two ways of stepping
    (one at a time, pipelined) its warm-up and the timed steps."""
    return context + 2 * (WARMUP_STEPS + steps)


FIT_MARGIN = 4 * GiB  # kept free when deciding whether a configuration's KV fits


def model_config(name: str, tiny: bool, experts: int) -> dict[str, Any]:
    """The HF config of a benchmarked model; --tiny gives small stand-ins of the same kinds."""
    if name == "llama-8b":
        return builtin_config("tiny-llama") if tiny else dict(LLAMA3_8B)
    if name == "qwen3-next":
        if tiny:
            return dict(SMALL_HYBRID_MOE)
        return {**qwen3_next_80b(), "num_experts": experts, "tie_word_embeddings": False}
    raise ValueError(f"unknown model {name!r}")


def hf_random_model(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' model for cfg with its own random init, built directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "seed")}
    config = AutoConfig.for_model(cfg["model_type"], **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@dataclass(frozen=True)
class ReadModel:
    """What one decode step must move, from the config and the loaded weights."""

    weights_bytes: int  # every parameter, as loaded
    embed_bytes: int  # the input embedding table (one row per sequence is read)
    expert_bytes: int  # one routed expert of one layer (0: dense)
    moe_layers: int
    experts: int
    top_k: int
    kv_bytes_per_token: int
    state_bytes_per_slot: int

    def step_bytes(self, batch: int, context: float, rows: int = 1) -> float:
        """Bytes a step of `batch` sequences at `context` positions must read (and write, for
        recurrent state), each sequence `rows` tokens (a verify row: its decode token and drafts,
        the recurrent state written after each; the experts its tokens pick, routing uniform)."""
        dense = self.weights_bytes - self.embed_bytes - self.moe_layers * self.experts * self.expert_bytes
        tokens = batch * rows
        touched = self.experts * (1 - (1 - self.top_k / self.experts) ** tokens) if self.experts else 0.0
        experts = self.moe_layers * touched * self.expert_bytes
        per_seq = context * self.kv_bytes_per_token + (1 + rows) * self.state_bytes_per_slot
        return dense + experts + batch * per_seq


def read_model(engine: Engine, cfg: dict[str, Any]) -> ReadModel:
    """Bytes from the loaded model as held (float8 experts count their values and scales)."""
    model = engine.runner.model
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    expert_bytes = 0
    if experts:
        e = experts[0]
        expert_bytes = sum(p.numel() * p.element_size() for p in e.parameters()) // e.gate_up_proj.shape[0]
    emb = model.model.embed_tokens.weight
    cost = engine.cost_model
    return ReadModel(
        weights_bytes=engine.load_report.weights_bytes,
        # tied: the table is read whole as lm_head
        embed_bytes=0 if cfg.get("tie_word_embeddings") else emb.numel() * emb.element_size(),
        expert_bytes=expert_bytes,
        moe_layers=len(experts),
        experts=int(cfg.get("num_experts", 0) or 0),
        top_k=int(cfg.get("num_experts_per_tok", 0) or 0),
        kv_bytes_per_token=cost.kv_bytes_per_token,
        state_bytes_per_slot=cost.state_bytes_per_slot,
    )


def copy_bandwidth(device: torch.device, nbytes: int = 2 * GiB, repeats: int = 5) -> float:
    """Bytes/s moved by a large device copy, read and write both counted (2 x nbytes / time)."""
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / best


def free_device_memory() -> None:
    """Collect what a shut-down engine (or a dropped reference model) left, and hand the device
    allocator's cached blocks back, so the next load starts from the memory it will meet."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(batch: int, context: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(seed))


def prefill(engine: Engine, prompts: torch.Tensor, chunk: int) -> list[int]:
    """Every slot 0..batch-1 through its whole prompt, steps of at most `chunk` tokens (several
    sequences per step); returns each slot's first sampled token."""
    batch, context = prompts.shape
    rows = [p.tolist() for p in prompts]
    first: dict[int, int] = {}
    pending = [(slot, 0) for slot in range(batch)]  # (slot, prefilled)
    while pending:
        room, chunks, rest = chunk, [], []
        for slot, done in pending:
            n = min(room, context - done)
            if n > 0:
                end = done + n
                chunks.append(PrefillChunk(slot, tuple(rows[slot][done:end]), done, sample=end == context))
                room -= n
                done = end
            if done < context:
                rest.append((slot, done))
        sampling = {c.slot: GREEDY for c in chunks if c.sample}
        for out in engine.submit(StepPlan(prefills=tuple(chunks), sampling=sampling)).result().outputs:
            first[out.slot] = out.token_id
        pending = rest
    return [first[s] for s in range(batch)]


def ours(engine: Engine, prompts: torch.Tensor, steps: int, chunk: int) -> dict[str, Any]:
    """Prefill, warm up, then time `steps` decode steps of every slot one at a time (tokens back on
    the host before the next step is planned), then `steps` more pipelined as the server runs
    them (`served_*`); releases the slots."""
    batch, context = prompts.shape
    sampling = dict.fromkeys(range(batch), GREEDY)
    # One step's worth of other prompts first: a shape's first use compiles kernels, which the
    # timed prefill should not count (the reference's generate is timed after a warm-up too).
    warm = max(1, min(batch, chunk // context))
    prefill(engine, prompts[:warm].flip(1), chunk)
    engine.submit(StepPlan(release=tuple(range(warm)))).result()
    t0 = time.perf_counter()
    last = prefill(engine, prompts, chunk)
    prefill_s = time.perf_counter() - t0
    tokens = [[t] for t in last]
    graphs = engine.runner.graph_runner.graphs
    replays_before = graphs.replays if graphs is not None else 0
    pos = context
    step_s = 0.0
    for i in range(WARMUP_STEPS + steps):
        plan = StepPlan(decodes=tuple(DecodeToken(s, last[s], pos) for s in range(batch)), sampling=sampling)
        t = time.perf_counter()
        outputs = engine.submit(plan).result().outputs  # token ids come back to the host: synced
        if i >= WARMUP_STEPS:
            step_s += time.perf_counter() - t
        for out in outputs:
            last[out.slot] = out.token_id
            tokens[out.slot].append(out.token_id)
        pos += 1
    replays = (graphs.replays if graphs is not None else 0) - replays_before

    # As the server decodes (overlap on): each step is submitted before the one ahead of it has
    # brought its tokens to the host, taking them from the device (LAST_SAMPLED), so the host's
    # work for a step runs while the GPU runs the step before. Warmed up like the steps above, so
    # a 16-step timing counts no first-use cost of that path (its token gather). Suspected, not
    # yet confirmed, in the 8B's figures: batch 1 at a 128-token context, the first measured in
    # its process, 151 tok/s pipelined against 189 one step at a time; 199 at the next context.
    def pipelined(first: int, count: int) -> float:
        t = time.perf_counter()
        futures = [
            engine.submit(
                StepPlan(
                    decodes=tuple(DecodeToken(s, LAST_SAMPLED, first + i) for s in range(batch)),
                    sampling=sampling,
                )
            )
            for i in range(count)
        ]
        for f in futures:
            f.result()
        return time.perf_counter() - t

    pipelined(pos, WARMUP_STEPS)
    served_s = pipelined(pos + WARMUP_STEPS, steps)
    engine.submit(StepPlan(release=tuple(range(batch)))).result()
    return {
        "prefill_s": prefill_s,
        "step_s": step_s / steps,
        "tok_s": batch * steps / step_s,
        "served_step_s": served_s / steps,
        "served_tok_s": batch * steps / served_s,
        "graph_replays": replays,
        "graphs": graphs is not None and replays >= steps + WARMUP_STEPS,
        "tokens": tokens,
    }


def reference(model: nn.Module, prompts: torch.Tensor, steps: int) -> dict[str, Any]:
    run = hf_decode(model, prompts, steps + 1)  # generate(steps + 1) - generate(1)
    return {
        "tok_s": prompts.shape[0] * steps / run.decode_s,
        "step_s": run.decode_s / steps,
        "prefill_s": run.first_token_s,
        "tokens": run.tokens,
    }


def free_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        import psutil

        return int(psutil.virtual_memory().available)
    return int(torch.cuda.mem_get_info(device)[0])


def kv_need(rm: ReadModel, batch: int, positions: int, block: int) -> int:
    return batch * -(-positions // block) * block * rm.kv_bytes_per_token


def bench_model(
    name: str, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, bandwidth: float
) -> list[dict[str, Any]]:
    cfg = model_config(name, args.tiny, args.experts)
    vocab = int(cfg["vocab_size"])
    max_batch, max_ctx = max(args.batches), max(args.contexts)
    positions = decode_positions(max_ctx, args.steps) + LEN_MARGIN
    t0 = time.perf_counter()
    hf = hf_random_model(cfg, device, dtype)
    if args.work_dir:
        Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"ballast-paged-decode-{name}-", dir=args.work_dir))
    rows: list[dict[str, Any]] = []
    try:
        hf.save_pretrained(str(work))
        built_s = time.perf_counter() - t0
        for compiled in args.compile_modes:
            engine = Engine.load(
                EngineConfig(
                    model=str(work),
                    device=str(device),
                    dtype=args.dtype,
                    max_num_seqs=max_batch,
                    max_model_len=positions,
                    prefill_chunk_tokens=args.prefill_chunk,
                    cuda_graphs=device.type == "cuda",
                    compile=compiled,
                ),
                prefix_cache=PrefixCacheConfig(fraction=0.0),
            )
            try:
                rm = read_model(engine, cfg)
                kv = engine.runner.kv
                block = kv.layout.block_size if kv is not None else 1
                g = engine.runner.graph_runner.graphs
                print(
                    f"{name}: built + saved in {built_s:.1f}s, engine load {engine.load_report.load_s:.1f}s "
                    f"(compile {'on' if compiled else 'off'}), weights {rm.weights_bytes / GiB:.2f} GiB, "
                    f"KV {rm.kv_bytes_per_token / 1024:.1f} KiB/token, state "
                    f"{rm.state_bytes_per_slot / 2**20:.1f} "
                    f"MiB/slot, graphs {g.captured if g else 0}",
                    flush=True,
                )
                for context in args.contexts:
                    for batch in args.batches:
                        row = run_ours(
                            engine, rm, name, batch, context, block, vocab, args, device, bandwidth
                        )
                        rows.append(row | {"compile": compiled})
            finally:
                engine.shutdown()
                del engine
                free_device_memory()
        if not args.no_reference:
            for row in rows:
                if row["compile"] == args.compile_modes[-1]:  # once per configuration
                    run_reference(hf, row, rm, vocab, args, device)
    finally:
        del hf
        free_device_memory()
        shutil.rmtree(work, ignore_errors=True)
    return rows


def run_ours(
    engine: Engine,
    rm: ReadModel,
    name: str,
    batch: int,
    context: int,
    block: int,
    vocab: int,
    args: argparse.Namespace,
    device: torch.device,
    bandwidth: float,
) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "batch": batch, "context": context}
    positions = decode_positions(context, args.steps)
    held = engine.runner.kv.bytes_held if engine.runner.kv is not None else 0
    need = kv_need(rm, batch, positions, block)
    row["kv_gib"] = need / GiB
    if need > free_bytes(device) + held - FIT_MARGIN:
        row["ours"] = "does not fit"
        print(f"  {name} batch {batch} context {context}: KV {need / GiB:.1f} GiB does not fit", flush=True)
        return row
    prompts = random_prompts(batch, context, vocab, seed=batch * 100_003 + context)
    result = ours(engine, prompts, args.steps, args.prefill_chunk)
    floor = rm.step_bytes(batch, context + WARMUP_STEPS + args.steps / 2) / bandwidth
    result["floor_s"] = floor
    result["roofline_pct"] = 100 * floor / result["step_s"]
    result["served_roofline_pct"] = 100 * floor / result["served_step_s"]
    row["ours"] = result
    print(
        f"  {name} batch {batch} context {context}: {result['tok_s']:.0f} tok/s "
        f"({result['served_tok_s']:.0f} pipelined as served), step {result['step_s'] * 1e3:.2f} ms, "
        f"{result['roofline_pct']:.0f}% of roofline, prefill {result['prefill_s']:.2f}s, graphs "
        f"{result['graphs']}",
        flush=True,
    )
    return row


def run_reference(
    hf: nn.Module,
    row: dict[str, Any],
    rm: ReadModel,
    vocab: int,
    args: argparse.Namespace,
    device: torch.device,
) -> None:
    batch, context = row["batch"], row["context"]
    if batch * context > args.reference_max_tokens:
        row["transformers"] = f"skipped (batch x context > {args.reference_max_tokens})"
        return
    # generate's cache grows by concatenation, so it briefly holds the KV twice.
    if 2 * kv_need(rm, batch, context + args.steps + 1, 1) > free_bytes(device) - FIT_MARGIN:
        row["transformers"] = "does not fit"
        return
    prompts = random_prompts(batch, context, vocab, seed=batch * 100_003 + context)
    try:
        row["transformers"] = reference(hf, prompts, args.steps)
    except torch.cuda.OutOfMemoryError:
        row["transformers"] = "out of memory"
        free_device_memory()
    ref = row["transformers"]
    if isinstance(ref, dict) and isinstance(row.get("ours"), dict):
        row["speedup"] = row["ours"]["tok_s"] / ref["tok_s"]
        row["prefill_speedup"] = ref["prefill_s"] / row["ours"]["prefill_s"]
        # Same weights, both greedy: in float32 the tokens agree; in bfloat16 they may part once
        # two logits round alike, so this is a check of the weights' round trip, not of precision.
        n = args.steps + 1
        row["same_tokens"] = [t[:n] for t in row["ours"]["tokens"]] == [t[:n] for t in ref["tokens"]]
    shown = f"{ref['tok_s']:.0f} tok/s, prefill {ref['prefill_s']:.2f}s" if isinstance(ref, dict) else ref
    print(f"  transformers {row['model']} batch {batch} context {context}: {shown}", flush=True)


def print_table(rows: Sequence[dict[str, Any]], header: str) -> None:
    print(header)
    print(
        f"{'model':<11} {'compile':>7} {'batch':>5} {'context':>7} {'KV GiB':>7} {'ours tok/s':>11} "
        f"{'step ms':>8} {'floor ms':>9} {'% roof':>7} {'served':>7} {'% roof':>7} "
        f"{'graphs':>6} {'HF tok/s':>10} {'speedup':>8} {'same tokens':>11} "
        f"{'prefill s':>9} {'HF prefill s':>12}"
    )
    for r in rows:
        o, ref = r.get("ours"), r.get("transformers", "-")
        if isinstance(o, dict):
            ours_cols = (
                f"{o['tok_s']:>11.0f} {o['step_s'] * 1e3:>8.2f} {o['floor_s'] * 1e3:>9.2f} "
                f"{o['roofline_pct']:>6.0f}% {o['served_tok_s']:>7.0f} {o['served_roofline_pct']:>6.0f}% "
                f"{'yes' if o['graphs'] else 'no':>6}"
            )
        else:
            ours_cols = f"{str(o):>61}"
        ref_col = f"{ref['tok_s']:>10.0f}" if isinstance(ref, dict) else f"{str(ref)[:10]:>10}"
        speed = f"{r['speedup']:>7.2f}x" if "speedup" in r else f"{'-':>8}"
        same = str(r.get("same_tokens", "-"))
        prefill = f"{o['prefill_s']:>9.2f}" if isinstance(o, dict) else f"{'-':>9}"
        ref_prefill = f"{ref['prefill_s']:>12.2f}" if isinstance(ref, dict) else f"{'-':>12}"
        print(
            f"{r['model']:<11} {'on' if r.get('compile', True) else 'off':>7} {r['batch']:>5} "
            f"{r['context']:>7} {r['kv_gib']:>7.1f} {ours_cols} {ref_col} {speed} {same:>11} "
            f"{prefill} {ref_prefill}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", choices=["llama-8b", "qwen3-next"], default=["llama-8b", "qwen3-next"]
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=None, help="default 1 32 128 (--quick: 1 32)"
    )
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="default 2048 8192 (--quick: 2048)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32, --quick 16)")
    parser.add_argument("--quick", action="store_true", help="batches 1 32, context 2048, 16 steps")
    parser.add_argument(
        "--tiny", action="store_true", help="small stand-in models (a plumbing check, e.g. on CPU)"
    )
    parser.add_argument(
        "--experts", type=int, default=64, help="routed experts of the Qwen3-Next-shaped model"
    )
    parser.add_argument("--prefill-chunk", type=int, default=8192, help="prompt tokens per prefill step")
    parser.add_argument("--no-reference", action="store_true", help="skip transformers' generate")
    parser.add_argument(
        "--reference-max-tokens",
        type=int,
        default=65536,
        help="run the reference only where batch x context is at most this",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (with --tiny)")
    parser.add_argument(
        "--dtype", default=None, choices=["bfloat16", "float32"], help="default bfloat16 (cpu: float32)"
    )
    parser.add_argument("--work-dir", default=None, help="where the random-weight HF directories are written")
    parser.add_argument(
        "--compile",
        choices=["on", "off", "both"],
        default="on",
        help="fuse the pointwise pieces with torch.compile (both: off, then on, side by side)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.compile_modes = {"on": [True], "off": [False], "both": [False, True]}[args.compile]
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "paged_decode: CUDA is not available here; it is a GPU benchmark "
            "(for a plumbing check without a GPU: --device cpu --tiny --quick)"
        )
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("paged_decode: full-size models on the CPU would take hours; add --tiny")
    args.batches = args.batches or ([1, 32] if args.quick else [1, 32, 128])
    args.contexts = args.contexts or ([2048] if args.quick else [2048, 8192])
    args.steps = args.steps or (16 if args.quick else 32)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if min(args.batches) < 1 or min(args.contexts) < 1 or args.steps < 1 or args.prefill_chunk < 1:
        parser.error("batches, contexts, --steps and --prefill-chunk must be >= 1")
    dtype = getattr(torch, args.dtype)
    random.seed(0)

    bandwidth = copy_bandwidth(device, GiB // 4 if device.type == "cpu" else 2 * GiB)
    where = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU ({torch.get_num_threads()} threads)"
    )
    print(
        f"{where}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (read + write), {args.dtype}, fla "
        f"{'installed' if fla_installed() else 'not installed'}",
        flush=True,
    )
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in args.models:
        rows.extend(bench_model(name, args, device, dtype, bandwidth))
        write_report(rows, args, where, bandwidth, time.perf_counter() - t0)  # a later model may not finish
    wall = time.perf_counter() - t0
    print_table(
        rows,
        f"\npaged decode on {where}, {args.steps} timed steps after {WARMUP_STEPS} warm-up, "
        f"{args.dtype}, random weights{' (tiny stand-ins)' if args.tiny else ''}; {wall:.0f}s",
    )
    print(f"wrote {args.out}")


def write_report(
    rows: Sequence[dict[str, Any]], args: argparse.Namespace, where: str, bandwidth: float, wall: float
) -> None:
    for r in rows:  # tokens were for the check, not the report
        for side in ("ours", "transformers"):
            if isinstance(r.get(side), dict):
                r[side].pop("tokens", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "bench": "paged_decode",
        "device": where,
        "dtype": args.dtype,
        "copy_bandwidth_bytes_s": bandwidth,
        "bandwidth_rule": "2 x bytes / seconds of a device copy_ (read + write)",
        "steps": args.steps,
        "warmup_steps": WARMUP_STEPS,
        "prefill_chunk": args.prefill_chunk,
        "tiny": args.tiny,
        "qwen3_next_experts": args.experts,
        "fla": fla_installed(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "wall_s": wall,
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
