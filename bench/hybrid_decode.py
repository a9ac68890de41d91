"""Decode throughput of a small hybrid (gated DeltaNet + attention) MoE model: ballast's
slot-batched forward against transformers' `generate` on the same weights (CPU by default; on
CUDA both sides use the flash-linear-attention kernels where that package is installed).

transformers batches a fixed set of equal-length prompts (no continuous batching for these
models); ballast runs the same prompts as slots of one step. Both decode greedily; the figure is
decode tokens per second (prefill excluded), the fastest of --repeats interleaved runs per side.
Table on stdout, JSON to bench/results/hybrid_decode.json. In bfloat16 the two sides may pick
different tokens once two logits round alike, so "same tokens" is only expected in float32.

    python -m ballast.bench.hybrid_decode [--batches 1 8 32] [--new-tokens 32] [--prompt-len 32]
                                          [--threads N] [--repeats 3] [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from ballast.engine.runner.model_runner import ATTENTION_BACKENDS
from ballast.models.arch.builtin import init_random
from ballast.models.arch.qwen3_next import Qwen3NextForCausalLM
from ballast.models.arch.registry import build_model
from ballast.models.base import ForwardBatch
from ballast.models.layers.state import allocate_states
from torch import nn
from torch.nn.attention import sdpa_kernel

RESULTS = Path(__file__).parent / "results" / "hybrid_decode.json"

# Small but shaped like the real thing: 3 linear-attention layers per full-attention layer,
# grouped value heads, 16 experts top-4 plus a shared expert on every layer.
SMALL_HYBRID_MOE: dict[str, Any] = {
    "model_type": "qwen3_next",
    "vocab_size": 8192,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 256,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
}


def _prompts(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(batch))


@torch.inference_mode()
@sdpa_kernel(ATTENTION_BACKENDS)
def ours_decode(
    model: Qwen3NextForCausalLM, prompts: torch.Tensor, new_tokens: int
) -> tuple[float, list[list[int]]]:
    """Seconds spent in the decode steps, and the generated tokens per sequence."""
    batch, length = prompts.shape
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    states = allocate_states(
        model.layer_specs(param.element_size()), batch, length + new_tokens + 1, device, dtype
    )
    logits = model(ForwardBatch.build([(i, prompts[i].tolist(), 0) for i in range(batch)], device), states)
    tokens = [[int(t)] for t in logits.argmax(-1)]
    start = time.perf_counter()
    for step in range(new_tokens - 1):
        seqs = [(i, [tokens[i][-1]], length + step) for i in range(batch)]
        logits = model(ForwardBatch.build(seqs, device), states)
        for i, t in enumerate(logits.argmax(-1).tolist()):
            tokens[i].append(t)
    return time.perf_counter() - start, tokens


class HFRun(NamedTuple):
    decode_s: float  # generate(new_tokens) - generate(1)
    tokens: list[list[int]]
    first_token_s: float  # generate(1): the prompts' prefill and one sampled token


@torch.inference_mode()
@sdpa_kernel(ATTENTION_BACKENDS)
def hf_decode(model: Any, prompts: torch.Tensor, new_tokens: int) -> HFRun:
    """generate(new_tokens) minus generate(1): the decode steps' share of the time; generate(1)'s
    own time is the prefill's (to the first token)."""
    prompts = prompts.to(next(model.parameters()).device)
    kwargs: dict[str, Any] = {
        "do_sample": False,
        "pad_token_id": 0,
        "eos_token_id": None,
        "attention_mask": torch.ones_like(prompts),
    }
    model.generate(prompts, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
    t0 = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, min_new_tokens=1, **kwargs)
    t1 = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
    t2 = time.perf_counter()
    return HFRun(max((t2 - t1) - (t1 - t0), 1e-9), out[:, prompts.shape[1] :].tolist(), t1 - t0)


def reference_model(ours: nn.Module) -> nn.Module:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = {k: v for k, v in SMALL_HYBRID_MOE.items() if k != "model_type"}
    ref = Qwen3NextForCausalLM(Qwen3NextConfig(**cfg))
    ref.load_state_dict(ours.state_dict(), strict=True)
    return ref.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per side; the fastest counts")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.threads < 0:
        parser.error("--threads must be >= 0")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (the first token comes from prefill)")

    ours = build_model(SMALL_HYBRID_MOE)
    assert isinstance(ours, Qwen3NextForCausalLM)
    init_random(ours, seed=0)
    reference = reference_model(ours)
    dtype = getattr(torch, args.dtype)
    ours.to(args.device, dtype)
    reference.to(args.device, dtype)
    rows = []
    for batch in args.batches:
        prompts = _prompts(batch, args.prompt_len, SMALL_HYBRID_MOE["vocab_size"])
        decoded = batch * (args.new_tokens - 1)
        ours_decode(ours, prompts, 2)  # warm-up
        ours_runs, hf_runs = [], []
        for _ in range(args.repeats):  # interleaved, so a noisy spell on a shared box hits both
            ours_runs.append(ours_decode(ours, prompts, args.new_tokens))
            hf_runs.append(hf_decode(reference, prompts, args.new_tokens))
        (ours_s, ours_tokens), (hf_s, hf_tokens, _) = min(ours_runs), min(hf_runs)
        rows.append(
            {
                "batch": batch,
                "decode_tokens": decoded,
                "ours_tok_s": decoded / ours_s,
                "transformers_tok_s": decoded / hf_s,
                "speedup": hf_s / ours_s,
                "same_tokens": ours_tokens == hf_tokens,
            }
        )

    where = f"CPU ({torch.get_num_threads()} threads)" if args.device == "cpu" else args.device
    print(
        f"hybrid MoE decode on {where}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {args.dtype}"
    )
    print(f"{'batch':>5} {'ours tok/s':>11} {'HF tok/s':>10} {'speedup':>8} {'same tokens':>12}")
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ours_tok_s']:>11.1f} {r['transformers_tok_s']:>10.1f} "
            f"{r['speedup']:>7.2f}x {str(r['same_tokens']):>12}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "bench": "hybrid_decode",
        "config": SMALL_HYBRID_MOE,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "dtype": args.dtype,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "rows": rows,
    }
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
