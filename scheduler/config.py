"""The scheduler's configuration: one frozen dataclass, validated when built (`ballast.settings`).

Values found at run time (the engine's slot count, its max_model_len) are never written back here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ballast.engine.spec.config import SpeculativeConfig, parse_speculative_config

from ballast.settings import ConfigError, check, setting


@dataclass(frozen=True)
class SchedulerConfig:
    # Not settings of their own: `ballast serve` fills them from the engine's and the memory
    # layer's (BALLAST_MAX_NUM_SEQS, BALLAST_LADDER_DISABLE, BALLAST_PSI_FULL_REJECT).
    max_num_seqs: int = 8  # most requests running at once (also capped by the engine's slots)
    ladder_disable: bool = False  # the degradation ladder off: slots and window stay as configured
    psi_full_reject_pct: float = 15.0  # PSI full avg10 (%) at which admission refuses new requests
    overlap: bool = field(
        default=True,
        metadata=setting(
            "BALLAST_OVERLAP",
            "while steadily decoding, plan step N+1 before step N's tokens are back, so the GPU never "
            "waits for the host between steps",
        ),
    )
    max_queue: int = field(
        default=256,
        metadata=setting(
            "BALLAST_MAX_QUEUE", "most requests waiting for a slot; beyond it new ones get 429", 0, 1 << 20
        ),
    )
    max_num_batched_tokens: int = field(
        default=0,
        metadata=setting(
            "BALLAST_MAX_NUM_BATCHED_TOKENS",
            "tokens per step (decodes + prefill chunks); must be >= max_num_seqs; 0 = the engine's "
            "prefill chunk (at least max_num_seqs)",
            0,
            1 << 20,
        ),
    )
    max_itl_ms: float = field(
        default=0.0,
        metadata=setting(
            "BALLAST_MAX_ITL_MS",
            "longest a step beside running decodes should take: its prompt tokens are sized from the "
            "measured step times (decode-only steps, and the cost of a prompt token) to stay within it, "
            "at least 64 a step; 0 = each such step takes the engine's whole prefill chunk",
            0.0,
            60000.0,
        ),
    )
    context_window: int = field(
        default=0,
        metadata=setting(
            "BALLAST_CONTEXT_WINDOW",
            "context (prompt + new tokens) a request may use; 0 = the model's max_model_len. The ladder "
            "halves it at TIGHT, quarters it at CRITICAL",
            0,
            1 << 24,
            deprecated=("BALLAST_PREFILL_WINDOW",),
        ),
    )
    request_timeout_s: float = field(
        default=600.0,
        metadata=setting(
            "BALLAST_REQUEST_TIMEOUT_S",
            "deadline from submission for a request without its own; 0 = none",
            0.0,
            86400.0,
        ),
    )
    max_queue_wait_s: float = field(
        default=30.0,
        metadata=setting(
            "BALLAST_MAX_QUEUE_WAIT_S",
            "longest a request may wait to start: one projected to wait longer (for a slot, KV blocks or "
            "the prefill ahead, on the measured step costs) is refused at arrival, one that falls behind "
            "while queued when it does, with 429 + Retry-After; 0 = no bound",
            0.0,
            86400.0,
        ),
    )
    kv_keep_s: float = field(
        default=300.0,
        metadata=setting(
            "BALLAST_KV_KEEP_S",
            "at TIGHT the KV pools give back only free blocks beyond the most their requests held within "
            "this many seconds (and what running and queued requests will take): segments unused that "
            "long go back to a co-tenant, a working set it did not take stays for the next requests; "
            "0 = keep only what running and queued requests will take. CRITICAL gives every free block back",
            0.0,
            86400.0,
        ),
    )
    stale_snapshot_s: float = field(
        default=5.0,
        metadata=setting(
            "BALLAST_STALE_SNAPSHOT_S",
            "a memory snapshot older than this (MemWatch polls failing) counts as unknown: new and queued "
            "requests get 503 at once; 0 = never stale",
            0.0,
            3600.0,
        ),
    )
    step_watchdog_s: float = field(
        default=30.0,
        metadata=setting(
            "BALLAST_STEP_WATCHDOG_S",
            "least time an engine step may take before the engine counts as stalled (the deadline is "
            "max(this, 20x the p99 of recent steps), 10x this for the first step of a new prefill size); "
            "on expiry every request gets 503 engine_stalled, /health turns 503 and the process exits "
            "non-zero; 0 = no watchdog",
            0.0,
            86400.0,
        ),
    )
    retry_after_s: float = field(
        default=2.0,
        metadata=setting(
            "BALLAST_RETRY_AFTER_S", "Retry-After advertised with 503 and 429 refusals", 0.0, 3600.0
        ),
    )
    mailbox_events: int = field(
        default=64,
        metadata=setting(
            "BALLAST_MAILBOX_EVENTS",
            "events buffered per request before token events coalesce (slow readers)",
            2,
            1 << 16,
        ),
    )
    idle_tick_s: float = field(
        default=5.0,
        metadata=setting(
            "BALLAST_IDLE_TICK_S",
            "while idle, how often the idle hook (checkpoint-pool trim) runs again",
            0.01,
            3600.0,
        ),
    )
    speculative_config: str | None = field(
        default=None,
        metadata=setting(
            "BALLAST_SPECULATIVE_CONFIG",
            'speculative decoding, vLLM\'s JSON: {"method": "ngram" or "mtp", "num_speculative_tokens": k, '
            '"prompt_lookup_min": a, "prompt_lookup_max": b, "max_streams": s}; drafts only while it '
            "measures faster, below s (8) decoding streams and below WATCH; unset = off",
        ),
    )
    hold_poll_s: float = field(
        default=0.02,
        metadata=setting(
            "BALLAST_HOLD_POLL_S", "how often a held queue re-reads the memory snapshot", 0.001, 10.0
        ),
    )

    def __post_init__(self) -> None:
        check(self)
        self.speculative  # noqa: B018 - a bad one is a startup error
        # A step must fit every running request's decode token plus at least one prefill token,
        # or a long prompt could wait forever behind decodes (starvation).
        if 0 < self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"BALLAST_MAX_NUM_BATCHED_TOKENS={self.max_num_batched_tokens} must be >= "
                f"BALLAST_MAX_NUM_SEQS={self.max_num_seqs}"
            )

    @property
    def speculative(self) -> SpeculativeConfig | None:
        text = self.speculative_config
        return None if text is None else parse_speculative_config(text)

    def window_for(self, max_model_len: int) -> int:
        """The context (prompt + new tokens) a request may use with this model, before the ladder
        shrinks it: context_window where set, never past the model's max_model_len."""
        return min(self.context_window or max_model_len, max_model_len)
