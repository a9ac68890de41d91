"""A step trace of a `ballast serve` child, for finding where a serving bench's time goes: with this
folder first on PYTHONPATH and STEP_TRACE=FILE in the environment, every Python started appends to
FILE one line per

- `S t0 host_s prefill_tokens chunks decodes done`: an `Engine.submit` (perf_counter seconds; done:
  when its future resolved),
- `L t0 wall_s cpu_s` / `F t0 wall_s cpu_s`: an `Engine.launch` / `Engine.finish` on the engine
  thread (cpu_s: that thread's CPU time; a CUDA wait that spins counts there too),
- `A t prompt_tokens`: a `Scheduler.submit` (a request reaching the scheduler).

STEP_PROFILE=N also writes FILE.prof.txt: cProfile of the launches of N steps with >= 2 prompt
chunks (from the 10th such step). Nothing is changed but the timing; `bench/step_trace_report.py`
reads the file. Not imported by ballast itself: python runs it at start-up (the site module).

    PYTHONPATH=bench/step_trace STEP_TRACE=/tmp/trace.txt python -m ballast.bench.gpu_serve --quick \\
        --shape llama-3b --reference none --no-engine-rate --streams 128
    python bench/step_trace_report.py /tmp/trace.txt
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

PATH = os.environ.get("STEP_TRACE")


def _engine(mod: ModuleType, out: Any) -> None:
    cls = mod.Engine
    submit, launch, finish = cls.submit, cls.launch, cls.finish

    def traced_submit(self: Any, plan: Any) -> Any:
        t0 = time.perf_counter()
        fut = submit(self, plan)
        rec = (t0, time.perf_counter() - t0, sum(len(c.token_ids) for c in plan.prefills), len(plan.prefills))
        row = (*rec, len(plan.decodes))

        def done(_: Any) -> None:
            out.write(" ".join(["S", *map(str, row), str(time.perf_counter())]) + "\n")

        fut.add_done_callback(done)
        return fut

    def timed(tag: str, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def wrapper(self: Any, arg: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(self, arg)
            finally:
                took, used = time.perf_counter() - wall, time.thread_time() - cpu
                out.write(f"{tag} {wall} {took} {used}\n")

        return wrapper

    cls.submit, cls.launch, cls.finish = traced_submit, timed("L", launch), timed("F", finish)
    steps = int(os.environ.get("STEP_PROFILE", "0"))
    if steps:
        cls.launch = _profiled(cls.launch, steps)


def _profiled(launch: Callable[[Any, Any], Any], steps: int) -> Callable[[Any, Any], Any]:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    counts = {"mixed": 0, "profiled": 0}

    def wrapper(self: Any, plan: Any) -> Any:
        if len(plan.prefills) < 2:
            return launch(self, plan)
        counts["mixed"] += 1
        if not 10 <= counts["mixed"] < 10 + steps:
            return launch(self, plan)
        prof.enable()
        try:
            return launch(self, plan)
        finally:
            prof.disable()
            counts["profiled"] += 1
            if counts["profiled"] == steps:
                buf = io.StringIO()
                stats = pstats.Stats(prof, stream=buf)
                stats.sort_stats("cumulative").print_stats(45)
                stats.sort_stats("tottime").print_stats(30)
                with open(f"{PATH}.prof.txt", "w") as f:
                    f.write(buf.getvalue())

    return wrapper


def _scheduler(mod: ModuleType, out: Any) -> None:
    cls = mod.Scheduler
    submit = cls.submit

    def traced(self: Any, req: Any) -> Any:
        out.write(f"A {time.perf_counter()} {len(req.prompt_ids)}\n")
        return submit(self, req)

    cls.submit = traced


class _Patch(importlib.abc.MetaPathFinder):
    """Runs a patch on a module right after it executes, the first time it is imported."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.patches: dict[str, Callable[[ModuleType, Any], None]] = {
            "ballast.engine.engine": _engine,
            "ballast.scheduler.scheduler": _scheduler,
        }

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        patch = self.patches.pop(name, None)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            if self.patches:
                sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        out = self.out

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module, out)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if PATH:
    sys.meta_path.insert(0, _Patch(open(PATH, "a", buffering=1)))  # noqa: SIM115 (open while python runs)
