"""Which failures inside an engine step the engine survives.

A step touches only the slots its plan names, so a Python exception or an out-of-memory error
costs exactly those sequences: the engine drops them and serves on. A CUDA error that is not an
allocation failure poisons the context (every later kernel fails too): only a restart helps.
"""

from __future__ import annotations

import torch
from ballast.memory.errors import MemoryRefused

# Text of the CUDA runtime / library errors that leave the context unusable. An allocation
# failure is `torch.cuda.OutOfMemoryError` and is checked first: the allocator freed what it
# tried and the context is intact.
_DEVICE_ERROR_MARKS = (
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "cuDNN error",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
    "NCCL error",
    "Triton Error [CUDA]",
)


class WorkerLost(RuntimeError):
    """A tensor-parallel worker is gone or a collective failed: the ranks can no longer run a
    step together, so the engine is unsound (like a poisoned CUDA context)."""


def is_device_fault(exc: BaseException) -> bool:
    """True when `exc` means the device can no longer be trusted (the process must restart)."""
    if not isinstance(exc, Exception):
        return True  # KeyboardInterrupt, SystemExit: never swallowed
    if isinstance(exc, WorkerLost):
        return True
    if isinstance(exc, torch.cuda.OutOfMemoryError | MemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return any(mark in text for mark in _DEVICE_ERROR_MARKS)


def is_memory_fault(exc: BaseException) -> bool:
    """True when a step failed for want of memory (an allocation the device or host refused, or a
    ledger lease): a pressure signal, and a smaller step may succeed where this one failed."""
    return isinstance(exc, MemoryError | torch.cuda.OutOfMemoryError | MemoryRefused)
