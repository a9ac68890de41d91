"""paged_decode's models (random weights saved as a Hugging Face directory, loaded as a user loads
one, prefix cache off) through decode_profile's loop: each decode step submitted alone and waited
for, unprofiled then under torch.profiler, so a one-step figure of paged_decode comes with the GPU
busy time and the kernel count of the same step.

    python -m ballast.bench.paged_step_profile [--model qwen3-next] [--batch 1 32 1] [--work-dir DIR]

--work-dir keeps the saved model between runs (it is built there once), so two trees can be timed
on the same weights: run it from each tree's root with PYTHONPATH set to that root (it imports
only `paged_decode.model_config` / `hf_random_model` and `decode_profile.profile_steps`, which the
older trees have too). Table on stdout, JSON to bench/results/paged_step_profile.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from ballast.bench.decode_profile import profile_steps
from ballast.bench.paged_decode import hf_random_model, model_config
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine

try:
    from ballast.engine.config import PrefixCacheConfig
except ImportError:  # trees before the rebuild kept it beside the cache
    from ballast.engine.kv.prefix_cache import PrefixCacheConfig  # type: ignore[no-redef,attr-defined,unused-ignore]

RESULTS = Path(__file__).parent / "results" / "paged_step_profile.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-next", choices=["qwen3-next", "llama-8b"])
    ap.add_argument("--experts", type=int, default=64, help="routed experts of qwen3-next (paged_decode's)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 1], help="one profile each, in order")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--work-dir", type=Path, default=None, help="where the model is saved (kept)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ballast-step-profile-"))
    cfg = model_config(args.model, False, args.experts)
    if not (work / "config.json").exists():
        t = time.perf_counter()
        hf = hf_random_model(cfg, torch.device("cuda"), torch.bfloat16)
        hf.save_pretrained(str(work))
        del hf
        torch.cuda.empty_cache()
        print(f"{args.model}: built and saved in {time.perf_counter() - t:.0f} s to {work}", flush=True)
    engine = Engine.load(
        EngineConfig(
            model=str(work),
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=max(args.batch),
            max_model_len=args.context + 2 * args.steps + 160,
            prefill_chunk_tokens=8192,
            cuda_graphs=True,
        ),
        prefix_cache=PrefixCacheConfig(fraction=0.0),
    )
    rows = []
    try:
        for batch in args.batch:
            r = profile_steps(engine, batch, args.context, args.steps, int(cfg["vocab_size"]))
            rows.append({"model": args.model, "batch": batch, "context": args.context, **r})
    finally:
        engine.shutdown()
    print("| model | batch | step wall ms | profiled ms | GPU busy ms | kernels |\n|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['batch']} | {r['wall_ms']:.2f} | {r['profiled_wall_ms']:.2f} | "
            f"{r['gpu_busy_ms']:.3f} | {r['kernels_per_step']:.0f} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
