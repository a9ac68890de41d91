"""Plain data shared by the memory layer and its readers: levels, snapshots, verdicts, plans.

Everything here is frozen: a snapshot is published by one reference assignment and read without a
lock, so it must never change after it is built.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


class Level(enum.IntEnum):
    """Memory pressure, ordered so that `max()` gives the worst of several signals."""

    OK = 0  # ample headroom
    WATCH = 1  # headroom shrinking
    TIGHT = 2  # reserve nearly reached, or PSI rising
    CRITICAL = 3  # at the reserve line, or a sustained stall: shed new work


@dataclass(frozen=True)
class HostSample:
    """One read of the host signals. Zero means "not known" for PSI and cgroup fields."""

    total_bytes: int  # MemTotal (0 if unreadable: never treated as "huge")
    available_bytes: int  # MemAvailable
    psi_some_avg10: float = 0.0  # percent
    psi_full_avg10: float = 0.0  # percent
    cgroup_version: int = 0  # 0 = none found, 1 or 2
    cgroup_usage_bytes: int = 0  # usage minus reclaimable page cache (inactive_file)
    cgroup_high_bytes: int = 0  # 0 = unset / "max"
    cgroup_max_bytes: int = 0  # 0 = unset / "max"

    @property
    def cgroup_limit_bytes(self) -> int:
        """The tightest cgroup limit in force, 0 if none."""
        limits = [b for b in (self.cgroup_high_bytes, self.cgroup_max_bytes) if b > 0]
        return min(limits) if limits else 0

    @property
    def effective_total_bytes(self) -> int:
        """The smaller of host RAM and the cgroup limit."""
        limit = self.cgroup_limit_bytes
        if limit and self.total_bytes:
            return min(limit, self.total_bytes)
        return limit or self.total_bytes

    @property
    def effective_available_bytes(self) -> int:
        """What we may still allocate: host MemAvailable, capped by the cgroup's headroom."""
        limit = self.cgroup_limit_bytes
        if not limit:
            return self.available_bytes
        cgroup_free = max(0, limit - self.cgroup_usage_bytes)
        return min(self.available_bytes, cgroup_free) if self.total_bytes else cgroup_free


@dataclass(frozen=True)
class DieState:
    """One GPU ("die"): driver figures plus our own ledger."""

    index: int
    name: str = ""
    total_bytes: int = 0
    free_bytes: int = 0
    budget_bytes: int = 0  # total - die reserve; 0 = die not tracked
    ledger_bytes: int = 0  # bytes of our own leases on this die
    ceiling_bytes: int = 0  # ledger ceiling: min(budget, usable free at load x fraction)
    level: Level = Level.OK


@dataclass(frozen=True)
class MemState:
    """Immutable snapshot published by MemWatch."""

    host: HostSample
    dies: tuple[DieState, ...] = ()
    host_level: Level = Level.OK
    level: Level = Level.OK  # worst of host and every die
    host_reserve_bytes: int = GiB
    seq: int = 0
    taken_at: float = 0.0  # time.monotonic() of the poll
    host_epoch: int = 0  # the host book's epoch when the host figures were read
    # Host bytes we booked that the host figures do not show yet (granted, or committed after the
    # read): as of the publish, or as of now in MemWatch.exact().
    host_unseen_bytes: int = 0

    @property
    def host_budget_bytes(self) -> int:
        """Bytes the host can still give before reaching its reserve, less what we booked since
        the host was read (never negative)."""
        return max(0, self.host.effective_available_bytes - self.host_reserve_bytes - self.host_unseen_bytes)


class VerdictKind(enum.Enum):
    ADMIT = "admit"
    CAP = "cap"
    REJECT = "reject"


@dataclass(frozen=True)
class Verdict:
    kind: VerdictKind
    fit_tokens: int = 0  # tokens that fit (for CAP: the capped window; for ADMIT: the request)
    reason: str = ""

    @property
    def admitted(self) -> bool:
        return self.kind is not VerdictKind.REJECT


@dataclass(frozen=True)
class LadderPlan:
    """What the ladder asks for at a level: absolute values, not deltas."""

    level: Level
    max_slots: int
    context_window: int
    force_quantized_kv: bool = False
    kv_evict: bool = False
    shed_prefix_cache: bool = False
    degraded: bool = False
    note: str = ""


@dataclass(frozen=True)
class PoolRoom:
    """What the KV block pool can give a new request besides new memory: free blocks it already
    holds, less the blocks that admitted requests will still take as they grow; and how much more
    its limits let it add (whatever memory says)."""

    free_bytes: int = 0
    promised_bytes: int = 0
    addable_bytes: int = 1 << 62

    @property
    def spare_bytes(self) -> int:
        """Held and unpromised (negative when promises exceed what is held free)."""
        return self.free_bytes - self.promised_bytes


@dataclass(frozen=True)
class CostModel:
    """What one request costs, filled by the engine from layer specs and a profiling prefill."""

    kv_bytes_per_token: int  # summed over attention layers, at the cache's dtype
    state_bytes_per_slot: int  # recurrent + conv state, summed over linear-attention layers
    activation_bytes_per_prefill_token: int  # measured peak activations / prefill chunk tokens
    weights_bytes: int = 0
    quantized_kv_bytes_per_token: int = 0  # same as kv_bytes_per_token if no quantized KV exists
    prefill_chunk_tokens: int = 0  # prefill runs in chunks of at most this many tokens (0 = unchunked)
    # KV is held in blocks of this many positions: a request pays for whole blocks.
    kv_block_tokens: int = 1
    # The engine allocated every slot's recurrent state at load: a request that takes a slot adds
    # no state bytes (charging them again would count the same bytes twice).
    state_preallocated: bool = False
    extra: dict[str, int] = field(default_factory=dict, compare=False)

    def kv_bytes(self, n_tokens: int, quantized_kv: bool = False) -> int:
        """KV bytes of n_tokens positions, in whole blocks."""
        per_tok = (
            self.quantized_kv_bytes_per_token
            if quantized_kv and self.quantized_kv_bytes_per_token
            else self.kv_bytes_per_token
        )
        block = max(1, self.kv_block_tokens)
        return -(-max(0, n_tokens) // block) * block * per_tok

    def cache_bytes(self, n_tokens: int, quantized_kv: bool = False) -> int:
        """KV + state bytes a request of n_tokens adds to what is already allocated."""
        return self.kv_bytes(n_tokens, quantized_kv) + (
            0 if self.state_preallocated else self.state_bytes_per_slot
        )

    def request_bytes(self, n_tokens: int, quantized_kv: bool = False) -> int:
        """Bytes a request of n_tokens adds while running: its cache bytes plus the activations
        of its largest prefill chunk (prefill is chunked, so the activation peak is one chunk's
        worth, not the whole prompt's)."""
        chunk = min(n_tokens, self.prefill_chunk_tokens) if self.prefill_chunk_tokens > 0 else n_tokens
        return self.cache_bytes(n_tokens, quantized_kv) + chunk * self.activation_bytes_per_prefill_token
