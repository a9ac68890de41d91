"""The KV usage gateways read: measured against what memory allows now, full while the replica
refuses or holds new work, and never above 1."""

from __future__ import annotations

from ballast.engine.plan import KVFigures
from ballast.memory.types import DieState, GiB, HostSample, MemState
from ballast.server.gateway_metrics import kv_usage, memory_room_bytes

MiB = 1 << 20
BLOCK = MiB  # bytes of one block, every layer


def pool(used: int, free: int, addable: int, cached: int = 0) -> KVFigures:
    return KVFigures(32, BLOCK, free, used, 1, addable, (used + free) * BLOCK, evictable_blocks=cached)


def usage(p: KVFigures, room: int, active: int = 0, limit: int = 8, refusing: bool = False) -> float:
    return kv_usage([p], room, active_slots=active, slot_limit=limit, refusing=refusing)[0]


def test_less_memory_room_makes_the_same_pool_look_fuller() -> None:
    p = pool(used=10, free=10, addable=1000)
    roomy, tight, none = usage(p, 80 * MiB), usage(p, 20 * MiB), usage(p, 0)
    assert roomy == 10 / 100 and tight == 10 / 40 and none == 10 / 20
    assert roomy < tight < none


def test_growth_is_bounded_by_the_pool_limits_as_well_as_by_memory() -> None:
    assert usage(pool(used=10, free=0, addable=10), 1 << 40) == 0.5  # memory is ample, the pool is not
    assert (
        kv_usage([pool(used=10, free=0, addable=10)], 1 << 40, active_slots=0, slot_limit=8, refusing=False)[
            1
        ]
        == 20
    )


def test_blocks_only_the_prefix_cache_holds_count_as_free() -> None:
    assert usage(pool(used=20, free=0, addable=0, cached=20), 0) == 0.0
    assert usage(pool(used=20, free=0, addable=0, cached=5), 0) == 0.75


def test_busy_slots_count_when_they_bind_before_kv() -> None:
    p = pool(used=1, free=99, addable=0)
    assert usage(p, 0, active=2, limit=8) == 0.25
    assert usage(p, 0, active=2, limit=4) == 0.5  # the ladder halved the slots: the same load is fuller


def test_a_replica_that_refuses_or_holds_new_work_is_full() -> None:
    assert usage(pool(used=0, free=100, addable=100), 1 << 40, refusing=True) == 1.0
    assert kv_usage([], 1 << 40, active_slots=0, slot_limit=8, refusing=True)[0] == 1.0


def test_usage_never_exceeds_one() -> None:
    assert usage(pool(used=50, free=0, addable=0), 0, active=9, limit=8) == 1.0


def _state(available: int, dies: tuple[DieState, ...] = ()) -> MemState:
    return MemState(host=HostSample(16 * GiB, available), dies=dies, host_reserve_bytes=2 * GiB)


def test_memory_room_is_host_slack_on_the_cpu() -> None:
    assert memory_room_bytes(_state(5 * GiB), None) == 3 * GiB
    assert memory_room_bytes(_state(GiB), None) == 0


def test_memory_room_on_a_gpu_is_the_ledger_room_the_driver_can_deliver() -> None:
    die = DieState(
        0,
        total_bytes=80 * GiB,
        free_bytes=30 * GiB,
        budget_bytes=79 * GiB,
        ledger_bytes=40 * GiB,
        ceiling_bytes=60 * GiB,
    )
    assert memory_room_bytes(_state(8 * GiB, (die,)), 0) == 20 * GiB  # ceiling - ledger < free - reserve
    squeezed = DieState(
        0,
        total_bytes=80 * GiB,
        free_bytes=6 * GiB,
        budget_bytes=79 * GiB,
        ledger_bytes=40 * GiB,
        ceiling_bytes=60 * GiB,
    )
    assert memory_room_bytes(_state(8 * GiB, (squeezed,)), 0) == 5 * GiB  # another process took the rest
    assert memory_room_bytes(_state(GiB, (die,)), 0) == 0  # the host is inside its reserve
    assert memory_room_bytes(_state(8 * GiB, (die,)), 1) == 0  # a die the snapshot does not know
