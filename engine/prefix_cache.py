"""The prefix cache: slot states saved at chosen prompt positions, restored for a later prompt that
starts with the same tokens, so only the rest is prefilled.

KV can be truncated, a recurrent (linear-attention / SSM) state cannot: the state after n tokens
exists only at the moment the slot has consumed exactly n tokens. So a checkpoint is taken at the
end of a step whose prefill chunk ends at n (the scheduler splits chunks at `checkpoint_interval`
multiples and at the end of each prompt) or when a request finishes (its slot holds prompt +
output[:-1]). One entry holds everything needed to resume at n: the KV blocks of positions [0, n),
shared by reference with the slot (the pool's own blocks, not a copy; a slot restoring the entry
copies only a partly filled last block), and a copy of every recurrent layer's conv + recurrent
state.

Recurrent copies live in buffers from the memory layer's `CheckpointPool` (pinned on CUDA, so the
copies run at full speed, and recycled, so a new checkpoint does not page-fault a fresh mmap; the
saves of a full batch of requests find their buffers there from load on, so a burst of saves
allocates nothing inside a step). On CUDA neither a save nor a restore waits on the host: the
copies run on a side stream and are ordered against later users on the device (`state_copies`). The
cache is bounded by a live byte budget (a fraction of the effective, cgroup-aware host memory)
that counts the buffers it holds and the KV blocks it keeps alive; it evicts least recently used
entries to fit (and when the KV pool runs short of blocks), and is emptied by `shed()` when the
ladder reaches WATCH: cached state is the cheapest memory to give back, since nothing running
depends on it.

Threads: `match` runs on the event loop (the scheduler asks it while building a plan); every other
method runs on the engine thread. The index is guarded by a lock. Entries change only inside a step
(saves insert and evict, a plan's shed empties), and the scheduler has one plan in flight, so an
entry it matched while building plan P is still there when P's restores run (restores run first).

Under tensor parallel each rank holds its own shard of every slot state: each copy made here is
also recorded in `journal` (a `CheckpointOp`), and the other ranks make the same copy of theirs
(`shard_checkpoints`). Every decision (what is kept, evicted, restored) stays here, on rank 0.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from ballast.engine.cache_events import CacheListener, prefix_key
from ballast.engine.kv_pool import KVPool
from ballast.engine.shard_checkpoints import CheckpointOp
from ballast.engine.state_copies import STAGING_BYTES, StateCopies
from ballast.memory.pool import CheckpointPool
from ballast.models.state import LayerState
from torch import Tensor

from ballast.settings import check, setting

log = logging.getLogger(__name__)

# Segment offsets inside a buffer are aligned so any dtype can be viewed at them (and so CUDA
# copies stay on their fast path).
_ALIGN = 64
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


class CheckpointMissing(LookupError):
    """A restore names a prefix the cache does not hold: evicted after the scheduler planned the
    restore (it plans a step while the one before runs); the engine skips that slot's step."""


