"""Where the Triton kernel tests run: on CUDA, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1 with triton installed, no GPU needed); skipped otherwise."""

from __future__ import annotations

import os
from types import ModuleType

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def marks(kernels: ModuleType) -> list[pytest.MarkDecorator]:
    """The module marks of a test file of `kernels` (a module whose `triton` is None without it)."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    runs = kernels.triton is not None and (torch.cuda.is_available() or interpreted)
    reason = "needs CUDA and Triton (or Triton's interpreter)"
    return [pytest.mark.gpu, pytest.mark.skipif(not runs, reason=reason)]
