"""Page-locked host buffers of exactly the size asked, for the checkpoint pool on CUDA.

torch's caching host allocator (`torch.empty(pin_memory=True)`) rounds every pinned block up to
a power of two. Here an anonymous mapping of the bytes asked for is registered with CUDA
(cudaHostRegister), so the GPU's copy engines take it as pinned (`is_pinned()` holds, a
non-blocking device-to-host copy into it is asynchronous), and it is unregistered, then unmapped,
when the last tensor viewing it is freed.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch


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


def pinned(nbytes: int, registration: HostRegistration | None = None) -> torch.Tensor:
    """A 1-D uint8 tensor of exactly `nbytes` of page-locked host memory: an anonymous mapping,
    registered with CUDA, unregistered and unmapped when the last tensor viewing it is freed.

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
    weakref.finalize(region, _unpin, reg.unregister, address, nbytes)
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