@dataclass(eq=False)
class _Parked:
    """A preempted sequence moved out of the KV pool: its blocks' contents and its recurrent
    states in one host buffer (pinned on CUDA), until the sequence resumes."""

    n_tokens: int
    buf: Tensor
    kv: KVPool  # the pool its blocks came from, and go back to
    n_blocks: int
    views: tuple[tuple[int, torch.dtype, torch.Size], ...]  # recurrent layers' tensors, then block tensors
    key: int = 0  # the other ranks' name for it (see `journal`)


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
    # Per layer, per tensor: (offset, dtype, shape) of the segment holding it.
    layout: tuple[tuple[tuple[int, torch.dtype, torch.Size], ...], ...]
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
        self._entries: OrderedDict[tuple[int, bytes], _Entry] = OrderedDict()  # LRU first
        self._lengths: Counter[int] = Counter()  # n_tokens of the entries, for match
        self._held = 0
        self._saves = self._duplicates = self._declined = self._restores = self._evictions = self._sheds = 0
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._parked: dict[tuple[int, bytes], _Parked] = {}
        self._parked_lengths: Counter[int] = Counter()
        self._copies = StateCopies(self._device, staging_bytes)
        # Tensor parallel: where the copies are recorded for the other ranks (None: one rank).
        self.journal: list[object] | None = None
        self._next_key = 0
        # Told of every entry stored, evicted or shed (the KV-event publisher; None: nobody).
        self.listener: CacheListener | None = None

    # --- any thread ------------------------------------------------------------------------
    def match(self, prompt: Sequence[int]) -> int:
        """The longest cached prefix of `prompt` shorter than it (at least one token must still be
        prefilled to produce the first logits); 0 if none."""
        with self._lock:
            return _longest(self._lengths, self._entries, prompt)

    def match_parked(self, tokens: Sequence[int]) -> int:
        """The length of the longest parked sequence whose tokens start `tokens` (shorter than it:
        one token is always fed after a resume); 0 if none."""
        with self._lock:
            return _longest(self._parked_lengths, self._parked, tokens)

    def entry_keys(self) -> frozenset[tuple[int, bytes]]:
        """The names (`prefix_key`) of the checkpoints held now."""
        with self._lock:
            return frozenset(self._entries)

    def stats(self) -> PrefixCacheStats:
        with self._lock:
            parked = sum(p.buf.numel() for p in self._parked.values())
            return PrefixCacheStats(
                len(self._entries),
                self._held,
                self._saves,
                self._duplicates,
                self._declined,
                self._restores,
                self._evictions,
                self._sheds,
                len(self._parked),
                parked,
            )

    # --- engine thread ---------------------------------------------------------------------
    def save(self, slot: int, prefix: Sequence[int]) -> bool:
        """Keep the slot's state, which has consumed exactly `prefix`: its KV blocks by reference,
        its recurrent states copied. False if the checkpoint does not fit the budget at all
        (nothing is evicted for it then)."""
        n = len(prefix)
        key = prefix_key(prefix)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self._duplicates += 1
                return True
        views = [s.slot_views(slot) for s in self._states]
        layout, buf_bytes = _layout(views)
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
                (src, _segment(buf, off, dtype, shape))
                for layer_views, layer_layout in zip(views, layout, strict=True)
                for src, (off, dtype, shape) in zip(layer_views, layer_layout, strict=True)
            ]
            done = self._copies.copy_out(slot, pairs, buf, buf_bytes)
        blocks = kv.hold(slot, n) if kv is not None else ()
        nbytes = (buf.numel() if buf is not None else 0) + block_bytes
        name = self._record("save", slot)
        with self._lock:
            self._entries[key] = _Entry(n, blocks, buf, nbytes, layout, done, name)
            self._lengths[n] += 1
            self._held += nbytes
            self._saves += 1
        if self.listener is not None:
            self.listener.stored(key, prefix)
        return True

    def park(self, slot: int, tokens: Sequence[int], kv: KVPool) -> bool:
        """Copy a sequence the engine is preempting out of the pool: the KV blocks holding its
        tokens (from `kv`, the pool it lives in) and its recurrent states, into a host buffer. The
        caller then releases its blocks; `restore` of the same tokens brings it back without a
        recompute. False (nothing held) when no host buffer can be had: it is recomputed then."""
        n = len(tokens)
        blocks = kv.table(slot)[: -(-n // kv.layout.block_size)]
        views = self._sequence_views(slot, kv, blocks)
        layout, nbytes = _layout([views])
        buf = self._buffer(nbytes, shed_on_failure=False) if nbytes else None
        if buf is None:
            return False
        for src, (off, dtype, shape) in zip(views, layout[0], strict=True):
            _segment(buf, off, dtype, shape).copy_(src, non_blocking=self._cuda)
        self._sync()
        key = prefix_key(tokens)
        name = self._record("park", slot, kv, blocks)
        with self._lock:
            old = self._parked.pop(key, None)
            self._parked[key] = _Parked(n, buf, kv, len(blocks), layout[0], name)
            if old is None:
                self._parked_lengths[n] += 1
        if old is not None:
            self._release_parked(old)
        return True

    def unpark(self, tokens: Sequence[int]) -> bool:
        """Drop the parked sequence that `tokens` would resume (its request ended while it waited)."""
        n = self.match_parked(tokens)
        if n == 0:
            return False
        self._release_parked(self._take_parked(prefix_key(tokens[:n])))
        return True

    def drop_parked(self, tokens: Sequence[int]) -> bool:
        """Drop the sequence parked with exactly these tokens (a step that parked it failed, so
        nobody will resume it); False if there is none."""
        key = prefix_key(tokens)
        with self._lock:
            if key not in self._parked:
                return False
        self._release_parked(self._take_parked(key))
        return True

    def unpark_all(self) -> None:
        with self._lock:
            parked = list(self._parked.values())
            self._parked.clear()
            self._parked_lengths.clear()
        for p in parked:
            self._release_parked(p)

    def parked_pool(self, prefix: Sequence[int]) -> KVPool | None:
        """The pool a parked sequence of exactly `prefix` goes back to; None if it is not parked."""
        with self._lock:
            parked = self._parked.get(prefix_key(prefix))
            return parked.kv if parked is not None else None

    def restore(self, slot: int, prefix: Sequence[int]) -> int:
        """Start the (empty) slot from the parked sequence or the checkpoint of exactly `prefix`;
        returns its token count. A parked sequence needs fresh blocks in its pool: CheckpointMissing
        when they cannot be had (it stays parked)."""
        key = prefix_key(prefix)
        with self._lock:
            parked = self._parked.get(key)
        if parked is not None:
            return self._unpark_into(slot, key, parked)
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
        self._record("restore", slot, key=entry.key)
        if entry.buf is not None:
            # No host sync: the step's stream reads the buffer after its save's copies are done,
            # and whoever writes the buffer next is ordered after this read (see state_copies).
            self._copies.after(entry.done)
            for state, layer_layout in zip(self._states, entry.layout, strict=True):
                state.load(
                    slot, [_segment(entry.buf, off, dtype, shape) for off, dtype, shape in layer_layout]
                )
        return entry.n_tokens

    def before_writes(self, slots: Iterable[int]) -> None:
        """The step is about to write these slots' states (forward, reset, restore): it waits, on
        the device, for the checkpoint copies still reading them."""
        self._copies.settle(slots)

    def prewarm(self, count: int) -> int:
        """Put up to `count` buffers of one checkpoint's size into the pool now (at load), so a
        burst of saves finds them there instead of allocating, and on CUDA pinning, a fresh one
        each inside a step; the pool keeps them through idle trims. Returns the buffers added."""
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

    def _unpark_into(self, slot: int, key: tuple[int, bytes], parked: _Parked) -> int:
        kv = parked.kv
        if not kv.ensure(slot, parked.n_tokens) and kv is self._kv:
            self.evict_for_blocks(parked.n_blocks)  # cached prefixes go first
        if not kv.ensure(slot, parked.n_tokens):
            raise CheckpointMissing(
                f"no KV blocks to resume a parked {parked.n_tokens}-token sequence (slot {slot})"
            )
        blocks = kv.table(slot)[: parked.n_blocks]
        self._record("unpark", slot, kv, blocks, key=parked.key)
        dests = self._sequence_views(slot, kv, blocks)
        for dst, (off, dtype, shape) in zip(dests, parked.views, strict=True):
            dst.copy_(_segment(parked.buf, off, dtype, shape), non_blocking=self._cuda)
        self._sync()  # the buffer goes back to the pool next
        self._take_parked(key)
        if self._pool is not None:
            self._pool.put(parked.buf)
        with self._lock:
            self._restores += 1
        return parked.n_tokens

    def _take_parked(self, key: tuple[int, bytes]) -> _Parked:
        with self._lock:
            parked = self._parked.pop(key)
            _forget_length(self._parked_lengths, parked.n_tokens)
        return parked

    def _sequence_views(self, slot: int, kv: KVPool, blocks: Sequence[int]) -> list[Tensor]:
        """What a parked sequence's buffer holds, in order: the slot's recurrent layers' tensors,
        then the tensors of its KV blocks."""
        views = [v for s in self._states for v in s.slot_views(slot)]
        return views + [v for b in blocks for v in kv.store.block_views(b)]

    def follow_moves(self, moves: dict[int, int]) -> None:
        """The KV pool moved blocks (compaction): entries name them by their new ids."""
        if not moves:
            return
        with self._lock:
            for e in self._entries.values():
                e.blocks = tuple(moves.get(b, b) for b in e.blocks)

    def evict_for_blocks(self, n_blocks: int, keep: tuple[int, bytes] | None = None) -> bool:
        """Evict least recently used entries until the KV pool has n_blocks free (blocks are worth
        more to a running sequence than to a prompt that may come back); False if even an empty
        cache leaves too few. `keep`: an entry never evicted (its blocks are about to be attached)."""
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
        _forget_length(self._lengths, e.n_tokens)
        self._held -= e.nbytes
        self._evictions += 1
        return e

    def _buffer(self, nbytes: int, shed_on_failure: bool = True) -> Tensor | None:
        try:
            if self._pool is not None:
                return self._pool.get(nbytes)
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._cuda)
        except (RuntimeError, MemoryError) as e:
            # The pool already trimmed itself and retried once. A checkpoint is an optimisation:
            # give back everything the cache holds and go on without this one (logged, counted).
            released = self.shed() if shed_on_failure else 0
            with self._lock:
                self._declined += 1
            log.warning(
                "checkpoint buffer of %d bytes failed (%s); prefix cache shed %d bytes", nbytes, e, released
            )
            return None

    def _record(
        self,
        kind: str,
        slot: int,
        kv: KVPool | None = None,
        blocks: Sequence[int] = (),
        key: int | None = None,
    ) -> int:
        """Journal one copy for the other ranks; returns the key naming what it saves or parks."""
        if key is None:
            self._next_key += 1
            key = self._next_key
        if self.journal is not None:
            store = 0 if kv is None or kv is self._kv else 1  # the main store, or the int8 one
            self.journal.append(CheckpointOp(kind, key, slot, store, tuple(blocks)))
        return key

    def _release_parked(self, p: _Parked) -> None:
        """A parked sequence that will not resume: its buffer goes back (here and on the other ranks)."""
        if self.journal is not None:
            self.journal.append(CheckpointOp("drop", p.key))
        if self._pool is not None:
            self._pool.put(p.buf)

    def _give_back(self, e: _Entry) -> None:
        if self.journal is not None:
            self.journal.append(CheckpointOp("drop", e.key))
        if self._kv is not None and e.blocks:
            self._kv.drop(e.blocks)
        if e.buf is None:
            return
        self._copies.after(e.done)  # the next owner of the buffer comes after its copies
        if self._pool is not None:
            # The fence follows the save's copies and every restore that read the buffer: a buffer
            # the pool declines or drops is freed once it completes, never by waiting here.
            self._pool.put(e.buf, self._copies.fence())

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.current_stream(self._device).synchronize()


def _forget_length(lengths: Counter[int], n: int) -> None:
    """One entry of n tokens is gone: count it out (a length with no entry left is not kept)."""
    lengths[n] -= 1
    if not lengths[n]:
        del lengths[n]


def _longest(
    lengths: Counter[int], entries: Mapping[tuple[int, bytes], object], tokens: Sequence[int]
) -> int:
    """The longest n < len(tokens) with an entry keyed by tokens[:n] (hashes of growing prefixes)."""
    candidates = sorted(n for n in lengths if n < len(tokens))
    h = hashlib.blake2b(digest_size=16)
    prev, best = 0, 0
    for n in candidates:
        h.update(array("q", tokens[prev:n]).tobytes())
        prev = n
        if (n, h.copy().digest()) in entries:
            best = n
    return best


def checkpoint_bytes(states: Sequence[LayerState]) -> int:
    """Bytes of one checkpoint's copy of a slot's recurrent states (0: attention only)."""
    return _layout([s.slot_views(0) for s in states])[1] if states else 0


def _layout(
    views: Sequence[Sequence[Tensor]],
) -> tuple[tuple[tuple[tuple[int, torch.dtype, torch.Size], ...], ...], int]:
    off = 0
    layout = []
    for layer_views in views:
        segs = []
        for t in layer_views:
            off = -(-off // _ALIGN) * _ALIGN
            segs.append((off, t.dtype, t.shape))
            off += t.numel() * t.element_size()
        layout.append(tuple(segs))
    return tuple(layout), off


def _segment(buf: Tensor, off: int, dtype: torch.dtype, shape: torch.Size) -> Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return buf[off : off + nbytes].view(dtype).view(shape)
