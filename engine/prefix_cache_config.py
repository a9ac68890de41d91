"""The prefix cache's settings, and how far apart its checkpoints go when the operator does not say."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ballast.settings import check, setting

# Checkpoints closer than this are never worth a split prefill chunk (each split costs a step).
MIN_INTERVAL = 512
_INTERVAL_QUANTUM = 256


@dataclass(frozen=True)
class PrefixCacheConfig:
    """The prefix cache's settings (flags and BALLAST_* variables through `ballast.server.config`)."""

    fraction: float = field(
        default=0.05,
        metadata=setting(
            "BALLAST_PREFIX_CACHE_FRACTION",
            "prefix cache byte budget as a fraction of effective host memory; 0 turns prefix reuse off",
            0.0,
            0.5,
        ),
    )
    max_bytes: int = field(
        default=0,
        metadata=setting(
            "BALLAST_PREFIX_CACHE_BYTES",
            "fixed cap on the prefix cache's bytes on top of the fraction; 0 = the fraction alone",
            0,
            1 << 50,
        ),
    )
    checkpoint_interval: int = field(
        default=0,
        metadata=setting(
            "BALLAST_CHECKPOINT_INTERVAL",
            "prompt tokens between checkpoints; 0 = from the model's costs",
            0,
            1 << 20,
        ),
    )

    def __post_init__(self) -> None:
        check(self)

    @property
    def enabled(self) -> bool:
        return self.fraction > 0


def auto_interval(state_bytes_per_slot: int, kv_bytes_per_token: int) -> int:
    """Tokens between checkpoints, from the model's costs. A checkpoint's fixed part (the recurrent
    state) costs as much as state/kv tokens of KV; placing checkpoints at least that far apart keeps
    the recurrent copies from costing more than the KV they let a later prompt skip, so interval
    checkpoints at most double the cache's bytes. Never below MIN_INTERVAL: each split prefill chunk
    costs a step."""
    if kv_bytes_per_token <= 0:  # no attention layers: nothing to weigh the state against
        return MIN_INTERVAL
    tokens = math.ceil(state_bytes_per_slot / kv_bytes_per_token)
    return max(MIN_INTERVAL, _INTERVAL_QUANTUM * math.ceil(tokens / _INTERVAL_QUANTUM))
