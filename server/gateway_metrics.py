"""What gateways read of a replica, under the names they read it by.

Gateways that balance replicas read a model server's load from its /metrics by fixed names: SGLang's
gateway (`smg`) detects ballast as vLLM-compatible (it serves /version) and reads
`vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`; the
Kubernetes Gateway API Inference Extension's endpoint picker reads those and
`vllm:cache_config_info{block_size,num_gpu_blocks}` and `vllm:lora_requests_info` (the Model Server
Protocol). ballast serves them beside its own `ballast_*` series on /metrics, and alone on
/metrics/gateway: a page of five series written here directly (no registry walk, no histogram), for
a picker that scrapes every 50 ms.

The KV usage a gateway sees is measured against what the memory layer allows *now*, not against the
pool's configured size: a replica whose memory is nearly spent looks full to the gateway before it
must refuse, so traffic moves to its siblings while its own requests still finish.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ballast.engine.plan import KVFigures
from ballast.memory.types import Level, MemState
from ballast.server.state import ServerState
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# The series and their labels, as gateways look them up (deploy/k8s/gateway's picker config names them).
SERIES: dict[str, tuple[str, ...]] = {
    "vllm:num_requests_running": ("model_name",),
    "vllm:num_requests_waiting": ("model_name",),
    "vllm:kv_cache_usage_perc": ("model_name",),
    "vllm:cache_config_info": ("block_size", "num_gpu_blocks"),
    "vllm:lora_requests_info": ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
}
HELP: dict[str, str] = {
    "vllm:num_requests_running": "Requests holding a slot (ballast_slots_active)",
    "vllm:num_requests_waiting": "Requests queued for a slot (ballast_queue_depth)",
    "vllm:kv_cache_usage_perc": "Share (0-1) of the KV memory and slots the memory layer allows now that "
    "running requests hold; 1 while the replica refuses or holds new work",
    "vllm:cache_config_info": "KV cache layout: positions per block, and blocks memory allows now",
    "vllm:lora_requests_info": "LoRA adapters: none (the value is the time of this reading)",
}


@dataclass(frozen=True)
class GatewayLoad:
    """One replica's load as a gateway weighs it."""

    running: int  # requests holding a slot
    waiting: int  # requests queued for one
    kv_usage: float  # 0..1: share of what memory allows now that running requests hold
    block_size: int  # positions per KV block (0: no pool yet)
    capacity_blocks: int  # main-pool blocks memory allows now: held ones plus what may still grow


def memory_room_bytes(state: MemState, gpu_die: int | None) -> int:
    """Bytes the KV pool may still take from memory before admission would refuse them: the host's
    slack above its reserve, or, for a GPU-resident engine, the die's ledger room bounded by what the
    driver has free above the die's reserve (and none while the host is inside its reserve)."""
    if gpu_die is None:
        return state.host_budget_bytes
    if state.host.effective_available_bytes <= state.host_reserve_bytes:
        return 0
    for die in state.dies:
        if die.index == gpu_die:
            free_now = max(0, die.free_bytes - (die.total_bytes - die.budget_bytes))
            return min(max(0, die.ceiling_bytes - die.ledger_bytes), free_now)
    return 0  # a die the snapshot does not know has no room (unknown is never "huge")


