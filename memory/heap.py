"""The process's own resident memory: what a part of the load holds, read around it, and the heap
handed back once a load's staging is freed.

glibc keeps what a process frees in its heap (its mmap threshold climbs to 32 MiB after the first
large free), so a CPU load's staging (a GGUF's blocks as read, before their records) stayed
resident after it was freed: 89 MiB of the default model's, measured after its load, which the
first prefill then grew past. The load estimate counts the staging as gone before the first step
(weights + max(staging, serving)); `trim` after the load makes that so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import cast

import psutil


def resident_bytes() -> int:
    """This process's resident set, in bytes."""
    return int(psutil.Process().memory_info().rss)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return cast(Callable[[int], int], ctypes.CDLL(name).malloc_trim) if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back this way
        return None


def trim() -> bool:
    """Hand the heap's free pages back to the OS (glibc's malloc_trim); False where there is none."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True
