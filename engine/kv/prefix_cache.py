"""The prefix cache: slot states saved at chosen prompt positions, restored for a later prompt that
starts with the same tokens, so only the rest is prefilled.

KV can be truncated, a recurrent state cannot: the state after n tokens exists only when the slot
has consumed exactly n. So a checkpoint is taken where a prefill chunk ends (the scheduler splits
chunks at `checkpoint_interval` multiples and prompt ends) or when a request finishes. An entry
holds the KV blocks of [0, n) by reference (a restore copies only a partly filled last block) and
a copy of every recurrent layer's state, in `CheckpointPool` buffers (pinned on CUDA, recycled so
a save does not page-fault a fresh mmap), copied on a side stream (`state_copies`) so neither a
save nor a restore waits on the host. A live byte budget bounds what it holds (LRU eviction), and
`shed()` empties it at WATCH: cached state is the cheapest memory to give back.

Threads: `match` runs on the event loop, everything else on the engine thread, the index under a
lock. Entries change only inside a step and the scheduler has one plan in flight, so an entry it
matched while building plan P is still there when P's restores run (restores run first).

Under tensor parallel every decision stays here, on rank 0; each copy is recorded in `journal`
and the other ranks repeat it on their shards (`shard_checkpoints`). Sequences preemption parked
live alongside (`parked.ParkedSequences`): a restore of exactly their tokens resumes them.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from ballast.engine.kv.checkpoint_buffers import (
    CheckpointJournal,
    Segments,
    checkpoint_bytes,
    host_buffer,
    layout,
    segment,
)
from ballast.engine.kv.kv_pool import KVPool
from ballast.engine.kv.parked import CheckpointMissing, ParkedSequences
from ballast.engine.kv.prefix_keys import CacheListener, PrefixKey, forget_length, longest, prefix_key
from ballast.engine.kv.state_copies import STAGING_BYTES, StateCopies
from ballast.memory.pool import CheckpointPool
from ballast.models.layers.state import LayerState
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefixCacheStats:
    entries: int
    bytes_held: int
    saves: int  # checkpoints stored
    duplicates: int  # saves of a prefix already held (no copy, the entry became most recent)
    declined: int  # saves larger than the whole budget, or whose buffer could not be allocated
    restores: int
    evictions: int  # entries dropped to fit a newer one
    sheds: int  # shed() calls that released something
    parked: int = 0  # preempted sequences held in host buffers now
    parked_bytes: int = 0


@dataclass(eq=False)
class _Entry:
    n_tokens: int
    blocks: tuple[int, ...]  # KV blocks of positions [0, n_tokens); the cache holds one reference
    buf: Tensor | None  # 1-D uint8 host buffer from the pool with the recurrent states (None: none)
    nbytes: int  # what the entry costs the budget: the buffer as handed out, plus its blocks
    layout: tuple[Segments, ...]  # per layer, where its tensors lie in buf
    done: torch.cuda.Event | None = None  # the copies into buf have run (CUDA; None: done already)
    key: int = 0  # the other ranks' name for it (see `journal`)


class PrefixCache:
    """Checkpoints of slot states keyed by the exact token prefix they consumed; LRU in bytes."""

    def __init__(
        self,
        states: Sequence[LayerState],
        kv: KVPool | None,
        budget_bytes: Callable[[], int],
        interval: int,
        pool: CheckpointPool | None = None,
        device: torch.device | str = "cpu",
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        """staging_bytes: device memory the CUDA saves may stage in at once (`StateCopies`)."""
        if interval < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {interval}")
        self._states = list(states)
        self._kv = kv
        self._budget = budget_bytes
        self.interval = interval
        self._pool = pool
        self._lock = threading.Lock()
        self._entries: OrderedDict[PrefixKey, _Entry] = OrderedDict()  # LRU first
        self._lengths: Counter[int] = Counter()  # n_tokens of the entries, for match
        self._held = 0
        self._saves = self._duplicates = self._declined = self._restores = self._evictions = self._sheds = 0
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._copies = StateCopies(self._device, staging_bytes)
        # Tensor parallel: where the copies are recorded for the other ranks (`ops` None: one rank).
        self.journal = CheckpointJournal()
        self.parked = ParkedSequences(self._states, kv, pool, self._device, self.journal)
        # Told of every entry stored, evicted or shed (the KV-event publisher; None: nobody).
        self.listener: CacheListener | None = None

    # --- any thread ------------------------------------------------------------------------
    def match(self, prompt: Sequence[int]) -> int:
        """The longest cached prefix of `prompt` shorter than it (at least one token must still be
        prefilled to produce the first logits); 0 if none."""
        with self._lock:
            return longest(self._lengths, self._entries, prompt)

    def entry_keys(self) -> frozenset[PrefixKey]:
        """The names (`prefix_key`) of the checkpoints held now."""
        with self._lock:
            return frozenset(self._entries)

    def stats(self) -> PrefixCacheStats:
        parked, parked_bytes = self.parked.held()
        with self._lock:
            return PrefixCacheStats(
                len(self._entries),
                self._held,
                self._saves,
                self._duplicates,
                self._declined + self.parked.declined,
                self._restores,
                self._evictions,
                self._sheds,
                parked,
                parked_bytes,
            )

    # --- engine thread ---------------------------------------------------------------------
    def save(self, slot: int, prefix: Sequence[int]) -> bool:
        """Keep the slot's state, which has consumed exactly `prefix`. False if it cannot fit the
        budget at all (nothing is evicted for it then)."""
        n = len(prefix)
        key = prefix_key(prefix)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self._duplicates += 1
                return True
        views = [s.slot_views(slot) for s in self._states]
        segs, buf_bytes = layout(views)
        kv = self._kv
        block_bytes = -(-n // kv.layout.block_size) * kv.layout.block_bytes if kv is not None else 0
        if buf_bytes + block_bytes > self._budget() or not self._make_room(buf_bytes + block_bytes):
            with self._lock:
                self._declined += 1
            return False
        buf, done = None, None
        if buf_bytes:
            buf = self._buffer(buf_bytes)
            if buf is None:
                return False
            # On CUDA the copies run on a side stream and the step goes on (see state_copies).
            pairs = [
                (src, segment(buf, off, dtype, shape))
                for layer_views, layer_segs in zip(views, segs, strict=True)
                for src, (off, dtype, shape) in zip(layer_views, layer_segs, strict=True)
            ]
            done = self._copies.copy_out(slot, pairs, buf, buf_bytes)
        blocks = kv.hold(slot, n) if kv is not None else ()
        nbytes = (buf.numel() if buf is not None else 0) + block_bytes
        name = self.journal.record("save", slot)
        with self._lock:
            self._entries[key] = _Entry(n, blocks, buf, nbytes, segs, done, name)
            self._lengths[n] += 1
            self._held += nbytes
            self._saves += 1
        if self.listener is not None:
            self.listener.stored(key, prefix)
        return True

    def restore(self, slot: int, prefix: Sequence[int]) -> int:
        """Start the (empty) slot from the parked sequence or the checkpoint of exactly `prefix`;
        returns its token count. A parked sequence needs fresh blocks in its pool: CheckpointMissing
        when they cannot be had (it stays parked)."""
        resumed = self.parked.resume(slot, prefix, self.evict_for_blocks)
        if resumed is not None:
            with self._lock:
                self._restores += 1
            return resumed
        key = prefix_key(prefix)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise CheckpointMissing(f"no checkpoint for a {len(prefix)}-token prefix (slot {slot})")
            self._entries.move_to_end(key)
            self._restores += 1
        if self._kv is not None and not self._kv.attach(slot, entry.blocks, entry.n_tokens):
            # The copy of its partly filled last block found the pool full, typically of cached
            # prefixes: older entries give way (this one is the most recent now), then try again.
            self.evict_for_blocks(1, keep=key)
            if not self._kv.attach(slot, entry.blocks, entry.n_tokens):
                raise CheckpointMissing(
                    f"no free KV block to copy the last block of a {entry.n_tokens}-token prefix"
                )
        self.journal.record("restore", slot, key=entry.key)
        if entry.buf is not None:
            # No host sync: the step's stream reads the buffer after its save's copies are done,
            # and whoever writes the buffer next is ordered after this read (see state_copies).
            self._copies.after(entry.done)
            for state, layer_segs in zip(self._states, entry.layout, strict=True):
                state.load(slot, [segment(entry.buf, off, dtype, shape) for off, dtype, shape in layer_segs])
        return entry.n_tokens

    def before_writes(self, slots: Iterable[int]) -> None:
        """The step is about to write these slots' states (forward, reset, restore): it waits, on
        the device, for the checkpoint copies still reading them."""
        self._copies.settle(slots)

    def prewarm(self, count: int) -> int:
        """Put up to `count` checkpoint-sized buffers into the pool at load, so a burst of saves
        does not allocate (and pin) a fresh one each inside a step. Returns the buffers added."""
        if self._pool is None or count < 1 or not self._states:
            return 0
        nbytes = checkpoint_bytes(self._states)
        if nbytes == 0:
            return 0
        count = min(count, self._budget() // nbytes)
        return self._pool.reserve(nbytes, count) if count > 0 else 0

    def shed(self) -> int:
        """Drop every entry, blocks and buffers back to their pools; returns the bytes released."""
        with self._lock:
            dropped = list(self._entries.values())
            self._entries.clear()
            self._lengths.clear()
            released, self._held = self._held, 0
            if dropped:
                self._sheds += 1
                if self.listener is not None:
                    self.listener.cleared()
        for e in dropped:
            self._give_back(e)
        return released

    def follow_moves(self, moves: dict[int, int]) -> None:
        """The KV pool moved blocks (compaction): entries name them by their new ids."""
        if not moves:
            return
        with self._lock:
            for e in self._entries.values():
                e.blocks = tuple(moves.get(b, b) for b in e.blocks)

    def evict_for_blocks(self, n_blocks: int, keep: PrefixKey | None = None) -> bool:
        """Evict LRU entries until the KV pool has n_blocks free (a running sequence needs blocks
        more than a prompt that may come back); False if even an empty cache leaves too few.
        `keep`: an entry never evicted (its blocks are about to be attached)."""
        kv = self._kv
        if kv is None:
            return False
        while kv.alloc.free_blocks < n_blocks:
            with self._lock:
                if not self._entries or next(iter(self._entries)) == keep:
                    break
                e = self._pop_lru()
            self._give_back(e)
        return kv.alloc.free_blocks >= n_blocks

    @property
    def bytes_held(self) -> int:
        return self._held

    # --- internals -------------------------------------------------------------------------
    def _make_room(self, nbytes: int) -> bool:
        """Evict least recently used entries until nbytes more fit the live budget."""
        budget = self._budget()
        dropped: list[_Entry] = []
        with self._lock:
            while self._entries and self._held + nbytes > budget:
                dropped.append(self._pop_lru())
            fits = self._held + nbytes <= budget
        for e in dropped:
            self._give_back(e)
        return fits

    def _pop_lru(self) -> _Entry:
        """Unlink the least recently used entry (call under the lock; the caller gives it back)."""
        key, e = self._entries.popitem(last=False)
        if self.listener is not None:
            self.listener.removed(key)
        forget_length(self._lengths, e.n_tokens)
        self._held -= e.nbytes
        self._evictions += 1
        return e

    def _buffer(self, nbytes: int) -> Tensor | None:
        try:
            return host_buffer(self._pool, nbytes, self._cuda)
        except (RuntimeError, MemoryError) as e:
            # The pool already trimmed itself and retried once. A checkpoint is an optimisation:
            # give back everything the cache holds and go on without this one (logged, counted).
            released = self.shed()
            with self._lock:
                self._declined += 1
            log.warning(
                "checkpoint buffer of %d bytes failed (%s); prefix cache shed %d bytes", nbytes, e, released
            )
            return None

    def _give_back(self, e: _Entry) -> None:
        self.journal.drop(e.key)
        if self._kv is not None and e.blocks:
            self._kv.drop(e.blocks)
        if e.buf is None:
            return
        self._copies.after(e.done)  # the next owner of the buffer comes after its copies
        if self._pool is not None:
            # The fence follows the save's copies and every restore that read the buffer: a buffer
            # the pool declines or drops is freed once it completes, never by waiting here.
            self._pool.put(e.buf, self._copies.fence())
