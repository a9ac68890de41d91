"""The scheduler's configuration: one frozen dataclass, validated when built.

Field metadata names the `BALLAST_*` variable, the accepted range and a one-line doc, so
`ballast.server.config` fills it from flags and env without knowing the fields. Values found at
run time (the engine's slot count, its max_model_len) are never written back here: the scheduler
combines them with these values when it starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


def _setting(env: str, lo: float, hi: float, doc: str) -> dict[str, Any]:
    return {"env": env, "range": (lo, hi), "doc": doc}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=8, metadata=_setting("BALLAST_MAX_NUM_SEQS", 1, 4096, "most requests running at once (also capped by the engine's slots)"))
    max_queue: int = field(default=256, metadata=_setting("BALLAST_MAX_QUEUE", 0, 1 << 20, "most requests waiting for a slot; beyond it new ones get 429"))
    max_num_batched_tokens: int = field(default=512, metadata=_setting("BALLAST_MAX_NUM_BATCHED_TOKENS", 1, 1 << 20, "tokens per step (decodes + prefill chunks); must be >= max_num_seqs"))
    prefill_window: int = field(default=0, metadata=_setting("BALLAST_PREFILL_WINDOW", 0, 1 << 24, "context (prompt + new tokens) a request may use; 0 = the model's max_model_len. The ladder halves it at TIGHT, quarters it at CRITICAL"))
    request_timeout_s: float = field(default=600.0, metadata=_setting("BALLAST_REQUEST_TIMEOUT_S", 0.0, 86400.0, "deadline from submission for a request without its own; 0 = none"))
    max_queue_wait_s: float = field(default=30.0, metadata=_setting("BALLAST_MAX_QUEUE_WAIT_S", 0.0, 86400.0, "longest a request may wait for a slot: one that would wait longer (estimated from the measured service rate) or did gets 429 + Retry-After; 0 = no bound"))
    stale_snapshot_s: float = field(default=5.0, metadata=_setting("BALLAST_STALE_SNAPSHOT_S", 0.0, 3600.0, "a memory snapshot older than this (MemWatch polls failing) counts as unknown: new and queued requests get 503 at once; 0 = never stale"))
    retry_after_s: float = field(default=2.0, metadata=_setting("BALLAST_RETRY_AFTER_S", 0.0, 3600.0, "Retry-After advertised with 503 and 429 refusals"))
    ladder_disable: bool = field(default=False, metadata=_setting("BALLAST_LADDER_DISABLE", 0, 1, "1 turns the degradation ladder off (slots and window stay as configured)"))
    psi_full_reject_pct: float = field(default=15.0, metadata=_setting("BALLAST_PSI_FULL_REJECT", 0.01, 100.0, "PSI full avg10 (%) at which admission refuses new requests"))
    mailbox_events: int = field(default=64, metadata=_setting("BALLAST_MAILBOX_EVENTS", 2, 1 << 16, "events buffered per request before token events coalesce (slow readers)"))
    idle_tick_s: float = field(default=5.0, metadata=_setting("BALLAST_IDLE_TICK_S", 0.01, 3600.0, "while idle, how often the idle hook (checkpoint-pool trim) runs again"))
    hold_poll_s: float = field(default=0.02, metadata=_setting("BALLAST_HOLD_POLL_S", 0.001, 10.0, "how often a held queue re-reads the memory snapshot"))

    def __post_init__(self) -> None:
        for f in fields(self):
            lo, hi = f.metadata["range"]
            value = getattr(self, f.name)
            if isinstance(value, bool):
                if f.type not in ("bool", bool):
                    raise ValueError(f"{f.metadata['env']}={value!r}: expected a number")
                continue
            if not isinstance(value, int | float) or not lo <= value <= hi:
                raise ValueError(f"{f.metadata['env']}={value!r} is out of range: accepted {lo}..{hi} ({f.metadata['doc']})")
            if f.type in ("int", int) and not isinstance(value, int):
                raise ValueError(f"{f.metadata['env']}={value!r}: expected an integer")
        # A step must fit every running request's decode token plus at least one prefill token,
        # or a long prompt could wait forever behind decodes (starvation).
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"BALLAST_MAX_NUM_BATCHED_TOKENS={self.max_num_batched_tokens} must be >= "
                f"BALLAST_MAX_NUM_SEQS={self.max_num_seqs}"
            )
