"""Where the KV pool's memory comes from, and what it adds up to.

A segment is granted by the memory layer before it is allocated: on CUDA as a VRAM ledger lease
(so the ledger refuses before the driver would OOM), on the CPU against the host budget less what
the host book holds that the latest snapshot does not show yet.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ballast.engine.kv.kv_pool import Acquire
from ballast.engine.workspace import StepWorkspace
from ballast.memory.errors import LedgerFull
from ballast.memory.host_book import HostGrant
from ballast.memory.types import CostModel, GiB, MiB
from ballast.memory.watch import MemWatch

log = logging.getLogger(__name__)


def segment_grant(watch: MemWatch, die: int | None, tag: str = "kv-segment") -> Acquire:
    """Grants for KV segments (or other memory taken while serving, under `tag`) on `die` (None:
    the host)."""
    if die is not None:

        def lease(nbytes: int) -> Callable[[], None] | None:
            try:
                return watch.ledger.lease(die, nbytes, tag).release
            except LedgerFull:
                return None

        return lease
    return _host_grant(watch)


def _host_grant(watch: MemWatch) -> Acquire:
    """Grants held in the host book until released: a grant counts against every snapshot read
    before its pages were committed, so the same bytes are never granted twice."""

    def grant(nbytes: int) -> HostGrant | None:
        return watch.host_book.take(nbytes, lambda: watch.exact().host_budget_bytes)

    return grant


def capacity_line(
    cost: CostModel,
    fixed_bytes: int,
    kv_room_bytes: int,
    quantized: bool,
    max_seqs: int,
    max_model_len: int,
    workspace: StepWorkspace | None = None,
) -> str:
    """The start-up report: what the memory left after loading holds, in tokens and sequences, with
    every per-slot cost and each step's workspace in it, so the figures are what admission finds."""
    return _kv_line(cost, fixed_bytes, kv_room_bytes, quantized, max_seqs, max_model_len) + (
        f"; activations {cost.extra.get('profile_peak_bytes', 0) / MiB:.1f} MiB a prefill chunk, "
        f"{workspace.report()}"
        if workspace is not None
        else ""
    )


def _kv_line(
    cost: CostModel, fixed_bytes: int, kv_room_bytes: int, quantized: bool, max_seqs: int, max_model_len: int
) -> str:
    per_tok = (
        cost.quantized_kv_bytes_per_token
        if quantized and cost.quantized_kv_bytes_per_token
        else cost.kv_bytes_per_token
    )
    if per_tok <= 0:
        return (
            f"capacity: no attention KV; {max_seqs} slots of recurrent state hold {fixed_bytes / MiB:.1f} "
            f"MiB; {kv_room_bytes / GiB:.2f} GiB left"
        )
    tokens = kv_room_bytes // per_tok
    seqs = min(max_seqs, tokens // max_model_len)
    return (
        f"capacity: KV room {kv_room_bytes / GiB:.2f} GiB = {tokens:,} tokens at {per_tok / 1024:.1f} "
        "KiB/token "
        f"({'int8' if quantized else 'model dtype'}, blocks of {cost.kv_block_tokens}): {seqs} of {max_seqs} "
        f"sequences at max_model_len {max_model_len}, or {min(max_seqs, tokens // 1024 or 0)} at 1k tokens; "
        f"per-slot states for {max_seqs} slots {fixed_bytes / MiB:.1f} MiB (allocated)"
    )
