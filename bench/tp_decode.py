"""Decode throughput with tensor parallel: the same Qwen3-Next-shaped model (random weights) served
by one GPU and split over two (`--tensor-parallel-size 2`), batch 1/32/128, side by side.

The model is written once as a Hugging Face directory (safetensors, under --work-dir), so both
sides load it the way a real checkpoint loads (each TP rank reads only its slices). Each side is
an `Engine` (`EngineConfig(model=dir, tensor_parallel_size=..)`): every slot is prefilled to
--context tokens through StepPlans, then --steps greedy decode steps of all slots are timed after
two warm-up steps. Sides: TP=1 as served (CUDA graphs on), TP=1 eager (graphs off), TP=N eager
(the default under tensor parallel), TP=N with decode graphs on every rank (`tp_cuda_graphs`)
and TP=N EP (`--expert-parallel`: each rank holds 1/N of the experts whole instead of 1/N of
every expert); tok/s = batch x steps / seconds. Whether each side really replayed graphs is
printed and written (a side whose capture failed decodes eagerly: its figures would be eager ones).

Qwen3-Next-shaped = Qwen3-Next-80B-A3B's shapes (48 layers, hidden 2048, 16 heads of 256, gated
DeltaNet 16/32 heads, top-10 of --experts experts + a shared expert; default 26 experts: ~6.2B
parameters, 12.5 GB in bf16).

    NCCL_NVLS_ENABLE=0 python -m ballast.bench.tp_decode --device cuda   # 2 GPUs
    NCCL_NVLS_ENABLE=0 python -m ballast.bench.tp_decode --model builtin:qwen3-next-6b   # no checkpoint
    python -m ballast.bench.tp_decode --device cpu --tiny --batches 1 4 --context 32 --steps 4
                                                                         # plumbing check, gloo

Table on stdout, JSON to bench/results/tp_decode.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from ballast.bench.hybrid_decode import SMALL_HYBRID_MOE
from ballast.bench.kv_capacity import qwen3_next_80b
from ballast.bench.paged_decode import free_device_memory
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.models.arch.builtin import builtin_config
from ballast.models.arch.qwen3_next import CenteredRMSNorm
from ballast.models.arch.registry import build_model
from ballast.models.blocks.gated_delta import GatedDeltaNet, GatedRMSNorm
from safetensors.torch import save_file

RESULTS = Path(__file__).parent / "results" / "tp_decode.json"
GREEDY = SamplingParams(temperature=0.0)
WARMUP_STEPS = 2
SIDES = ("tp1", "tp1-eager", "eager", "ep", "graphs")
FILE_BYTES = 2 << 30  # safetensors file size, as published checkpoints shard theirs


def model_config(tiny: bool, experts: int) -> dict[str, Any]:
    if tiny:
        return {**SMALL_HYBRID_MOE, "vocab_size": 8192}
    return {**qwen3_next_80b(), "num_experts": experts, "tie_word_embeddings": False}


@torch.no_grad()
def write_random_checkpoint(cfg: dict[str, Any], out: Path, device: torch.device, dtype: torch.dtype) -> int:
    """A random-weights HF directory for cfg (built on `device`, one parameter at a time into files
    of ~2 GiB); returns the parameter count."""
    model = build_model(cfg, dtype=dtype, device=device)
    for module in model.modules():
        if isinstance(module, GatedRMSNorm):
            module.weight.fill_(1.0)  # the DeltaNet output's norm is not centred
        elif isinstance(module, CenteredRMSNorm):
            module.weight.zero_()  # scale 1
        elif isinstance(module, GatedDeltaNet):
            module.A_log.copy_(torch.empty_like(module.A_log).uniform_(1.0, 16.0).log())
            module.dt_bias.fill_(1.0)
    count, size, files = 0, 0, 0
    part: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if "norm" not in name and not name.endswith(("A_log", "dt_bias")):
            p.normal_(0.0, 0.02)  # norms, decays and dt biases keep the values set above
        count += p.numel()
        part[name] = p.detach().to("cpu").contiguous()
        size += p.numel() * p.element_size()
        if size >= FILE_BYTES:
            save_file(part, str(out / f"model-{files:05d}.safetensors"))
            part, size, files = {}, 0, files + 1
    if part:
        save_file(part, str(out / f"model-{files:05d}.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": str(dtype).removeprefix("torch.")}))
    del model
    return count


def decode_rate(engine: Engine, batch: int, context: int, steps: int, vocab: int) -> float:
    """Tokens per second of `steps` decode steps of `batch` slots at `context` positions."""
    gen = torch.Generator().manual_seed(batch)
    last: dict[int, int] = {}
    chunk = engine.prefill_chunk_tokens
    for slot in range(batch):
        prompt = torch.randint(0, vocab, (context,), generator=gen).tolist()
        for start in range(0, context, chunk):
            part = tuple(prompt[start : start + chunk])
            final = start + len(part) == context
            plan = StepPlan(prefills=(PrefillChunk(slot, part, start, final),), sampling={slot: GREEDY})
            result = engine.submit(plan).result()
        last[slot] = result.outputs[0].token_id
    sampling = {s: GREEDY for s in range(batch)}
    t0 = 0.0
    for step in range(WARMUP_STEPS + steps):
        if step == WARMUP_STEPS:
            t0 = time.perf_counter()
        decodes = tuple(DecodeToken(s, last[s], context + step) for s in range(batch))
        result = engine.submit(StepPlan(decodes=decodes, sampling=sampling)).result()
        last = {o.slot: o.token_id for o in result.outputs}
    seconds = time.perf_counter() - t0
    engine.submit(StepPlan(release=tuple(range(batch)))).result()
    return batch * steps / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--context", type=int, default=1024, help="prefilled tokens per slot")
    parser.add_argument("--steps", type=int, default=32, help="timed decode steps")
    parser.add_argument("--experts", type=int, default=26)
    parser.add_argument("--tp", type=int, default=2, help="the split side's tensor-parallel size")
    parser.add_argument("--tiny", action="store_true", help="a small model of the same kind")
    parser.add_argument("--device", default="cuda", help="cuda (GPUs 0..tp-1) or cpu (gloo)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--work-dir", type=Path, default=None, help="where the checkpoint is written")
    parser.add_argument(
        "--model",
        help="serve this instead of writing a checkpoint, e.g. builtin:qwen3-next-6b (each rank draws "
        "its own shard's random weights: no 12.5 GB written and read back)",
    )
    parser.add_argument(
        "--sides",
        nargs="+",
        choices=SIDES,
        default=list(SIDES),
        help="which sides to run (default all): tp1 (graphs), tp1-eager, eager (TP=N), ep, graphs (TP=N)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not {"tp1", "eager"} <= set(args.sides):
        parser.error("--sides must include tp1 and eager (the table compares the split side to TP=1)")
    dtype = getattr(torch, args.dtype)
    cfg = builtin_config(args.model) if args.model else model_config(args.tiny, args.experts)
    work = Path(tempfile.mkdtemp(prefix="ballast-tp-", dir=args.work_dir))
    device = torch.device("cuda:0" if args.device == "cuda" else args.device)
    try:
        if args.model:
            with torch.device("meta"):
                params = sum(p.numel() for p in build_model(cfg).parameters())
        else:
            params = write_random_checkpoint(cfg, work, device, dtype)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ep_side = f"TP={args.tp} EP"  # expert parallel: each rank holds whole experts
        every = [("tp1", "TP=1", 1, True), ("tp1-eager", "TP=1 eager", 1, False)]
        every.append(("eager", f"TP={args.tp} eager", args.tp, False))
        if device.type != "cuda":
            every = [("tp1", "TP=1", 1, False), ("eager", f"TP={args.tp}", args.tp, False)]
        if cfg["num_experts"] % args.tp == 0:
            every.append(("ep", ep_side, args.tp, False))
        if device.type == "cuda":  # last: its capture takes longest
            every.append(("graphs", f"TP={args.tp} graphs", args.tp, True))
        sides = [(label, tp, graphs) for key, label, tp, graphs in every if key in args.sides]
        rates: dict[str, dict[int, float]] = {}
        replayed: dict[str, int] = {}  # decode steps each side replayed from graphs (rank 0)
        for label, tp, graphs in sides:
            engine = Engine.load(
                EngineConfig(
                    model=args.model or str(work),
                    device=args.device,
                    dtype=args.dtype,
                    max_num_seqs=max(args.batches),
                    max_model_len=args.context + WARMUP_STEPS + args.steps + 8,
                    cuda_graphs=graphs,
                    tp_cuda_graphs=graphs,
                    tensor_parallel_size=tp,
                    expert_parallel=label == ep_side,
                )
            )
            try:
                rates[label] = {}
                for b in args.batches:
                    rates[label][b] = decode_rate(engine, b, args.context, args.steps, cfg["vocab_size"])
                    print(f"  {label} batch {b}: {rates[label][b]:.1f} tok/s", flush=True)
                g = engine.runner.graph_runner.graphs
                replayed[label] = 0 if g is None else g.replays
                if graphs and g is None:
                    print(f"  {label}: no decode graphs captured (see the log): eager figures", flush=True)
            finally:
                engine.shutdown()
                del engine
                free_device_memory()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    labels = [label for label, _, _ in sides]
    # The split side against TP=1: with graphs where they were captured (as TP=1 runs); EP (eager)
    # against the split side run the same way.
    eager = next(label for label in labels if label in (f"TP={args.tp} eager", f"TP={args.tp}"))
    split = f"TP={args.tp} graphs" if replayed.get(f"TP={args.tp} graphs") else eager
    rows = [
        {
            "batch": b,
            **{label: rates[label][b] for label in labels},
            "speedup": rates[split][b] / rates[labels[0]][b],
            **({"ep_over_tp": rates[ep_side][b] / rates[eager][b]} if ep_side in rates else {}),
        }
        for b in args.batches
    ]
    print(
        f"decode tok/s, Qwen3-Next-shaped {params / 1e9:.2f}B params, {args.dtype}, context {args.context}, "
        f"{args.steps} steps, {args.device}"
    )
    ep_head = f" {'EP / ' + eager:>18}" if ep_side in rates else ""
    print(
        f"{'batch':>5} " + " ".join(f"{label:>13}" for label in labels) + f" {split + ' / TP=1':>18}{ep_head}"
    )
    for r in rows:
        ep = f" {r['ep_over_tp']:>11.2f}x" if "ep_over_tp" in r else ""
        print(
            f"{r['batch']:>5} "
            + " ".join(f"{r[label]:>13.1f}" for label in labels)
            + f" {r['speedup']:>17.2f}x{ep}"
        )
    print("decode steps replayed from graphs: " + ", ".join(f"{k} {v}" for k, v in replayed.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "bench": "tp_decode",
        "config": cfg,
        "params": params,
        "context": args.context,
        "steps": args.steps,
        "dtype": args.dtype,
        "device": args.device,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if device.type == "cuda"
        else [],
        "torch": torch.__version__,
        "machine": platform.machine(),
        "rows": rows,
        "graph_replays": replayed,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
