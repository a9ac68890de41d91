"""Load time of the default model's GGUF: ballast's loader vs transformers, side by side.

    python -m ballast.bench.load_time [--repeats 3] [--gguf PATH] [--out bench/results/load_time.json]

Each load runs in a fresh subprocess (cold imports, warm page cache after the first run), timed
inside it; import time is reported apart from load time. The transformers worker also loads ours
afterwards and reports the largest difference over all tensors. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "load_time.json"


def _worker_ours(path: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    import torch
    from ballast.models.weights import gguf_loader as g

    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = g.load_gguf(path, dtype=torch.float32)
    total = time.perf_counter() - t0
    assert model.tensors and model.tokenizer.eos_token_id is not None
    # the same work phase by phase, without the tokenizer/tensor overlap, to see where time goes
    t0 = time.perf_counter()
    gf = g.read_gguf(path)
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.gguf_tensors(gf, g.gguf_config(gf))
    t_tensors = time.perf_counter() - t0
    t0 = time.perf_counter()
    g.build_tokenizer(gf.metadata)
    t_tok = time.perf_counter() - t0
    return {
        "import_s": t_import,
        "load_s": total,
        "read_s": t_read,
        "tensors_s": t_tensors,
        "tokenizer_s": t_tok,
    }


def _worker_transformers(path: Path) -> dict[str, float]:
    t0 = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    t_model = time.perf_counter() - t0
    t0 = time.perf_counter()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    t_tok = time.perf_counter() - t0

    from ballast.models.weights.gguf_loader import load_gguf

    ours = load_gguf(path).tensors
    state = ref.state_dict()
    diff = max(float((t - state[name]).abs().max()) for name, t in ours.items())
    return {"import_s": t_import, "load_s": t_model + t_tok, "model_s": t_model, "tokenizer_s": t_tok,
            "max_abs_diff_vs_ours": diff}  # fmt: skip


def _run_worker(kind: str, path: Path) -> dict[str, float]:
    cmd = [sys.executable, "-m", "ballast.bench.load_time", "--worker", kind, "--gguf", str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def _summary(runs: list[dict[str, float]]) -> dict[str, Any]:
    keys = runs[0].keys()
    return {
        "median": {k: statistics.median(r[k] for r in runs) for k in keys},
        "min": {k: min(r[k] for r in runs) for k in keys},
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="GGUF file (default: the embedded default model)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=_DEFAULT_OUT)
    parser.add_argument("--worker", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gguf is None:
        from ballast.models.weights.default_model import default_model_path

        args.gguf = default_model_path()
    if args.worker:
        fn = _worker_ours if args.worker == "ours" else _worker_transformers
        print(json.dumps(fn(args.gguf)))
        return 0

    load_before = os.getloadavg()
    results: dict[str, list[dict[str, float]]] = {"ours": [], "transformers": []}
    for _ in range(args.repeats):
        for kind in results:  # interleaved, so a burst of machine load hits both alike
            results[kind].append(_run_worker(kind, args.gguf))
    report = {
        "gguf": str(args.gguf),
        "gguf_bytes": args.gguf.stat().st_size,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "ours": _summary(results["ours"]),
        "transformers": _summary(results["transformers"]),
    }  # fmt: skip
    ours, ref = report["ours"]["median"], report["transformers"]["median"]
    print(f"GGUF load, {args.gguf.name}, median of {args.repeats} fresh processes (seconds)")
    print(f"{'':14}{'import':>8}{'load':>8}   breakdown")
    print(
        f"{'ballast':14}{ours['import_s']:8.2f}{ours['load_s']:8.2f}   read {ours['read_s']:.2f}, "
        f"tensors {ours['tensors_s']:.2f}, tokenizer {ours['tokenizer_s']:.2f} (phases re-run apart)"
    )
    print(
        f"{'transformers':14}{ref['import_s']:8.2f}{ref['load_s']:8.2f}   model {ref['model_s']:.2f}, "
        f"tokenizer {ref['tokenizer_s']:.2f}"
    )
    print(
        f"speed-up {ref['load_s'] / ours['load_s']:.1f}x; max |ours - transformers| over all tensors "
        f"{ref['max_abs_diff_vs_ours']:.1e}; load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
