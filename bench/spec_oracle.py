"""What a verify step costs against a decode step, with an oracle drafter (bench only).

    python -m ballast.bench.spec_oracle [--models qwen3-next-6b qwen3-next-80b-a3b-fp8] [--k 3]
        [--prompt 256] [--tokens 64] [--device cuda] [--dtype auto] [--out FILE]

The drafts here come from no model: `OracleDrafter` replays the target's own greedy tokens from a
first run without drafts, so acceptance is whatever the bench sets, 100% or 50% (the wrong draft
moves through positions 0..k so the accepted count cycles k, 0, 1, .., k-1: half on average at
k = 3). It measures the ceiling drafting can reach on this model and GPU, and the cost of
verifying k drafts; no server path uses it. Issue 49's aims: a verify step of k = 3 costs at most
1.3x a decode step, and at 100% acceptance one stream runs at least 2.5x the tokens per second.

Per model, one stream (slot 0), greedy, through `Engine.submit` one step at a time (no step
ahead), the engine as the server builds it (decode CUDA graphs where the device has them):
  1. plain: the prompt, then --tokens decode steps; each step timed;
  2. the oracle: the text a run drafting it at 100% reproduces (`settled`, up to --settle verify
     runs, each drafting the last one's output, from the plain run's). A verify step's logits can
     differ from a decode step's in the last bits, and a greedy tie then parts the texts (s26, the
     6.2B in bf16: at the first verify step; s29, the 80B FP8: at token 2); past that token an
     oracle of the plain text drafts a text that is not being written, and every draft is rejected;
  3. oracle 100% and oracle 50%: the same prompt again, then steps carrying k drafts each from
     the oracle until --tokens tokens are out; each step timed.
Reported: the median decode step and verify step (ms), their ratio, tokens/s of each run and the
speed-up (and the speed-up k + 1 tokens a step would give at the median verify step's cost), how
many verify graphs were captured and how many of each run's verify steps replayed one (a step of
fewer drafts, near the run's end, runs eagerly), the measured acceptance, whether each run's text
equals the oracle's and where it first parts from it, and whether the oracle is the plain run's
text. Steps replaying verify graphs: the engine loaded for verify steps of one row of k drafts
(`VerifySize(1, k)`), as a server with `--speculative-config` is for its own.
Table on stdout, JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from ballast.bench.paged_decode import free_device_memory, read_model, sync
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.engine.workspace import VerifySize
from ballast.models.arch.builtin import builtin_config

GREEDY = SamplingParams(temperature=0.0)
# Rated HBM bandwidth by the card's name (bytes/s): what a step's bytes are put against
RATED_HBM = {"H100": 3.35e12, "H200": 4.8e12}
SLOT = 0
RESULTS = Path(__file__).parent / "results" / "spec_oracle.json"


@dataclass
class OracleDrafter:
    """Bench only: drafts are the target's own greedy tokens of an earlier run (`tokens`, the
    output after the prompt); `acceptance` 1.0 drafts them as they are, 0.5 puts one wrong token
    at a position that cycles through 0..k (k: none wrong), so the accepted count cycles."""

    tokens: list[int]
    k: int
    acceptance: float
    vocab: int
    _step: int = 0

    def draft(self, emitted: int) -> tuple[int, ...]:
        """k drafts after the first `emitted` output tokens (fewer near the run's end)."""
        drafts = list(self.tokens[emitted : emitted + self.k])
        if self.acceptance < 1.0 and drafts:
            wrong_at = self._step % (self.k + 1)
            if wrong_at < len(drafts):
                drafts[wrong_at] = (drafts[wrong_at] + 1) % self.vocab
        self._step += 1
        return tuple(drafts)


def _step(engine: Engine, plan: StepPlan) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    res = engine.submit(plan).result(timeout=300)
    sync(engine.device)
    return [o.token_id for o in res.outputs if o.slot == SLOT], time.perf_counter() - t0


def _start(engine: Engine, prompt: tuple[int, ...]) -> int:
    """The prompt in one chunk after the slot's release; its first token."""
    plan = StepPlan(prefills=(PrefillChunk(SLOT, prompt, 0, True),), sampling={SLOT: GREEDY}, release=(SLOT,))
    out, _ = _step(engine, plan)
    return out[0]


def plain_run(engine: Engine, prompt: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
    """The prompt, then n decode steps: (the output tokens, each step's seconds)."""
    out, times = [_start(engine, prompt)], []
    while len(out) < n + 1:
        pos = len(prompt) + len(out) - 1
        toks, dt = _step(
            engine, StepPlan(decodes=(DecodeToken(SLOT, out[-1], pos),), sampling={SLOT: GREEDY})
        )
        out += toks
        times.append(dt)
    return out, times


def oracle_run(
    engine: Engine, prompt: tuple[int, ...], n: int, drafter: OracleDrafter
) -> tuple[list[int], list[float], int, int]:
    """The prompt, then verify steps with the drafter's drafts until n more tokens are out:
    (output tokens, each step's seconds, drafts proposed, drafts accepted)."""
    out, times, drafted, accepted = [_start(engine, prompt)], [], 0, 0
    while len(out) < n + 1:
        pos = len(prompt) + len(out) - 1
        room = n + 1 - len(out) - 1
        draft = drafter.draft(len(out))[: max(0, room)]
        toks, dt = _step(
            engine, StepPlan(decodes=(DecodeToken(SLOT, out[-1], pos, draft),), sampling={SLOT: GREEDY})
        )
        drafted += len(draft)
        accepted += len(toks) - 1
        out += toks
        times.append(dt)
    return out[: n + 1], times, drafted, accepted


def settled(
    engine: Engine, prompt: tuple[int, ...], n: int, plain: list[int], k: int, runs: int
) -> tuple[list[int], int]:
    """The oracle text a 100% run reproduces, and the verify runs it took: each run drafts the last
    one's output. A verify row's logits can part from a decode step's in the last bits (bf16, random
    weights: the 80B FP8 at its second token, s29); a run emits the verify path's own choice at the
    first such token and agrees with every row before it, so each run fixes at least one more
    position of the rows a 100% run lays out. `runs` 0: the plain run's text as it is."""
    tokens = plain
    for i in range(runs):
        out = oracle_run(engine, prompt, n, OracleDrafter(tokens, k, 1.0, engine.vocab_size))[0]
        if out == tokens:
            return tokens, i + 1
        tokens = out
    return tokens, runs


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = Engine.load(
        EngineConfig(
            model="builtin:" + name,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=2,
            max_model_len=args.prompt + args.tokens + 2 * args.k + 16,
            prefill_chunk_tokens=max(256, args.prompt),
        ),
        verify=VerifySize(1, args.k),  # a hybrid's rejected drafts: the states its verify step kept
    )
    load_s = time.perf_counter() - t0
    try:
        vocab = engine.vocab_size
        graphs = engine.runner.graph_runner.verify_graphs  # None: verify steps run eagerly
        prompt = tuple(
            torch.randint(3, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
        )
        plain_run(engine, prompt, min(8, args.tokens))  # warm-up: graphs, kernels' first calls
        oracle_run(engine, prompt, min(8, args.tokens), OracleDrafter([0] * 16, args.k, 0.5, vocab))
        plain, decode_s = plain_run(engine, prompt, args.tokens)
        tokens, settle_runs = settled(engine, prompt, args.tokens, plain, args.k, args.settle)
        row: dict[str, Any] = {
            "model": name,
            "device": torch.cuda.get_device_name() if engine.device.type == "cuda" else "cpu",
            "dtype": args.dtype,
            "k": args.k,
            "load_s": round(load_s, 1),
            "decode_step_ms": 1e3 * statistics.median(decode_s),
            "plain_tok_s": len(decode_s) / sum(decode_s),
            "verify_graphs": graphs.captured if graphs is not None else 0,
            "oracle_settle_runs": settle_runs,
            "oracle_is_plain_text": tokens == plain,
        }
        # the steps' bytes, their floor at the card's rated bandwidth, and how near each step ran
        rated = next((bw for card, bw in RATED_HBM.items() if card in row["device"]), None)
        bytes_of = read_model(engine, builtin_config(name)).step_bytes  # routing uniform, as random weights
        context = args.prompt + args.tokens / 2
        decode_b, verify_b = bytes_of(1, context), bytes_of(1, context, args.k + 1)
        row["decode_step_gb"], row["verify_step_gb"] = decode_b / 1e9, verify_b / 1e9
        row["verify_floor_over_decode"] = verify_b / decode_b
        row["speedup_at_the_floor"] = (args.k + 1) * decode_b / verify_b
        if rated is not None:
            row["decode_hbm_pct"] = 100 * decode_b / rated / (row["decode_step_ms"] / 1e3)
        for acceptance in (1.0, 0.5):
            drafter = OracleDrafter(tokens, args.k, acceptance, vocab)
            replays = graphs.replays if graphs is not None else 0
            out, verify_s, drafted, accepted = oracle_run(engine, prompt, args.tokens, drafter)
            tag = f"oracle{round(acceptance * 100)}"
            row[f"{tag}_verify_steps"] = len(verify_s)
            row[f"{tag}_verify_replays"] = (graphs.replays if graphs is not None else 0) - replays
            row[f"{tag}_verify_step_ms"] = 1e3 * statistics.median(verify_s)
            row[f"{tag}_verify_over_decode"] = row[f"{tag}_verify_step_ms"] / row["decode_step_ms"]
            row[f"{tag}_tok_s"] = (len(out) - 1) / sum(verify_s)
            row[f"{tag}_speedup"] = row[f"{tag}_tok_s"] / row["plain_tok_s"]
            row[f"{tag}_acceptance"] = accepted / drafted if drafted else 0.0
            # what k + 1 tokens a verify step would give at this step cost, whatever was accepted
            # (random weights in bf16 tie often, and a text that parts leaves every draft rejected)
            row[f"{tag}_speedup_if_all_accepted"] = (args.k + 1) / row[f"{tag}_verify_over_decode"]
            if rated is not None:
                row[f"{tag}_verify_hbm_pct"] = 100 * verify_b / rated / (row[f"{tag}_verify_step_ms"] / 1e3)
            row[f"{tag}_same_text"] = out == tokens
            row[f"{tag}_parted_at"] = next(
                (i for i, (a, b) in enumerate(zip(out, tokens, strict=True)) if a != b), None
            )
        return row
    finally:
        engine.shutdown()
        del engine
        free_device_memory()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3-next-6b", "qwen3-next-80b-a3b-fp8"])
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto", help="as the server's --dtype (float32: no bf16 ties)")
    p.add_argument(
        "--settle", type=int, default=32, help="verify runs at most to find the text a 100%% run reproduces"
    )
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    rows = []
    for name in args.models:
        rows.append(bench_model(name, args))
        r = rows[-1]
        print(
            f"{name} on {r['device']} (load {r['load_s']} s), k={args.k}: "
            f"decode step {r['decode_step_ms']:.2f} ms, {r['plain_tok_s']:.1f} tok/s; oracle: "
            + ("the plain run's text" if r["oracle_is_plain_text"] else "not the plain run's text")
            + f", reproduced after {r['oracle_settle_runs']} verify run(s)",
            flush=True,
        )
        hbm = f" ({r['decode_hbm_pct']:.0f}% of HBM)" if "decode_hbm_pct" in r else ""
        print(
            f"  bytes a step moves: decode {r['decode_step_gb']:.2f} GB{hbm}, "
            f"verify {r['verify_step_gb']:.2f} GB (uniform routing): a verify step's floor is "
            f"{r['verify_floor_over_decode']:.2f}x a decode step's, "
            f"{r['speedup_at_the_floor']:.2f}x tok/s at 100% with both at the floor",
            flush=True,
        )
        for tag in ("oracle100", "oracle50"):
            hbm = f" ({r[f'{tag}_verify_hbm_pct']:.0f}% of HBM)" if f"{tag}_verify_hbm_pct" in r else ""
            print(
                f"  {tag}: verify step {r[f'{tag}_verify_step_ms']:.2f} ms{hbm} = "
                f"{r[f'{tag}_verify_over_decode']:.2f}x a decode step (aim <= 1.3); "
                f"{r[f'{tag}_tok_s']:.1f} tok/s = {r[f'{tag}_speedup']:.2f}x "
                f"(aim at 100%: >= 2.5x; {r[f'{tag}_speedup_if_all_accepted']:.2f}x at this step cost "
                f"if all were accepted); acceptance {r[f'{tag}_acceptance']:.2f}; "
                f"same text as the oracle: {r[f'{tag}_same_text']}; {r[f'{tag}_verify_replays']} of "
                f"{r[f'{tag}_verify_steps']} verify steps replayed a graph ({r['verify_graphs']} captured)"
                + ("" if r[f"{tag}_parted_at"] is None else f" (parted at token {r[f'{tag}_parted_at']})"),
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"k": args.k, "prompt": args.prompt, "tokens": args.tokens, "rows": rows}, indent=1)
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
