"""Engine decode on one GPU against transformers' `generate`: Llama-8B-shaped and Qwen3-Next-shaped
(6.2B, 26 of the 80B's 512 experts) random-weight models, batch 1/32/128 at contexts 128, 2k and
8k; tokens/s and % of the HBM roofline (H200: 4.8 TB/s).

    python -m ballast.bench.gpu_engine [--quick] [--models llama-8b qwen3-next]
    python -m ballast.bench.gpu_engine --device cpu --tiny --quick      # plumbing check on the CPU

The measurement is bench/paged_decode's (its `bench_model`: the model built by transformers with
random weights on the GPU and saved as a HF directory, our engine loading that directory with
CUDA graphs, every slot prefilled through StepPlans, then timed decode steps; the reference is
`generate` on the same in-memory model, decode-only seconds = generate(steps + 1) - generate(1)).
What this script adds: the issue's grid (contexts from 128), the hybrid at the 6.2B shape, and the
roofline against the HBM's rated bandwidth instead of a measured copy, so the figure reads as the
issue's aims do (batch 1 >= 75%, batch 32 at 2k >= 60%). The floor of a step is what it must read
(weights used, each sequence's KV, recurrent state read and written) / --hbm-tb-s; the measured
copy bandwidth is printed beside it. `--quick`: batches 1 and 32, contexts 128 and 2k, 16 steps.
Table on stdout, JSON to bench/results/gpu_engine.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from ballast.bench.paged_decode import WARMUP_STEPS, bench_model, copy_bandwidth, print_table
from ballast.memory.types import GiB
from ballast.models.blocks.gated_delta import fla_installed

RESULTS = Path(__file__).parent / "results" / "gpu_engine.json"
H200_HBM_TB_S = 4.8
QWEN3_NEXT_6B_EXPERTS = 26  # bench/checkpoint_dir's qwen3-next-6b


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", choices=["llama-8b", "qwen3-next"], default=["llama-8b", "qwen3-next"]
    )
    parser.add_argument(
        "--batches", type=int, nargs="+", default=None, help="default 1 32 128 (--quick 1 32)"
    )
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="default 128 2048 8192 (--quick 128 2048)"
    )
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps (default 32, --quick 16)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="small stand-in models (a check on the CPU)")
    parser.add_argument("--experts", type=int, default=QWEN3_NEXT_6B_EXPERTS)
    parser.add_argument("--prefill-chunk", type=int, default=8192)
    parser.add_argument("--no-reference", action="store_true", help="skip transformers' generate")
    parser.add_argument("--reference-max-tokens", type=int, default=65536)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"])
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--hbm-tb-s", type=float, default=H200_HBM_TB_S, help="rated HBM bandwidth, TB/s")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_engine: no CUDA here (a check without a GPU: --device cpu --tiny --quick)")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("gpu_engine: full-size models on the CPU would take hours; add --tiny")
    args.batches = args.batches or ([1, 32] if args.quick else [1, 32, 128])
    args.contexts = args.contexts or ([128, 2048] if args.quick else [128, 2048, 8192])
    args.steps = args.steps or (16 if args.quick else 32)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    args.compile_modes = [True]  # the server's default
    return args


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    measured = copy_bandwidth(device, GiB // 4 if device.type == "cpu" else 2 * GiB)
    # On the CPU there is no rated figure to speak of: the measured copy stands in.
    rated = args.hbm_tb_s * 1e12 if device.type == "cuda" else measured
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"{where}: roofline at {rated / 1e12:.2f} TB/s (a measured copy moves {measured / 1e12:.2f} TB/s), "
        f"{args.dtype}, fla {'installed' if fla_installed() else 'not installed'}",
        flush=True,
    )
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for name in args.models:
        rows.extend(bench_model(name, args, device, dtype, rated))
        write_report(rows, args, where, rated, measured, time.perf_counter() - t0)  # a later one may fail
    print_table(
        rows,
        f"\nengine decode on {where}, {args.steps} timed steps after {WARMUP_STEPS} warm-up, {args.dtype}, "
        f"random weights, % of a {rated / 1e12:.2f} TB/s roofline; {time.perf_counter() - t0:.0f}s",
    )
    print(f"wrote {args.out}")


def write_report(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    where: str,
    rated: float,
    measured: float,
    wall: float,
) -> None:
    for r in rows:
        for side in ("ours", "transformers"):
            if isinstance(r.get(side), dict):
                r[side].pop("tokens", None)
    report = {
        "bench": "gpu_engine",
        "device": where,
        "dtype": args.dtype,
        "roofline_bytes_s": rated,
        "measured_copy_bytes_s": measured,
        "steps": args.steps,
        "qwen3_next_experts": args.experts,
        "tiny": args.tiny,
        "fla": fla_installed(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "wall_s": wall,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
