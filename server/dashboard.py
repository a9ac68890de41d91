"""The operator's live page: GET /dashboard (one self-contained HTML file, no build step, no CDN)
and GET /dashboard/state (the small JSON document the page polls).

The state endpoint returns raw figures only: the live memory snapshot, the ladder plan, slots,
queue, KV pools, and the cumulative counters and latency histograms. The page turns counters into
rates and histograms into recent TTFT/ITL itself, from the difference between two polls, so the
server keeps no per-viewer state and any number of pages can watch at once. Generated tokens are
the scheduler's live count (each token as it is sampled, so tokens/s moves while long answers
stream, and a request adds exactly its usage.completion_tokens); prompt tokens are counted when a
request ends. Nothing here holds a lock or touches the engine: every figure is a read of an
immutable snapshot or a scheduler gauge.
Like /metrics, both routes are open (no API key): they carry no prompt or output text.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from importlib import resources
from typing import Any

from ballast.memory.types import Level, MemState
from ballast.server.auth import page_dependency
from ballast.server.state import ServerState
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from prometheus_client.registry import Collector

STATE_VERSION = 1


def _page() -> str:
    return resources.files("ballast.server").joinpath("dashboard.html").read_text(encoding="utf-8")


def _memory(s: MemState) -> dict[str, Any]:
    h = s.host
    return {
        "seq": s.seq,
        "level": s.level.name,
        "host_level": s.host_level.name,
        "host": {
            "total_bytes": h.total_bytes,
            "available_bytes": h.available_bytes,
            "effective_total_bytes": h.effective_total_bytes,
            "effective_available_bytes": h.effective_available_bytes,
            "reserve_bytes": s.host_reserve_bytes,
            "budget_bytes": s.host_budget_bytes,
            "psi_some_avg10": h.psi_some_avg10,
            "psi_full_avg10": h.psi_full_avg10,
            "cgroup_version": h.cgroup_version,
            "cgroup_usage_bytes": h.cgroup_usage_bytes,
            "cgroup_high_bytes": h.cgroup_high_bytes,
            "cgroup_max_bytes": h.cgroup_max_bytes,
        },
        "gpus": [
            {
                "index": d.index,
                "name": d.name,
                "total_bytes": d.total_bytes,
                "free_bytes": d.free_bytes,
                "budget_bytes": d.budget_bytes,
                "ledger_bytes": d.ledger_bytes,
                "ceiling_bytes": d.ceiling_bytes,
                "level": d.level.name,
            }
            for d in s.dies
        ],
    }


def _samples(collector: Collector) -> dict[str, list[tuple[dict[str, str], float]]]:
    """A prometheus_client metric's samples by sample name (e.g. `..._bucket`, `..._total`)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in collector.collect():
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def _histogram(collector: Collector, name: str) -> dict[str, Any]:
    """Cumulative count, sum and buckets ([upper bound, cumulative count], +Inf as null)."""
    samples = _samples(collector)
    buckets = [
        [None if labels["le"] == "+Inf" else float(labels["le"]), value]
        for labels, value in samples.get(name + "_bucket", [])
    ]
    return {"count": samples[name + "_count"][0][1], "sum": samples[name + "_sum"][0][1], "buckets": buckets}


def _counter(collector: Collector, name: str) -> float:
    return sum(value for _, value in _samples(collector).get(name + "_total", []))


def state_document(state: ServerState) -> dict[str, Any]:
    """Everything the page shows, as plain JSON."""
    m = state.metrics
    figures = state.scheduler_figures()
    doc: dict[str, Any] = {
        "version": STATE_VERSION,
        "time": time.time(),
        "phase": state.phase.value,
        "model": state.model_name,
        "level": state.level().name,
        "memory": _memory(state.memwatch.read()) if state.memwatch is not None else None,
        "scheduler": None,
        "ladder": None,
        "counters": {
            "generation_tokens": figures.generated_tokens if figures is not None else 0,
            "prompt_tokens": _counter(m.prompt_tokens, "ballast_prompt_tokens"),
            "rejections": {
                labels["status"]: value
                for labels, value in _samples(m.rejections).get("ballast_http_rejections_total", [])
            },
        },
        "latency": {
            "ttft": _histogram(m.ttft, "ballast_time_to_first_token_seconds"),
            "itl": _histogram(m.itl, "ballast_inter_token_latency_seconds"),
        },
    }
    if figures is not None:
        doc["scheduler"] = {
            "queue_depth": figures.queue_depth,
            "active_slots": figures.active_slots,
            "slot_limit": figures.slot_limit,
            "pressure_level": Level(figures.pressure_level).name,
            "preemptions": figures.preemptions,
            "reused_prompt_tokens": figures.reused_prompt_tokens,
            "kv_pools": [
                {"pool": pool, "bytes": nbytes, "used_blocks": used, "spare_blocks": spare}
                for pool, nbytes, used, spare in figures.kv_pools
            ],
        }
    if state.scheduler is not None:
        plan = asdict(state.scheduler.ladder)
        plan["level"] = state.scheduler.ladder.level.name
        doc["ladder"] = plan
    return doc


def install(app: FastAPI, api_key: str | None = None) -> None:
    """The page and its state follow the API key (see server/auth.py)."""
    router = APIRouter(dependencies=[Depends(page_dependency(api_key))])

    @router.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(_page(), headers={"Cache-Control": "no-cache"})

    @router.get("/dashboard/state")
    async def dashboard_state(request: Request) -> JSONResponse:
        state: ServerState = request.app.state.ballast
        return JSONResponse(state_document(state), headers={"Cache-Control": "no-store"})

    app.include_router(router)
