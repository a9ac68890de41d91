"""CPU decode of this checkout's engine against another commit's, side by side in one run: the
default model (SmolLM2-135M GGUF, float32), greedy, each slot prefilled to `context` tokens, then
timed decode steps of the whole batch; each configuration runs old, new, old, new in fresh
processes and the best of each side counts (a burst of load from elsewhere hits both alike).

The other commit is a package root made from a git worktree:

    git worktree add /tmp/old <commit>
    mkdir -p /tmp/oldpkg/ballast && cp /tmp/old/ballast/__init__.py /tmp/oldpkg/ballast/
    for d in memory models engine scheduler server bench; do ln -s /tmp/old/$d /tmp/oldpkg/ballast/$d; done
    python -m ballast.bench.compare_engines --old /tmp/oldpkg [--configs 1x512 8x512 8x2000]

Table on stdout, JSON to bench/results/compare_engines.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results" / "compare_engines.json"


def measure(root: str | None, batch: int, context: int, steps: int, threads: int) -> dict[str, Any]:
    """One process: load, prefill, time decode steps with the engine found at `root` (None: ours)."""
    import torch

    torch.set_num_threads(threads)
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine
    from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan

    greedy = SamplingParams(temperature=0.0)
    eng = Engine.load(
        EngineConfig(
            model="default",
            device="cpu",
            max_num_seqs=batch,
            max_model_len=context + steps + 8,
            prefill_chunk_tokens=1024,
        )
    )
    try:
        gen = torch.Generator().manual_seed(0)
        prompts = {
            s: tuple(torch.randint(3, 49000, (context,), generator=gen).tolist()) for s in range(batch)
        }
        last: dict[int, int] = {}
        for s, p in prompts.items():
            for start in range(0, context, 1024):
                part = p[start : start + 1024]
                res = eng.step(
                    StepPlan(
                        prefills=(PrefillChunk(s, part, start, start + len(part) == context),),
                        sampling={s: greedy},
                    )
                )
            last[s] = res.outputs[0].token_id
        pos = context
        sampling = dict.fromkeys(prompts, greedy)
        t0 = time.perf_counter()
        for _ in range(steps):
            res = eng.step(
                StepPlan(decodes=tuple(DecodeToken(s, last[s], pos) for s in prompts), sampling=sampling)
            )
            last = {o.slot: o.token_id for o in res.outputs}
            pos += 1
        step_s = (time.perf_counter() - t0) / steps
    finally:
        eng.shutdown()
    return {
        "engine": root or "this checkout",
        "batch": batch,
        "context": context,
        "step_ms": 1e3 * step_s,
        "tok_s": batch / step_s,
    }


def run(root: str | None, batch: int, context: int, steps: int, threads: int) -> dict[str, Any]:
    """`measure` in a fresh process running this file as a script (so nothing of ballast is
    imported before the path is set up)."""
    cmd = [sys.executable, __file__, "--measure", root or "", f"{batch}x{context}", str(steps), str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def measure_main(root: str, config: str, steps: str, threads: str) -> None:
    if root:
        # The other commit's package first, and not the editable install's finder, which would
        # resolve `ballast` to this checkout whatever the path says.
        sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.path.insert(0, root)
    batch, context = (int(x) for x in config.split("x"))
    print(json.dumps(measure(root or None, batch, context, int(steps), int(threads))))


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--measure":
        measure_main(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="package root of the other commit (see the module doc)")
    parser.add_argument("--configs", nargs="+", default=["1x512", "8x512", "8x2000"], help="BATCHxCONTEXT")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rows = []
    for cfg in args.configs:
        batch, context = (int(x) for x in cfg.split("x"))
        runs = [
            run(root, batch, context, args.steps, args.threads) for root in (args.old, None, args.old, None)
        ]
        old = min((r for r in runs if r["engine"] != "this checkout"), key=lambda r: r["step_ms"])
        new = min((r for r in runs if r["engine"] == "this checkout"), key=lambda r: r["step_ms"])
        rows.append(
            {
                "batch": batch,
                "context": context,
                "old_step_ms": old["step_ms"],
                "new_step_ms": new["step_ms"],
                "old_tok_s": old["tok_s"],
                "new_tok_s": new["tok_s"],
                "speedup": old["step_ms"] / new["step_ms"],
            }
        )
    print(
        f"CPU decode, default model float32, {args.threads} threads, best of 2 runs per side, {args.steps} "
        "steps"
    )
    print("batch context  old ms/step  new ms/step  old tok/s  new tok/s  new/old")
    for r in rows:
        print(
            f"{r['batch']:5} {r['context']:7} {r['old_step_ms']:12.1f} {r['new_step_ms']:12.1f} "
            f"{r['old_tok_s']:10.1f} "
            f"{r['new_tok_s']:10.1f} {r['speedup']:7.2f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"old": args.old, "rows": rows}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
