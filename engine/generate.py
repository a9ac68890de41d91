"""`ballast generate`: one prompt through the engine, streamed to the terminal.

No scheduler here: one slot, the prompt prefilled in chunks of the engine's profiled size, then
one decode step per token until an end-of-turn token, the token limit or the slot's capacity.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.engine.runner.loading import LOAD_ERRORS

SLOT = 0


@dataclass
class Generation:
    """Filled in as `generate_stream` runs; final once the iterator is exhausted."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "stop" (eos or stop string) | "length"


def generate_stream(
    engine: Engine,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    max_tokens: int,
    stop: Sequence[str] = (),
    result: Generation | None = None,
) -> Iterator[str]:
    """Yield text deltas of one greedy/sampled continuation of prompt_ids in slot 0."""
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_ids) >= engine.max_model_len:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {engine.max_model_len}")
    result = result if result is not None else Generation()
    detok = engine.new_detokenizer(prompt_ids, stop)
    eos = engine.tokenizer.eos_token_ids
    sampling = {SLOT: params}
    chunk = engine.prefill_chunk_tokens
    out = None
    for start in range(0, len(prompt_ids), chunk):
        part = tuple(prompt_ids[start : start + chunk])
        last = start + len(part) == len(prompt_ids)
        res = engine.submit(
            StepPlan(prefills=(PrefillChunk(SLOT, part, start, last),), sampling=sampling)
        ).result()
        out = res.outputs[0] if res.outputs else None
    pos = len(prompt_ids)
    try:
        while out is not None:
            result.token_ids.append(out.token_id)
            if out.token_id in eos:
                result.finish_reason = "stop"
                break
            text = detok.add(out.token_id)
            if text:
                yield text
            if detok.stopped:
                result.finish_reason = "stop"
                break
            if len(result.token_ids) >= max_tokens or out.at_capacity:
                result.finish_reason = "length"
                break
            res = engine.submit(
                StepPlan(decodes=(DecodeToken(SLOT, out.token_id, pos),), sampling=sampling)
            ).result()
            out = res.outputs[0]
            pos += 1
        tail = detok.flush()
        if tail:
            yield tail
    finally:
        engine.submit(StepPlan(release=(SLOT,))).result()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ballast generate", description="Generate text from one prompt, streamed to stdout."
    )
    p.add_argument(
        "--model", default="default", help="default, builtin:NAME, a .gguf file or a Hugging Face directory"
    )
    p.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request seed for reproducible sampling")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    p.add_argument("--max-model-len", type=int, default=2048)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of `ballast generate` (server/cli.py passes the arguments after the subcommand)."""
    args = build_parser().parse_args(argv)
    if args.max_tokens < 1:
        print("ballast generate: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        config = EngineConfig(
            model=args.model,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=1,
            max_model_len=args.max_model_len,
            prefill_chunk_tokens=min(512, args.max_model_len),
        )
    except ValueError as e:
        print(f"ballast generate: {e}", file=sys.stderr)
        return 2
    try:
        engine = Engine.load(config)
    except LOAD_ERRORS as e:
        print(f"ballast generate: {e}", file=sys.stderr)
        return 1
    try:
        tok = engine.tokenizer
        use_chat = not args.raw and tok.chat_template is not None
        ids = (
            tok.apply_chat_template([{"role": "user", "content": args.prompt}])
            if use_chat
            else tok.encode(args.prompt)
        )
        result = Generation()
        for text in generate_stream(engine, ids, params, args.max_tokens, result=result):
            sys.stdout.write(text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(f"[{len(result.token_ids)} tokens, finish: {result.finish_reason}]", file=sys.stderr)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
