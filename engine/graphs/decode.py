"""CUDA graphs of decode steps: captured per (batch bucket, context bucket), static inputs,
explicit `can_use` / `replay`. A decode step is bound by kernel launches, not by the GPU (a
4-layer hybrid's step measured on an H200: ~360 launches, ~9 ms of host time for ~0.6 ms of GPU
work); a graph replays the whole forward with one launch.

A step of n sequences reading up to c positions replays the graph of the smallest batch bucket >= n
(1, 2, 4, ... and `--max-num-seqs` itself) and context bucket >= c. Padding rows feed token 0 at
position 1 of a scratch slot (one past the scheduler's), so they write nothing a sequence reads.
Inputs enter through one static [3, batch] buffer (one host-to-device copy a step); every graph
writes one static [batch, vocab] logits buffer, valid until the next replay. A model that keeps
its hidden states for a drafter (MTP) gets them back after each replay too (`Leftover`).

A step holding a sequence of the int8 KV store (the ladder's quantized-KV rung) runs another kernel
sequence: the "mixed" variant, captured per bucket at its first use under a grant from the memory
layer (tag cuda-graphs-int8; a refusal or failure leaves that bucket eager). Without it a squeezed
GPU decoded ~7x slower (Llama-1B shape, 16 streams at TIGHT, on an H200).

Under tensor parallel every rank captures the same buckets in the same order, the collectives
recorded on each, and after each bucket the ranks agree over the pipes (`Agree`) that all
captured it; one failure and all release. The mixed variant is not captured late there (one rank
capturing alone would wait in its warm-up's collectives). A capture that fails (an op that waits
on the host) raises `GraphCaptureError`: the engine runs eagerly. What the graphs' shared pool
holds is measured and leased from the VRAM ledger by the caller.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast

import torch
from ballast.engine.kv.kv_pool import Acquire
from ballast.memory.types import MiB
from ballast.models.base import ForwardBatch, Rows, StepBatch
from ballast.models.layers import pointwise
from torch import Tensor

log = logging.getLogger(__name__)

Forward = Callable[[ForwardBatch], Tensor]
# Under tensor parallel, after each bucket: this rank's capture error (None: captured); returns
# whether every rank captured it.
Agree = Callable[[str | None], bool]

SMALLEST_CONTEXT_BUCKET = 256
# Asked of the memory layer before a late capture: a graph's own buffers reuse the pool that the
# largest plain graph sized, so the growth is small (often nothing); what it really grew by is
# held instead once measured.
LATE_CAPTURE_GRANT = 64 * MiB
PAD_TOKEN = 0
PAD_POSITION = 1
K = TypeVar("K")


class GraphCaptureError(RuntimeError):
    """Capturing the decode graphs failed; the engine runs eagerly instead."""


class WarmupFailed(RuntimeError):
    """The eager forward before a capture failed on this rank. Under tensor parallel its
    collectives ran for real, so the ranks may now be out of step: not a capture failure to agree
    on and go eager, but a fault of the group."""


def doubling_buckets(first: int, limit: int) -> tuple[int, ...]:
    """first, 2*first, 4*first, ... below limit, then limit itself (first capped at limit)."""
    if limit < 1:
        raise ValueError(f"bucket limit must be >= 1, got {limit}")
    out = []
    b = min(first, limit)
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return tuple(out)


def bucket_pairs(
    batch_buckets: Sequence[int],
    context_buckets: Sequence[int],
    read_bytes_per_position: int,
    budget_bytes: int,
) -> tuple[tuple[int, int], ...]:
    """The (batch, context) buckets to capture, largest first: those whose step reads of batch x
    context cache positions (attention gathers each slot's K/V up to the context) take at most
    budget_bytes. A graph's pool keeps its peak for good, so a 256-slot, 32k-context graph of a
    real model (tens of GiB) is left to the eager path, which only pays it when a step needs it."""
    pairs = sorted(
        ((b, c) for b in batch_buckets for c in context_buckets), key=lambda p: (p[0] * p[1], p), reverse=True
    )
    return tuple(p for p in pairs if p[0] * p[1] * read_bytes_per_position <= budget_bytes)


def bucket_for(buckets: Sequence[int], n: int) -> int | None:
    """The smallest bucket >= n, or None when n is beyond the largest."""
    return next((b for b in buckets if b >= n), None)


class Leftover:
    """What a forward leaves on the model besides its logits, where the model keeps it (a
    drafter's normed hidden states, `last_hidden`, kept where it has `extra_states`): one row per
    token of the step, in the step's order. A capture leaves it in the graph's pool, where each
    replay rewrites it; the graph set keeps it per graph and hands it back after each replay, cut
    to the step's tokens (padding rows come after them)."""

    def __init__(self, model: Any) -> None:
        self._model = model

    @staticmethod
    def of(model: Any) -> Leftover | None:
        return Leftover(model) if getattr(model, "extra_states", 0) else None

    def take(self) -> Tensor | None:
        """What the last forward left (None: nothing since the last take)."""
        value, self._model.last_hidden = self._model.last_hidden, None
        return cast(Tensor | None, value)

    def put(self, value: Tensor) -> None:
        self._model.last_hidden = value


class GraphSet(Generic[K]):
    """Graphs of one forward, keyed by K, sharing one memory pool and one logits buffer, and
    handing back what else the forward leaves on the model (`Leftover`, where there is one)."""

    def __init__(self, device: torch.device, leftover: Leftover | None = None) -> None:
        self.device = device
        self.leftover = leftover
        self._left: dict[K, Tensor] = {}  # per graph: what its capture left, rewritten by each replay
        self._graphs: dict[K, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # torch.cuda.graph_pool_handle(), from the first capture
        self._logits: Tensor | None = None  # every graph writes its rows here
        self.held_bytes = 0
        self.replays = 0

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def _reserved(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device)

    def _record(self, key: K, forward: Forward, batch: ForwardBatch, eager: Tensor, rows: int) -> None:
        """Capture `forward(batch)` after its eager run (kernels compiled and tuned outside the
        capture). One shared output: a graph's own logits are freed at the end of its capture, so
        the graphs together keep one [rows, vocab] buffer, not one each."""
        if self._logits is None:
            self._logits = eager.new_empty((rows, *eager.shape[1:]))
        out = self._logits[: eager.shape[0]]
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        if self.leftover is not None:
            self.leftover.take()  # the eager run's: the capture's own is kept
        with torch.cuda.graph(graph, pool=self._pool):
            out.copy_(forward(batch))
        torch.cuda.synchronize(self.device)
        self._graphs[key] = graph
        self._keep(key)

    def _keep(self, key: K) -> None:
        """After the forward captured as key's graph: what it left on the model, kept."""
        if self.leftover is not None:
            left = self.leftover.take()
            if left is None:
                raise GraphCaptureError("the forward left none of the hidden states the model keeps")
            self._left[key] = left

    def _hand_back(self, key: K, tokens: int) -> None:
        """After key's replay: what its forward left on the model, for the step's first `tokens`."""
        if self.leftover is not None:
            self.leftover.put(self._left[key][:tokens])

    def _drop(self) -> None:
        """Drop every graph and the output; the pool's memory goes back to the allocator's cache."""
        self._graphs.clear()
        self._left.clear()
        self._logits = None
        self.held_bytes = 0
        if self.device.type == "cuda":  # CPU sets exist in tests of the choices alone
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


class DecodeGraphs(GraphSet[tuple[int, int, bool]]):
    """Decode-step graphs over a model's slot states."""

    def __init__(
        self,
        device: torch.device,
        scratch_slot: int,
        max_batch: int,
        max_context: int,
        late_mixed: bool = True,
        leftover: Leftover | None = None,
    ) -> None:
        """late_mixed: capture the int8-KV variant of a bucket at its first use (one GPU only)."""
        super().__init__(device, leftover)
        self.late_mixed = late_mixed
        self.scratch_slot = scratch_slot
        self.batch_buckets = doubling_buckets(1, max_batch)
        self.context_buckets = doubling_buckets(SMALLEST_CONTEXT_BUCKET, max_context)
        self.pairs = bucket_pairs(self.batch_buckets, self.context_buckets, 0, 0)  # every pair
        width = self.batch_buckets[-1]
        self._inputs = torch.zeros((3, width), dtype=torch.int64, device=device)  # token, position, slot
        self._arange = torch.arange(width + 1, dtype=torch.int64, device=device)
        self._ones = torch.ones(width, dtype=torch.int64, device=device)
        self._failed: set[tuple[int, int, bool]] = set()  # late captures that failed: eager
        # The memory layer's grants for late captures (the mixed variant), set by the engine.
        self.acquire: Acquire | None = None
        self._late_grants: list[Callable[[], None]] = []
        self._forward: Forward | None = None

    def capture(self, forward: Forward, agree: Agree | None = None) -> int:
        """Capture a graph for each of `pairs`, largest first so later graphs fit in the pool the
        first one sized. Returns the bytes the device allocator holds more than before.
        agree (tensor parallel): asked after every bucket, so all ranks stop at the same one."""
        before = self._reserved()
        self._pool = torch.cuda.graph_pool_handle()
        self._forward = forward
        try:
            for b, c in self.pairs:
                error = self._try_capture((b, c, False), lockstep=agree is not None)
                if agree is not None and not agree(error):
                    raise GraphCaptureError(
                        f"decode graph (batch {b}, context {c}) not captured on every rank: "
                        f"{error or 'another rank failed'}"
                    )
                if error is not None:
                    raise GraphCaptureError(f"decode graph capture failed: {error}")
        except BaseException:
            self.release()
            raise
        self.held_bytes = max(0, self._reserved() - before)
        return self.held_bytes

    def _try_capture(self, key: tuple[int, int, bool], lockstep: bool) -> str | None:
        """Capture one bucket; its error as text, or None. A failed warm-up is returned too on
        one GPU, but raised under tensor parallel (see `WarmupFailed`)."""
        try:
            self._capture_one(key)
        except WarmupFailed as e:
            if lockstep:
                raise
            return f"{e.__cause__ or e}"
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    def _capture_one(self, key: tuple[int, int, bool]) -> None:
        assert self._forward is not None
        b, c, mixed = key
        batch = self._static_batch(b, c, mixed)
        self._stage([])
        with pointwise.fused():  # a graph's fused kernels cost the host nothing when replayed
            try:
                eager = self._forward(batch)  # first eagerly: kernels compiled and tuned outside the capture
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
                raise WarmupFailed(f"warm-up forward of batch {b}, context {c} failed: {e}") from e
            self._record(key, self._forward, batch, eager, max(w for w, _ in self.pairs))

    def _capture_late(self, key: tuple[int, int, bool]) -> bool:
        """Capture the mixed variant of a bucket whose plain graph exists, at its first use. The
        memory layer is asked first (`acquire`, for LATE_CAPTURE_GRANT: a refusal leaves the
        bucket eager), and what the graphs' pool grew by is then held under the memory layer's
        grant instead. A failure (no memory for the pool to grow, under the very pressure that
        made it mixed) is logged once and leaves the bucket eager."""
        if key in self._failed or (key[0], key[1], False) not in self._graphs or self._forward is None:
            return False
        provisional = self.acquire(LATE_CAPTURE_GRANT) if self.acquire is not None else None
        if self.acquire is not None and provisional is None:
            return self._give_up(key, "the memory layer has no room for it")
        before = torch.cuda.memory_reserved(self.device)
        try:
            self._capture_one(key)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            return self._give_up(key, str(e), provisional)
        grew = max(0, torch.cuda.memory_reserved(self.device) - before)
        self.held_bytes += grew
        if provisional is not None:
            provisional()
        if not grew or self.acquire is None:
            return True
        held = self.acquire(grew)
        if held is None:
            # Grown past what was just given back, and the rest refused. The memory is allocated
            # already (the graphs' pool is shared: dropping this graph would not free it), so the
            # provisional part stays held and the rest is said, not silently ours.
            held = self.acquire(LATE_CAPTURE_GRANT)
            log.warning(
                "decode graphs grew %.1f MiB, %.1f MiB beyond the memory layer's grant",
                grew / MiB,
                (grew - LATE_CAPTURE_GRANT) / MiB,
            )
        if held is not None:
            self._late_grants.append(held)
        return True

    def _give_up(self, key: tuple[int, int, bool], why: str, grant: Callable[[], None] | None = None) -> bool:
        if grant is not None:
            grant()
        self._failed.add(key)
        log.warning("decode graph (batch %d, context %d, int8 KV in use) not captured: %s", *key[:2], why)
        return False

    def release(self) -> None:
        """Drop every graph, its output and the late captures' grants."""
        self._failed.clear()
        self._forward = None
        self._drop()
        for give_back in self._late_grants:  # after the memory went back
            give_back()
        self._late_grants.clear()

    def can_use(self, seqs: StepBatch | Rows, mixed: bool = False) -> bool:
        """A graph serves this step: every sequence feeds one token, and the batch and the cache
        positions read fit a captured bucket. `mixed`: the int8 KV store is in use (its variant
        is captured here at its first use)."""
        if not self._graphs or not seqs:
            return False
        batch = as_batch(seqs)
        if not batch.decode_only:
            return False
        key = self.key_of(batch, mixed)
        if key is None:
            return False
        return key in self._graphs or (mixed and self.late_mixed and self._capture_late(key))

    def stage(self, batch: StepBatch, mixed: bool = False) -> tuple[int, int, bool]:
        """Write the step's rows into the static inputs (call only where `can_use`); the key of
        the graph that serves it, to `launch`."""
        key = self.key_of(batch, mixed)
        assert key in self._graphs and self._logits is not None, "replay needs can_use(seqs)"
        self._stage(batch, key[0])
        return key

    def launch(self, key: tuple[int, int, bool], n: int) -> Tensor:
        """Replay the staged step's graph: logits [n, vocab], valid until the next replay."""
        assert self._logits is not None
        self._graphs[key].replay()
        self.replays += 1
        self._hand_back(key, n)
        return self._logits[:n]

    def key_of(self, seqs: StepBatch | Rows, mixed: bool = False) -> tuple[int, int, bool] | None:
        """(batch bucket, context bucket, mixed) of this decode step, captured or not."""
        batch = as_batch(seqs)
        b = bucket_for(self.batch_buckets, batch.num_seqs)
        c = bucket_for(self.context_buckets, max(batch.starts_list) + 1)
        return None if b is None or c is None else (b, c, mixed)

    def _stage(self, seqs: StepBatch | Rows, width: int | None = None) -> None:
        """Write the step's rows into the static inputs (padding the rest), one copy, and fill
        the token ids the host does not hold there."""
        width = width or self.batch_buckets[-1]
        b = as_batch(seqs) if seqs else None
        rows: list[list[int]] = [[], [], []] if b is None else [list(b.tokens), b.starts_list, b.slots_list]
        pad = width - len(rows[0])
        fill = (PAD_TOKEN, PAD_POSITION, self.scratch_slot)
        # Pinned and non-blocking: a pageable copy would wait for the step still on the GPU.
        on_gpu = self._inputs.is_cuda
        host = torch.tensor(
            [row + [v] * pad for row, v in zip(rows, fill, strict=True)], dtype=torch.int64, pin_memory=on_gpu
        )
        self._inputs[:, :width].copy_(host, non_blocking=on_gpu)
        if b is not None and b.fill_tokens is not None:
            b.fill_tokens(self._inputs[0, : b.num_seqs], self._inputs[2, : b.num_seqs])

    def _static_batch(self, b: int, c: int, mixed: bool = False) -> ForwardBatch:
        """The batch a graph is captured with: views of the static inputs. For a decode token the
        start is its position; the host-side lists only fix shapes and branch choices (one token
        per sequence, none starting at 0)."""
        inp, ar = self._inputs, self._arange
        tensors = {
            "token_ids": inp[0, :b],
            "positions": inp[1, :b],
            "slots": inp[2, :b],
            "starts": inp[1, :b],
            "lens": self._ones[:b],
            "cu_lens": ar[: b + 1],
            "logit_index": ar[:b],
            "seq_of_token": ar[:b],
            "slot_of_token": inp[2, :b],
            "pad_index": ar[:b],
        }
        return StepBatch.over(tensors, [self.scratch_slot] * b, [PAD_POSITION] * b, [1] * b, c, mixed)


def as_batch(seqs: StepBatch | Rows) -> StepBatch:
    """The host half of a step given as rows (tests, tensor-parallel workers), or the batch itself."""
    return seqs if isinstance(seqs, StepBatch) else StepBatch.of(seqs)