def kv_usage(
    pools: Sequence[KVFigures], room_bytes: int, *, active_slots: int, slot_limit: int, refusing: bool
) -> tuple[float, int]:
    """(usage 0..1, capacity in main-pool blocks).

    Usage is the larger of two shares, since a new request needs both a slot and KV blocks:
    - KV bytes running sequences hold (blocks only the prefix cache keeps count as free: the pool
      evicts them for a sequence) over the bytes the pool holds plus what it may still grow, which
      is bounded by its limits and by memory's room now;
    - busy slots over the slots the ladder allows now (it halves them at TIGHT).
    A replica that refuses or holds new work (CRITICAL, a refused admission, stale memory signals)
    is full: 1.0, whatever its pool holds.
    """
    main = pools[0] if pools else None
    held = sum((f.used_blocks + f.free_blocks) * f.block_bytes for f in pools)
    in_use = sum((f.used_blocks - f.evictable_blocks) * f.block_bytes for f in pools)
    growth = min(sum(f.addable_bytes for f in pools), max(0, room_bytes))
    allowed = held + growth
    capacity = allowed // main.block_bytes if main is not None and main.block_bytes > 0 else 0
    if refusing:
        return 1.0, capacity
    kv_share = in_use / allowed if allowed > 0 else (1.0 if pools else 0.0)
    slot_share = active_slots / slot_limit if slot_limit > 0 else 1.0
    return min(1.0, max(kv_share, slot_share)), capacity


def gateway_load(state: ServerState) -> GatewayLoad | None:
    """The live figures, or None while the engine loads (nothing to route to yet)."""
    s = state.scheduler
    if s is None or state.engine is None:
        return None
    snapshot = state.memwatch.read() if state.memwatch is not None else None
    # The scheduler's pressure level holds (TIGHT) or refuses (CRITICAL) new work after a refused
    # admission, but it is refreshed only while work waits (the queue re-reads memory every
    # hold_poll_s): with an empty queue a past pin would read "full" forever, the gateway would send
    # nothing, and nothing would refresh it. So it counts only with a queue; the live level counts
    # always.
    refusing = (
        (s.pressure_level >= Level.TIGHT and s.queue_depth > 0)
        or s.memory_stale is not None
        or (snapshot is not None and snapshot.level >= Level.CRITICAL)
    )
    figures = [f for _, f in s.kv_pools]
    room = memory_room_bytes(snapshot, state.engine.gpu_die) if snapshot is not None else 1 << 62
    usage, capacity = kv_usage(
        figures, room, active_slots=s.active_slots, slot_limit=s.slot_limit, refusing=refusing
    )
    block_size = figures[0].block_size if figures else 0
    return GatewayLoad(s.active_slots, s.queue_depth, usage, block_size, capacity)


def _rows(load: GatewayLoad, name: str) -> list[tuple[str, tuple[str, ...], float]]:
    """(series, label values in SERIES order, value) of one reading."""
    return [
        ("vllm:num_requests_running", (name,), load.running),
        ("vllm:num_requests_waiting", (name,), load.waiting),
        ("vllm:kv_cache_usage_perc", (name,), load.kv_usage),
        ("vllm:cache_config_info", (str(load.block_size), str(load.capacity_blocks)), 1.0),
        # ballast serves no LoRA adapters; the series says so (max_lora 0) for pickers that need it.
        ("vllm:lora_requests_info", ("0", "", ""), time.time()),
    ]


class GatewayCollector(Collector):
    """The vLLM-named series gateways scrape, read from the scheduler and MemWatch at scrape time
    (a handful of attribute reads: the endpoint picker scrapes every 50 ms)."""

    def __init__(self, state: ServerState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        load = gateway_load(self._state)
        name = self._state.model_name
        if load is None or name is None:
            return
        for metric, labels, value in _rows(load, name):
            family = GaugeMetricFamily(metric, HELP[metric], labels=SERIES[metric])
            family.add_metric(list(labels), value)
            yield family


def gateway_page(state: ServerState) -> str:
    """The same series in Prometheus' text format, written directly: /metrics/gateway."""
    load = gateway_load(state)
    name = state.model_name
    if load is None or name is None:
        return ""
    out = []
    for metric, values, value in _rows(load, name):
        labels = ",".join(f'{k}="{_escape(v)}"' for k, v in zip(SERIES[metric], values, strict=True))
        out.append(f"# HELP {metric} {HELP[metric]}\n# TYPE {metric} gauge\n")
        out.append(f"{metric}{{{labels}}} {float(value)!r}\n")
    return "".join(out)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
