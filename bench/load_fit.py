"""The load estimate against the measured peak at start (issue 47): the engine is loaded in this
process for each configuration, the estimate it logs ("load estimate: weights .. = N MiB") is read
back, one max-length sequence is served twice (what the estimate keeps room for; a server serves
more than one, and glibc's heap grew on the second), and the estimate is set
against the peak: on the CPU the process's resident high-water mark (VmHWM) above its resident
size before the load, on a GPU torch's peak reserved bytes. Each case runs in a process of its own
(VmHWM never falls). The estimate must stay within 25% of the peak (no term padded), else a start
that fits is refused; and never under it, else a start that does not fit is let in to OOM.

    python -m ballast.bench.load_fit [--model default] [--case 8x2048 --case 16x8192 ...]

Table on stdout, JSON to bench/results/load_fit.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.generate import generate_stream
from ballast.engine.plan import SamplingParams
from ballast.memory.config import MemoryConfig
from ballast.memory.types import MiB
from ballast.memory.watch import MemWatch

RESULTS = Path(__file__).resolve().parent / "results" / "load_fit.json"
ESTIMATE = re.compile(r"load estimate: (.*) = ([0-9,.]+) MiB")


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def one(model: str, slots: int, length: int, device: str, tokenizer: str | None = None) -> dict[str, Any]:
    capture = _Capture()
    logging.getLogger("ballast.engine.runner.loading").addHandler(capture)
    logging.getLogger("ballast.engine.runner.loading").setLevel(logging.INFO)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved() if cuda else _status_kib("VmRSS") * 1024
    config = EngineConfig(
        model=model, max_num_seqs=slots, max_model_len=length, device=device, tokenizer=tokenizer
    )
    watch = MemWatch(MemoryConfig())
    engine = Engine.load(config, watch)
    try:
        # What the estimate claims room for: one max-length sequence, its prompt in full chunks;
        # twice, as a server serves more than one (glibc's heap grew 12-15 MiB on the second).
        prompt = [(7 * i) % 1000 + 10 for i in range(engine.max_model_len - 4)]
        for _ in range(2):
            for _ in generate_stream(engine, prompt, SamplingParams(temperature=0.0), 2):
                pass
        if cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_reserved() - before
        else:
            peak = _status_kib("VmHWM") * 1024 - before
        est = next((m for m in map(ESTIMATE.search, capture.lines) if m), None)
        estimate = float(est.group(2).replace(",", "")) * MiB if est else float("nan")
        fitted = next((x for x in capture.lines if x.startswith("fitted to memory")), "")
        return {
            "model": model,
            "device": device,
            "max_num_seqs": slots,
            "max_model_len": length,
            "served_max_model_len": engine.max_model_len,
            "estimate_mib": estimate / MiB,
            "estimate_terms": est.group(1) if est else "",
            "peak_at_start_mib": peak / MiB,
            "estimate_over_peak": estimate / peak if peak > 0 else float("nan"),
            "fitted": fitted,
        }
    finally:
        engine.shutdown()
        watch.stop()
        logging.getLogger("ballast.engine.runner.loading").removeHandler(capture)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--case", action="append", default=[], help="SLOTSxLEN (default 8x2048)")
    ap.add_argument("--tokenizer", help="a tokenizer directory (where the default's cannot be fetched)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one case, this process: JSON on stdout
    a = ap.parse_args()
    if a.one:
        slots, length = (int(x) for x in a.one.split("x"))
        print(json.dumps(one(a.model, slots, length, a.device, a.tokenizer)))
        return
    rows = []
    for case in a.case or ["8x2048"]:
        cmd = [sys.executable, "-m", "ballast.bench.load_fit", "--one", case, "--model", a.model]
        cmd += ["--device", a.device, *(["--tokenizer", a.tokenizer] if a.tokenizer else [])]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"case {case} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    head = f"{'slots x len':>14}{'estimate MiB':>14}{'peak MiB':>10}{'est/peak':>10}"
    print(f"\n{'model':<22}{'device':<8}{head}")
    for r in rows:
        shape = f"{r['max_num_seqs']}x{r['max_model_len']}"
        print(
            f"{r['model']:<22}{r['device']:<8}{shape:>14}{r['estimate_mib']:>14.1f}"
            f"{r['peak_at_start_mib']:>10.1f}{r['estimate_over_peak']:>10.2f}"
        )
        print(f"  terms: {r['estimate_terms']}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
