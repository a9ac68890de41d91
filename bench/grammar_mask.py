"""What constrained decoding costs per step: the batched sampler with every row under a JSON-schema
grammar against the same sampler with none, at batch 1, 8 and 32, with the default model's real
tokenizer (49,152 tokens). Logits are random (the model's cost is not what is measured); a row
whose grammar finished starts again, so every step masks every row.

Two schemas: `enum_int` (an enum and a bounded integer: most steps allow few tokens) and
`free_text` (a free string: most steps allow most of the vocabulary, the costlier masks). If
xgrammar happens to be installed, its mask fill for the same schema is measured beside
llguidance's, the figures ballast's choice of engine rests on.

Medians of per-step wall time over `--steps` steps after a warm-up, repeated `--rounds` times and
the lowest median kept (this machine is shared: the lowest is the least disturbed). Table on
stdout, JSON to bench/results/grammar_mask.json.

    python -m ballast.bench.grammar_mask [--steps 200] [--rounds 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance
import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.step.sampler import Sampler
from ballast.engine.text.grammar import GrammarCompiler
from ballast.engine.text.tokenizer import Tokenizer
from ballast.models.weights.default_model import default_model_path
from ballast.models.weights.gguf_loader import build_tokenizer, read_gguf

RESULTS = Path(__file__).parent / "results" / "grammar_mask.json"
BATCHES = (1, 8, 32)
SCHEMAS: dict[str, dict[str, Any]] = {
    "enum_int": {
        "type": "object",
        "properties": {
            "city": {"enum": ["Paris", "Rome", "San Francisco"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
    "free_text": {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
        "additionalProperties": False,
    },
}


def step_ms(
    sampler: Sampler, params: list[SamplingParams], steps: int, stop: frozenset[int], device: torch.device
) -> float:
    """Median ms of one `sample` call over the batch; rows that drew a stop id start over."""
    batch = len(params)
    slots = list(range(batch))
    gen = torch.Generator(device=device).manual_seed(0)
    times = []
    for step in range(steps + 10):
        logits = torch.randn(batch, sampler.vocab_size, generator=gen, device=device) * 3
        t0 = time.perf_counter()
        out = sampler.sample(logits, slots, params)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if step >= 10:
            times.append(time.perf_counter() - t0)
        done = [s for s, o in zip(slots, out, strict=True) if o.token_id in stop]
        sampler.reset(done)
    return statistics.median(times) * 1000


def xgrammar_fill_ms(tok: Tokenizer, schema: dict[str, Any], batch: int, steps: int) -> float | None:
    """xgrammar's mask fill for `batch` matchers (no sampling), if xgrammar is installed."""
    try:
        import xgrammar as xgr  # type: ignore[import-not-found]
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(
        tok.hf, vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eos_token_ids)
    )
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(schema), any_whitespace=False
    )
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, tok.vocab_size)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, tok.vocab_size, generator=gen)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        times.append(time.perf_counter() - t0)
        for m, token in zip(matchers, logits.argmax(-1).tolist(), strict=True):
            m.accept_token(token)
            if m.is_terminated():
                m.reset()
    return statistics.median(times) * 1000


def llguidance_fill_ms(compiler: GrammarCompiler, schema: dict[str, Any], batch: int, steps: int) -> float:
    """llguidance's mask fill for `batch` matchers (no sampling), the counterpart of the above."""
    constraint = compiler.constraint(compiler.json_schema(schema), 0)
    matchers = [constraint.matcher() for _ in range(batch)]
    words = (compiler.vocab_size + 31) // 32
    bitmask = torch.empty(batch, words, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        logits = torch.randn(batch, compiler.vocab_size, generator=gen)
        t0 = time.perf_counter()
        for i, m in enumerate(matchers):
            row = bitmask[i]
            m.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
        times.append(time.perf_counter() - t0)
        bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).view(batch, -1)[
            :, : compiler.vocab_size
        ]
        for m, token in zip(
            matchers, logits.masked_fill(bits == 0, float("-inf")).argmax(-1).tolist(), strict=True
        ):
            m.consume_token(token)
            if m.is_stopped():
                m.reset()
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    tok = Tokenizer(build_tokenizer(read_gguf(default_model_path()).metadata))
    compiler = GrammarCompiler(tok.hf, tok.vocab_size, tok.eos_token_ids)
    rows: list[dict[str, Any]] = []
    for name, schema in SCHEMAS.items():
        constraint = compiler.constraint(compiler.json_schema(schema), 0)
        for batch in BATCHES:
            free = [SamplingParams(temperature=0.0)] * batch
            bound = [SamplingParams(temperature=0.0, constraint=constraint)] * batch
            plain_ms = min(
                step_ms(Sampler(batch, tok.vocab_size, device), free, args.steps, tok.eos_token_ids, device)
                for _ in range(args.rounds)
            )
            grammar_ms = min(
                step_ms(Sampler(batch, tok.vocab_size, device), bound, args.steps, tok.eos_token_ids, device)
                for _ in range(args.rounds)
            )
            llg = min(llguidance_fill_ms(compiler, schema, batch, args.steps) for _ in range(args.rounds))
            xgr_runs = [xgrammar_fill_ms(tok, schema, batch, args.steps) for _ in range(args.rounds)]
            xgr = min((x for x in xgr_runs if x is not None), default=None)
            rows.append(
                {
                    "schema": name,
                    "batch": batch,
                    "sample_ms": plain_ms,
                    "constrained_sample_ms": grammar_ms,
                    "overhead_ms": grammar_ms - plain_ms,
                    "overhead_us_per_row": (grammar_ms - plain_ms) * 1000 / batch,
                    "llguidance_fill_ms": llg,
                    "xgrammar_fill_apply_ms": xgr,
                }
            )
    print(
        f"device {device}, vocab {tok.vocab_size}, llguidance "
        f"{llguidance.__version__ if hasattr(llguidance, '__version__') else '?'}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'schema':10s} {'batch':>5s} {'sample ms':>10s} {'+grammar ms':>12s} {'overhead ms':>12s} "
        f"{'us/row':>8s} "
        f"{'llg fill ms':>12s} {'xgr fill ms':>12s}"
    )
    for r in rows:
        xgr_text = (
            f"{r['xgrammar_fill_apply_ms']:12.3f}"
            if r["xgrammar_fill_apply_ms"] is not None
            else f"{'-':>12s}"
        )
        print(
            f"{r['schema']:10s} {r['batch']:5d} {r['sample_ms']:10.3f} {r['constrained_sample_ms']:12.3f} "
            f"{r['overhead_ms']:12.3f} {r['overhead_us_per_row']:8.1f} {r['llguidance_fill_ms']:12.3f} "
            f"{xgr_text}"
        )
    report = {
        "device": str(device),
        "vocab": tok.vocab_size,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "steps": args.steps,
        "rounds": args.rounds,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
