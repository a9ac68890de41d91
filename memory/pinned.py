"""Page-locked host buffers of exactly the size asked, for the checkpoint pool on CUDA.

torch's caching host allocator (`torch.empty(pin_memory=True)`) rounds every pinned block up to
a power of two. Here an anonymous mapping of the bytes asked for is registered with CUDA
(cudaHostRegister), so the GPU's copy engines take it as pinned (`is_pinned()` holds, a
non-blocking device-to-host copy into it is asynchronous), and it is unregistered, then unmapped,
when the last tensor viewing it is freed.

Unregistering blocks its caller while the device works: 1,071 ms to drop a 1 GiB buffer behind 1 s
of GPU work (H200), and HIP's hipHostUnregister synchronises the whole device. So with an
`Unpinner` the last view going only queues the buffer, and the unpinner's own thread unregisters
and unmaps it: whichever thread drops a buffer (the engine thread between steps, the event loop's
idle trim) never waits on the device for it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)


class HostRegistration(NamedTuple):
    """Page-lock a host range for the GPU's copy engines (cudaHostRegister / Unregister)."""

    register: Callable[[int, int], int]  # (address, bytes) -> CUDA error code, 0 on success
    unregister: Callable[[int], object]


def _cuda_registration() -> HostRegistration:
    try:
        cudart = torch.cuda.cudart()
    except (AssertionError, RuntimeError, AttributeError) as e:  # a build or box without CUDA
        raise RuntimeError(f"no CUDA runtime to pin host memory: {e}") from e
    return HostRegistration(
        lambda address, nbytes: int(cudart.cudaHostRegister(address, nbytes, 0)),
        cudart.cudaHostUnregister,
    )


class Unpinner:
    """Unregisters and unmaps freed pinned buffers on a thread of its own, started when a buffer
    is queued and ended when none is left (so an idle unpinner holds no thread)."""

    def __init__(self) -> None:
        # Reentrant: the finalizer that queues a buffer may run inside a garbage collection that
        # this very thread started while holding the lock.
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._queue: deque[tuple[Callable[[int], object], int, int]] = deque()
        self._pending_bytes = 0
        self._thread: threading.Thread | None = None

    @property
    def pending_bytes(self) -> int:
        """Bytes freed by their last view and not yet unmapped."""
        return self._pending_bytes

    def wait(self) -> None:
        """Return once every queued buffer is unregistered and unmapped."""
        with self._idle:
            self._idle.wait_for(lambda: self._thread is None)

    def _queue_unpin(self, unregister: Callable[[int], object], address: int, nbytes: int) -> None:
        # Runs as a finalizer, on whatever thread dropped the last view: it must not block.
        with self._lock:
            if self._thread is None:
                thread = threading.Thread(target=self._run, name="ballast-unpin", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # the interpreter is exiting: no new threads, unpin here
                    _unpin(unregister, address, nbytes)
                    return
                self._thread = thread
            self._queue.append((unregister, address, nbytes))
            self._pending_bytes += nbytes

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None
                    self._idle.notify_all()
                    return
                unregister, address, nbytes = self._queue.popleft()
            try:
                _unpin(unregister, address, nbytes)
            except Exception:  # an unsound device: the pages stay pinned, the process goes on
                log.exception("unpinning a %d-byte checkpoint buffer failed", nbytes)
            with self._lock:
                self._pending_bytes -= nbytes


def pinned(
    nbytes: int, registration: HostRegistration | None = None, unpinner: Unpinner | None = None
) -> torch.Tensor:
    """A 1-D uint8 tensor of exactly `nbytes` of page-locked host memory: an anonymous mapping,
    registered with CUDA, unregistered and unmapped when the last tensor viewing it is freed (by
    `unpinner`'s thread when one is given, else by the thread that drops it).

    Not `torch.empty(pin_memory=True)`: torch's caching host allocator rounds every pinned block
    up to a power of two, so a 73.7 MiB checkpoint of the Qwen3-Next shape took 128 MiB, and the
    prefix cache's byte budget held 43 checkpoints where ~64 fit (H200, `bench/gpu_prefix.py`,
    session 12). RuntimeError if the memory cannot be mapped or pinned (the pool then falls back
    to pageable memory)."""
    reg = registration or _cuda_registration()
    address = _libc.mmap(
        None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0
    )
    if address in (None, _MAP_FAILED):
        raise RuntimeError(f"mmap of {nbytes} bytes failed: {os.strerror(ctypes.get_errno())}")
    error = reg.register(address, nbytes)
    if error != 0:
        _libc.munmap(address, nbytes)
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (CUDA error {error})")
    region = (ctypes.c_uint8 * nbytes).from_address(address)
    # The tensor's storage holds `region`, and every view holds the storage: when the last goes,
    # the region is freed and this runs, unregistering before the pages are unmapped.
    free = _unpin if unpinner is None else unpinner._queue_unpin
    weakref.finalize(region, free, reg.unregister, address, nbytes)
    return torch.frombuffer(region, dtype=torch.uint8)


def _unpin(unregister: Callable[[int], object], address: int, nbytes: int) -> None:
    unregister(address)
    _libc.munmap(address, nbytes)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
