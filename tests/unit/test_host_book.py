"""Host grants held against the budget until the host shows them (issue 31, item 1).

The KV pool on the CPU is a MAP_NORESERVE mapping: a granted segment is no memory until written.
Here the host's figures come from a temp /proc tree that follows this process's real RSS (what
the kernel's MemAvailable would do for our pages), and the pool is the real one, so a grant that
commits nothing, or one forgotten at the next poll, shows up as bytes held beyond the budget.
"""

from __future__ import annotations

from pathlib import Path

import torch
from ballast.engine.kv.kv_budget import segment_grant
from ballast.engine.kv.kv_pool import KVPool
from ballast.memory.config import MemoryConfig
from ballast.memory.host_book import HostBook
from ballast.memory.types import GiB, MiB
from ballast.memory.watch import MemWatch
from ballast.models.kv_store import KVStore, plan_layout
from memfixtures import write_tree

CPU = torch.device("cpu")
TOTAL = 16 * GiB
RESERVE = GiB
BUDGET = 192 * MiB


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_grants_over_three_polls_stay_within_the_budget(tmp_path: Path) -> None:
    """Three polls, the pool asking for every block it can have before each: what it holds stays
    within the one budget, and each granted byte is a resident byte (RSS grew by as much)."""
    base_rss = rss_bytes()

    def host_follows_rss() -> None:  # MemAvailable falls by what we made resident, as the kernel's does
        grown = max(0, rss_bytes() - base_rss)
        write_tree(tmp_path, mem_total=TOTAL, mem_available=(RESERVE + BUDGET - grown) // 1024 * 1024)

    host_follows_rss()
    watch = MemWatch(MemoryConfig(root=str(tmp_path), host_reserve_bytes=RESERVE))
    watch.poll_now()
    layout = plan_layout(4, 4, 64, torch.float32, False, 64, 8192, CPU, segment_bytes=8 * MiB)
    pool = KVPool(KVStore(layout, CPU), segment_grant(watch, None))
    for _ in range(3):
        pool.reserve(layout.capacity_blocks - 1)  # as many as it can get
        host_follows_rss()
        watch.poll_now()
    held = pool.bytes_held
    assert 0 < held <= BUDGET, f"{held / MiB:.0f} MiB held on a {BUDGET / MiB:.0f} MiB budget"
    assert rss_bytes() - base_rss >= held - 8 * MiB  # the pages exist: nothing is granted on paper only
    assert pool.refused > 0
    pool.shrink()  # released segments stop counting at once
    assert watch.exact().host_unseen_bytes == 0
    pool.close()


def test_an_entry_counts_until_a_read_that_began_after_its_commit() -> None:
    book = HostBook()
    grant = book.take(100, lambda: 1000)
    assert grant is not None
    read_before = book.begin_read()  # a poll that began before the pages existed
    grant.committed()
    assert book.unseen(read_before) == 100
    read_after = book.begin_read()
    assert book.unseen(read_after) == 0
    assert book.take(950, lambda: 1000 - book.unseen(-1)) is None  # pending and committed alike count
    book.spent(40)  # a pinned buffer filled now
    assert book.unseen(read_after) == 40
    grant.release()
    grant.release()  # idempotent
    assert book.unseen(-1) == 40
