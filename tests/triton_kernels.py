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


def delta_rule_inputs(
    tokens: int,
    batch: int,
    heads: tuple[int, int, int, int],
    g_scale: float,
    state_scale: float,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Random float32 inputs of the gated delta rule on the CPU: q, k [tokens, hk, dk], v [tokens,
    hv, dv], the gate's log decay g [tokens, hv] in (-g_scale, 0], beta [tokens, hv] and a starting
    state [batch, hv, dk, dv]; heads = (hk, hv, dk, dv)."""
    hk, hv, dk, dv = heads
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, hk, dk, generator=gen)
    k = torch.randn(tokens, hk, dk, generator=gen)
    v = torch.randn(tokens, hv, dv, generator=gen)
    g = -torch.rand(tokens, hv, generator=gen) * g_scale
    beta = torch.rand(tokens, hv, generator=gen)
    state = torch.randn(batch, hv, dk, dv, generator=gen) * state_scale
    return q, k, v, g, beta, state
