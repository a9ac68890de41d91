"""Host values onto the device without waiting for the GPU.

`torch.tensor(values, device="cuda")` copies from pageable memory with a blocking copy, which
waits for every kernel already queued on the stream: one such call in a step's preparation
stalls the host until the previous step has finished on the GPU, and the two can no longer
overlap. Staging the values in pinned memory and copying with `non_blocking=True` queues the copy
behind those kernels instead; the caching host allocator keeps the pinned buffer alive until the
copy has run, so the values may be dropped at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`, queued on its stream (no host sync on CUDA)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)


def column(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a [len, 1] column on `device` (per-row sampling knobs), queued like `to_device`."""
    return to_device(values, dtype, device).unsqueeze(-1)
