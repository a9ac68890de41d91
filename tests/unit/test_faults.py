"""Which step failures the engine survives: out-of-memory errors and Python exceptions cost one
step's requests; a CUDA error that poisons the context, or anything that is not an Exception,
makes the engine unsound."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.faults import is_device_fault


@pytest.mark.parametrize(
    "exc",
    [
        MemoryError(),
        torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
        ValueError("a bug"),
        KeyError(3),
        RuntimeError("shape mismatch"),
        IndexError("out of range"),
    ],
)
def test_recoverable(exc: BaseException) -> None:
    assert not is_device_fault(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"),
        RuntimeError("Triton Error [CUDA]: unspecified launch failure"),
        KeyboardInterrupt(),
        SystemExit(1),
    ],
)
def test_device_faults_and_non_exceptions_are_fatal(exc: BaseException) -> None:
    assert is_device_fault(exc)
