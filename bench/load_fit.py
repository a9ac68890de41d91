"""The load estimate against the measured peak at start (issue 47): the engine is loaded in this
process for each configuration, the estimate it logs ("load estimate: weights .. = N MiB") is read
back, one max-length sequence is served twice (what the estimate keeps room for; a server serves
more than one, and glibc's heap grew on the second), and the estimate is set
against the peak: on the CPU the process's resident high-water mark (VmHWM) above its resident
size before the load, on a GPU torch's peak reserved bytes. Each case runs in a process of its own
(VmHWM never falls). The estimate must stay within 25% of the peak (no term padded), else a start
that fits is refused; and never under it, else a start that does not fit is let in to OOM.

On a GPU each row also says where the bytes went: torch's allocated and reserved bytes after each
phase of the start (the weights, the prefill profile, the graphs' capture, the warm-up, serving),
and with `--segments` the caching allocator's segments alive at the reserved peak, summed by the
innermost ballast frame that asked for them (torch's allocation history, segment events only).

    python -m ballast.bench.load_fit [--model default] [--case 8x2048 --case 16x8192 ...] [--segments]

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


class _Phases:
    """torch's allocated / reserved / peak-reserved MiB after each phase of the start: the startup
    module's steps wrapped in this process only (a bench's view, nothing the engine keeps)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._undo: list[tuple[object, str, Any]] = []

    def read(self, phase: str) -> None:
        torch.cuda.synchronize()
        self.rows.append(
            {
                "phase": phase,
                "allocated_mib": round(torch.cuda.memory_allocated() / MiB, 1),
                "reserved_mib": round(torch.cuda.memory_reserved() / MiB, 1),
                "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / MiB, 1),
            }
        )

    def wrap(self, owner: object, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            self.read(phase)
            return out

        self._undo.append((owner, name, inner))
        setattr(owner, name, wrapped)

    def __enter__(self) -> _Phases:
        from ballast.engine import startup
        from ballast.engine.graphs.graph_runner import GraphRunner

        self.read("before the load")
        self.wrap(startup, "load", "weights loaded")
        self.wrap(startup, "profile_prefill", "prefill profiled")
        self.wrap(GraphRunner, "capture_at_start", "graphs captured")
        self.wrap(startup, "warm_up", "warmed up")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, inner in reversed(self._undo):
            setattr(owner, name, inner)


def segments_at_peak(snapshot: dict[str, Any], top: int = 15) -> list[tuple[str, float]]:
    """From torch's allocation history (segment events): the segments alive when reserved bytes
    peaked, summed by the innermost ballast frame of the call that made each (MiB, largest first)."""
    alive: dict[int, tuple[int, str]] = {}
    at_peak: dict[int, tuple[int, str]] = {}
    reserved = peak = 0
    for event in (e for trace in snapshot.get("device_traces", []) for e in trace):
        action, addr, size = event.get("action"), event.get("addr", 0), event.get("size", 0)
        if action in ("segment_alloc", "segment_map"):
            frames = event.get("frames") or []
            where = next(
                (f"{f['filename'].split('/ballast/')[-1]}:{f['line']} {f['name']}" for f in frames
                 if "/ballast/" in f.get("filename", "") and "/bench/" not in f["filename"]),
                frames[0]["name"] if frames else "?",
            )  # fmt: skip
            alive[addr] = (size, where)
            reserved += size
            if reserved > peak:
                peak, at_peak = reserved, dict(alive)
        elif action in ("segment_free", "segment_unmap") and addr in alive:
            reserved -= alive.pop(addr)[0]
    sums: dict[str, int] = {}
    for size, where in at_peak.values():
        sums[where] = sums.get(where, 0) + size
    return [(w, round(n / MiB, 1)) for w, n in sorted(sums.items(), key=lambda x: -x[1])[:top]]


def _record_segments() -> None:
    import inspect

    record = torch.cuda.memory._record_memory_history
    kwargs: dict[str, Any] = {"context": "all", "stacks": "python", "max_entries": 6_000_000}
    if "skip_actions" in inspect.signature(record).parameters:  # else every allocation, in a long ring
        kwargs["skip_actions"] = ["alloc", "free_requested", "free_completed"]
    record(enabled="all", **kwargs)


def one(
    model: str, slots: int, length: int, device: str, tokenizer: str | None = None, segments: bool = False
) -> dict[str, Any]:
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
    phases = _Phases()
    if cuda and segments:
        _record_segments()
    if cuda:
        with phases:
            engine = Engine.load(config, watch)
    else:
        engine = Engine.load(config, watch)
    try:
        # What the estimate claims room for: one max-length sequence, its prompt in full chunks;
        # twice, as a server serves more than one (glibc's heap grew 12-15 MiB on the second).
        prompt = [(7 * i) % 1000 + 10 for i in range(engine.max_model_len - 4)]
        for _ in range(2):
            for _ in generate_stream(engine, prompt, SamplingParams(temperature=0.0), 2):
                pass
        if cuda:
            phases.read("served")
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
            "phases": phases.rows,
            "segments_at_peak": segments_at_peak(torch.cuda.memory._snapshot()) if cuda and segments else [],
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
    ap.add_argument("--segments", action="store_true", help="on a GPU: the segments at the peak, by frame")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # one case, this process: JSON on stdout
    a = ap.parse_args()
    if a.one:
        slots, length = (int(x) for x in a.one.split("x"))
        print(json.dumps(one(a.model, slots, length, a.device, a.tokenizer, a.segments)))
        return
    rows = []
    for case in a.case or ["8x2048"]:
        cmd = [sys.executable, "-m", "ballast.bench.load_fit", "--one", case, "--model", a.model]
        cmd += ["--device", a.device, *(["--tokenizer", a.tokenizer] if a.tokenizer else [])]
        cmd += ["--segments"] if a.segments else []
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
        for p in r["phases"]:
            mib = " / ".join(f"{p[k]:,.1f}" for k in ("allocated_mib", "reserved_mib", "peak_reserved_mib"))
            print(f"  {p['phase']:<18} allocated / reserved / peak reserved {mib} MiB")
        for where, mib in r["segments_at_peak"]:
            print(f"  {mib:>10,.1f} MiB  {where}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
