"""The pointwise pieces of a decoder layer (norms, rope, gated activations), one kernel each on CUDA.

In torch an RMSNorm in bf16 is eight kernels, rope five and SwiGLU's gate two: at decode their
launches are most of a layer's non-GEMM time (H200, an 8B at batch 1: 23 of 35 kernels a layer,
~1.6 of a 5.7 ms step). Inside `fused()`, where the decode graphs warm up and capture, each function
here runs compiled by `torch.compile` (one inductor kernel, dynamic shapes, compiled at warm-up and
so outside any capture); elsewhere, and where compiling fails, the eager code below runs. Only
inside: a replayed graph costs the host nothing, but an eager step pays dynamo's guards on every
call, more than the launches saved (Llama-8B, a 1,024-token prefill: 47.6 ms compiled, 35.1 ms
eager). Eager CUDA steps of many tokens run rope and SwiGLU's gate as `pointwise_triton` kernels.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from ballast.models.kernels import pointwise_triton
from torch import Tensor

log = logging.getLogger(__name__)

# The engine sets this from its config (`--compile`, BALLAST_COMPILE).
_state = {"enabled": True}
_capturing = threading.local()  # .on: this thread is inside fused()
_compiled: dict[str, Callable[..., Any]] = {}
F_ = TypeVar("F_", bound=Callable[..., Any])


def set_enabled(enabled: bool) -> None:
    """Compile on CUDA (True) or run the eager code everywhere (False)."""
    _state["enabled"] = enabled


def enabled() -> bool:
    return _state["enabled"]


@contextmanager
def fused() -> Iterator[None]:
    """The compiled kernels run inside this block, on this thread (a decode graph's warm-up and
    capture); everywhere else the eager code does."""
    before = getattr(_capturing, "on", False)
    _capturing.on = True
    try:
        yield
    finally:
        _capturing.on = before


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Normalise in float32 (`F.rms_norm`: one kernel even in an eager step, where the written-out
    form is six), scale in the input dtype (as the reference does, for bf16 parity)."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def _centered_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm whose weight is stored around 0 and applied as (1 + weight), in float32."""
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * (1.0 + weight.float())).to(x.dtype)


def _add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(x + delta, its RMSNorm): a residual add and the next norm, one kernel when compiled."""
    s = x + delta
    return s, _rms_norm(s, weight, eps)


def _centered_add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    s = x + delta
    return s, _centered_rms_norm(s, weight, eps)


def _gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of x, scaled, times silu(gate)."""
    return (weight * F.rms_norm(x, (x.shape[-1],), eps=eps) * F.silu(gate.float())).to(x.dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, head_dim] rotated (half-split layout, as HF checkpoints expect); with partial
    rotary only the first cos.shape[-1] dims turn."""
    rot = cos.shape[-1]
    c, s = cos[:, None, :], sin[:, None, :]
    if rot == x.shape[-1]:
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s
    xr, xp = x[..., :rot], x[..., rot:]
    x1, x2 = xr.chunk(2, dim=-1)
    return torch.cat((xr * c + torch.cat((-x2, x1), dim=-1) * s, xp), dim=-1)


def _sigmoid_mul(x: Tensor, gate: Tensor) -> Tensor:
    """x * sigmoid(gate), gate any view of x's shape (an output gate read from its projection)."""
    return x * torch.sigmoid(gate.reshape(x.shape))


def _silu_mul(gate_up: Tensor, n: int) -> Tensor:
    """silu(gate) * up of a fused [T, 2n] gate|up projection."""
    return F.silu(gate_up[:, :n]) * gate_up[:, n:]


def _allow_variants() -> None:
    """Each call site's layout (a whole row, a strided per-head view; one token or many) is a
    compiled variant, and dynamo's default of 8 per function would send later ones back to eager
    code (other rounding) mid-model. All are made during the engine's warm-up; 64 is plenty."""
    config = torch._dynamo.config
    for limit in ("recompile_limit", "cache_size_limit"):
        if hasattr(config, limit):
            setattr(config, limit, max(getattr(config, limit), 64))


def _on_cuda(name: str, eager: F_, large: Callable[..., Any] | None = None) -> F_:
    """`eager` compiled inside `fused()` on CUDA; outside it, `large` (a Triton kernel of the same
    maths, `pointwise_triton`) for CUDA steps of many tokens where given, else `eager`."""

    def run(*args: Any) -> Any:
        if not (_state["enabled"] and getattr(_capturing, "on", False) and args[0].is_cuda):
            if large is not None and pointwise_triton.available(args[0]):
                return large(*args)
            return eager(*args)
        fn = _compiled.get(name)
        if fn is None:
            _allow_variants()
            fn = _compiled[name] = torch.compile(eager, dynamic=True, fullgraph=True)
        try:
            return fn(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:  # no compiler on the machine, say: stay eager
            if torch.cuda.is_current_stream_capturing():
                raise  # a graph capture cannot go on after a failed launch; the engine falls back
            log.warning(
                "torch.compile of the pointwise kernels failed (%s: %s); running them eagerly",
                type(exc).__name__,
                exc,
            )
            _state["enabled"] = False
            return eager(*args)

    run.__doc__ = eager.__doc__
    return run  # type: ignore[return-value]


rms_norm = _on_cuda("rms_norm", _rms_norm)
centered_rms_norm = _on_cuda("centered_rms_norm", _centered_rms_norm)
add_rms_norm = _on_cuda("add_rms_norm", _add_rms_norm)
centered_add_rms_norm = _on_cuda("centered_add_rms_norm", _centered_add_rms_norm)
gated_rms_norm = _on_cuda("gated_rms_norm", _gated_rms_norm)
rope = _on_cuda("rope", apply_rope, pointwise_triton.rope)
silu_mul = _on_cuda("silu_mul", _silu_mul, pointwise_triton.silu_mul)
sigmoid_mul = _on_cuda("sigmoid_mul", _sigmoid_mul)
