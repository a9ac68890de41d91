"""Sequences the engine preempted, moved out of the KV pool into host buffers until they resume.

Preemption frees a sequence's KV blocks without recomputing it later: its blocks and recurrent
states are copied into one host buffer from the checkpoint pool, and resuming copies them back
into fresh blocks of the pool it came from. Parked sequences are running work, not cache: the
ladder's shed leaves them alone. `match` runs on the event loop, the rest on the engine thread.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from ballast.engine.kv.checkpoint_buffers import CheckpointJournal, Segments, host_buffer, layout, segment
from ballast.engine.kv.kv_pool import KVPool
from ballast.engine.kv.prefix_keys import PrefixKey, forget_length, longest, prefix_key
from ballast.memory.pool import CheckpointPool
from ballast.models.layers.state import LayerState
from torch import Tensor

log = logging.getLogger(__name__)


class CheckpointMissing(LookupError):
    """A restore names a prefix the cache does not hold: evicted after the scheduler planned the
    restore (it plans a step while the one before runs); the engine skips that slot's step."""


@dataclass(eq=False)
class _Parked:
    n_tokens: int
    buf: Tensor
    kv: KVPool  # the pool its blocks came from, and go back to
    n_blocks: int
    views: Segments  # recurrent layers' tensors, then block tensors
    key: int = 0  # the other ranks' name for it (see `CheckpointJournal`)


class ParkedSequences:
    """Preempted sequences by the exact tokens they had consumed."""

    def __init__(
        self,
        states: Sequence[LayerState],
        main_kv: KVPool | None,
        pool: CheckpointPool | None,
        device: torch.device,
        journal: CheckpointJournal,
    ) -> None:
        self._states = list(states)
        self._main_kv = main_kv
        self._pool = pool
        self._cuda = device.type == "cuda"
        self._device = device
        self._journal = journal
        self._lock = threading.Lock()
        self._parked: dict[PrefixKey, _Parked] = {}
        self._lengths: Counter[int] = Counter()
        self.declined = 0  # parks whose buffer could not be allocated (recomputed instead)

    def match(self, tokens: Sequence[int]) -> int:
        """The length of the longest parked sequence whose tokens start `tokens` (shorter than it:
        one token is always fed after a resume); 0 if none."""
        with self._lock:
            return longest(self._lengths, self._parked, tokens)

    def held(self) -> tuple[int, int]:
        """(sequences parked, bytes of their buffers)."""
        with self._lock:
            return len(self._parked), sum(p.buf.numel() for p in self._parked.values())

    def pool_of(self, prefix: Sequence[int]) -> KVPool | None:
        """The pool a parked sequence of exactly `prefix` goes back to; None if it is not parked."""
        with self._lock:
            parked = self._parked.get(prefix_key(prefix))
            return parked.kv if parked is not None else None

    def park(self, slot: int, tokens: Sequence[int], kv: KVPool) -> bool:
        """Copy the slot's sequence out of `kv`, the pool it lives in, into a host buffer (the caller
        then releases its blocks). False when no buffer can be had: it is recomputed then."""
        n = len(tokens)
        blocks = kv.table(slot)[: -(-n // kv.layout.block_size)]
        views = self._sequence_views(slot, kv, blocks)
        segs, nbytes = layout([views])
        buf = self._buffer(nbytes) if nbytes else None
        if buf is None:
            return False
        for src, (off, dtype, shape) in zip(views, segs[0], strict=True):
            segment(buf, off, dtype, shape).copy_(src, non_blocking=self._cuda)
        self._sync()
        key = prefix_key(tokens)
        name = self._journal.record("park", slot, self._store(kv), blocks)
        with self._lock:
            old = self._parked.pop(key, None)
            self._parked[key] = _Parked(n, buf, kv, len(blocks), segs[0], name)
            if old is None:
                self._lengths[n] += 1
        if old is not None:
            self._release(old)
        return True

    def resume(
        self, slot: int, prefix: Sequence[int], evict_for_blocks: Callable[[int], object]
    ) -> int | None:
        """Start the (empty) slot from the sequence parked with exactly `prefix`: its token count, or
        None if none is. Its fresh blocks come first from evicting cached prefixes; CheckpointMissing
        when they cannot be had (it stays parked)."""
        key = prefix_key(prefix)
        with self._lock:
            parked = self._parked.get(key)
        if parked is None:
            return None
        kv = parked.kv
        if not kv.ensure(slot, parked.n_tokens) and kv is self._main_kv:
            evict_for_blocks(parked.n_blocks)  # cached prefixes go first
        if not kv.ensure(slot, parked.n_tokens):
            raise CheckpointMissing(
                f"no KV blocks to resume a parked {parked.n_tokens}-token sequence (slot {slot})"
            )
        blocks = kv.table(slot)[: parked.n_blocks]
        self._journal.record("unpark", slot, self._store(kv), blocks, key=parked.key)
        dests = self._sequence_views(slot, kv, blocks)
        for dst, (off, dtype, shape) in zip(dests, parked.views, strict=True):
            dst.copy_(segment(parked.buf, off, dtype, shape), non_blocking=self._cuda)
        self._sync()  # the buffer goes back to the pool next
        self._take(key)
        if self._pool is not None:
            self._pool.put(parked.buf)
        return parked.n_tokens

    def unpark(self, tokens: Sequence[int]) -> bool:
        """Drop the parked sequence that `tokens` would resume (its request ended while it waited)."""
        n = self.match(tokens)
        return n > 0 and self.drop(tokens[:n])

    def drop(self, tokens: Sequence[int]) -> bool:
        """Drop the sequence parked with exactly these tokens (a step that parked it failed, so
        nobody will resume it); False if there is none."""
        key = prefix_key(tokens)
        with self._lock:
            if key not in self._parked:
                return False
        self._release(self._take(key))
        return True

    def drop_all(self) -> None:
        with self._lock:
            parked = list(self._parked.values())
            self._parked.clear()
            self._lengths.clear()
        for p in parked:
            self._release(p)

    def _take(self, key: PrefixKey) -> _Parked:
        with self._lock:
            parked = self._parked.pop(key)
            forget_length(self._lengths, parked.n_tokens)
        return parked

    def _sequence_views(self, slot: int, kv: KVPool, blocks: Sequence[int]) -> list[Tensor]:
        """What a parked sequence's buffer holds: recurrent layers' tensors, then its blocks'."""
        views = [v for s in self._states for v in s.slot_views(slot)]
        return views + [v for b in blocks for v in kv.store.block_views(b)]

    def _store(self, kv: KVPool) -> int:
        return 0 if kv is self._main_kv else 1  # the main store, or the int8 one

    def _buffer(self, nbytes: int) -> Tensor | None:
        try:
            return host_buffer(self._pool, nbytes, self._cuda)
        except (RuntimeError, MemoryError) as e:
            with self._lock:
                self.declined += 1
            log.warning("parking buffer of %d bytes failed (%s); the sequence is recomputed", nbytes, e)
            return None

    def _release(self, p: _Parked) -> None:
        """A parked sequence that will not resume: its buffer goes back (here and on the other ranks)."""
        self._journal.drop(p.key)
        if self._pool is not None:
            self._pool.put(p.buf)

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()
