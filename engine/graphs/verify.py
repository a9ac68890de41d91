"""CUDA graphs of verify steps (engine.spec): every sequence of the step a decode token and its
drafts, with logits at each token, its recurrent layers keeping the state after each position in
the workspace the runner leases (`VerifySize`). Eager, such a step is bound by kernel launches as
a decode step is (the 6.2B hybrid's one-row step of 3 drafts took 113-128 ms on an H100, s26's
second forward after a rejection included, against a 5.1 ms replayed decode step); replayed, it
is one launch.

A step of n such rows of m tokens replays the graph of the smallest batch bucket >= n (1, 2, 4, ...
up to the workspace's rows) and m: one row at every draft length (one stream drafts the length its
acceptance pays for), more rows at k + 1 tokens (`verify_keys`). One graph serves every context,
since the prefill attention kernel a verify row takes reads each row's context on the device (a
decode graph's split-K tiling follows its context bucket; this kernel's does not). Rows of unequal
length, more rows of fewer drafts, verify rows beside other rows, or a step reading the int8 KV
store run eagerly. Padding rows feed token 0 at positions PAD_POSITION.. of the decode graphs'
scratch slot (given KV blocks for them first) and keep their states in workspace rows no real row of the
step uses.

Inputs enter through one static buffer (`verify_layout`: tokens, positions and slot of each token,
then each row's slot and start; one host-to-device copy a step); every graph writes one static
[rows x (k + 1), vocab] logits buffer (its first n x m rows), valid until the next replay. What
the graphs' pool holds is measured and leased by the caller (tag cuda-graphs-verify).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ballast.engine.graphs.decode import (
    PAD_POSITION,
    PAD_TOKEN,
    Forward,
    GraphCaptureError,
    GraphSet,
    Leftover,
    as_batch,
    bucket_for,
    doubling_buckets,
)
from ballast.models.base import Rows, StepBatch
from ballast.models.layers import pointwise
from torch import Tensor

TOKEN_FIELDS = ("token_ids", "positions", "slot_of_token")  # width x length entries each
ROW_FIELDS = ("slots", "starts")  # width entries each


def verify_layout(width: int, length: int) -> dict[str, tuple[int, int]]:
    """Where each staged field sits in the static buffer of up to `width` rows of `length` tokens:
    name -> (offset, entries). Every field starts on 16 bytes (an even int64 offset): Triton
    compiles a kernel once per alignment of a pointer argument."""
    out: dict[str, tuple[int, int]] = {}
    at = 0
    for name in TOKEN_FIELDS + ROW_FIELDS:
        size = width * length if name in TOKEN_FIELDS else width
        out[name] = (at, size)
        at += size + size % 2
    return out


def buffer_size(layout: dict[str, tuple[int, int]]) -> int:
    at, size = max(layout.values())
    return at + size + size % 2


def verify_keys(buckets: Sequence[int], drafts: int) -> tuple[tuple[int, int], ...]:
    """The (rows, tokens a row) graphs to capture, largest first: one row at every draft length
    (one stream drafts what its acceptance pays for, the governor's choice step by step), more rows
    at the longest (k + 1 tokens each)."""
    keys = {(1, n + 1) for n in range(1, drafts + 1)} | {(b, drafts + 1) for b in buckets}
    return tuple(sorted(keys, key=lambda key: (key[0] * key[1], key), reverse=True))


def verify_key(batch: StepBatch, buckets: Sequence[int], keep: bool) -> tuple[int, int] | None:
    """(batch bucket, tokens a row) of a step a verify graph may serve, or None: every sequence
    as many tokens, more than one, with logits at each, all marked to keep their per-position
    states (`StepBatch.verify`) where the model keeps them (`keep`: it has recurrent layers), none
    marked where it does not."""
    n, length = batch.num_seqs, batch.max_len
    if length < 2 or min(batch.lens_list) != length:
        return None
    if len(batch.all_logits) != n or not all(batch.all_logits):
        return None
    marked = len(batch.verify) == n and all(batch.verify)
    if (keep and not marked) or (not keep and any(batch.verify)):
        return None
    bucket = bucket_for(buckets, n)
    return None if bucket is None else (bucket, length)


def staged(
    batch: StepBatch | None,
    layout: dict[str, tuple[int, int]],
    width: int,
    length: int,
    scratch_slot: int,
    out: Tensor | None = None,
) -> Tensor:
    """The static buffer's host image (`layout`) for this step of rows of `length` tokens (None:
    padding alone): its rows, then padding rows at the scratch slot, positions PAD_POSITION ..
    PAD_POSITION + length - 1; the token fields' first width x length entries."""
    host = out if out is not None else torch.zeros(buffer_size(layout), dtype=torch.int64)
    n = batch.num_seqs if batch is not None else 0
    pad = width - n
    slots = (batch.slots_list if batch is not None else []) + [scratch_slot] * pad
    starts = (batch.starts_list if batch is not None else []) + [PAD_POSITION] * pad
    tokens = (batch.tokens.tolist() if batch is not None else []) + [PAD_TOKEN] * (pad * length)
    fields = {  # plain lists: a step's few hundred entries cost microseconds, not a tensor op each
        "token_ids": tokens,
        "positions": [start + j for start in starts for j in range(length)],
        "slot_of_token": [slot for slot in slots for _ in range(length)],
        "slots": slots,
        "starts": starts,
    }
    image = [0] * host.shape[0]
    for name, (at, _) in layout.items():
        image[at : at + len(fields[name])] = fields[name]
    host.copy_(torch.tensor(image, dtype=torch.int64))
    return host


class VerifyGraphs(GraphSet[tuple[int, int]]):
    """Verify-step graphs over a model's slot states and verify workspace, per (rows, tokens a row)."""

    def __init__(
        self,
        device: torch.device,
        scratch_slot: int,
        rows: int,
        drafts: int,
        max_context: int,
        keep: bool,
        leftover: Leftover | None = None,
    ) -> None:
        """rows, drafts: the verify steps the workspace is sized for (`VerifySize`); keep: the
        model's recurrent layers keep per-position states (the rows are marked to)."""
        super().__init__(device, leftover)
        if drafts < 1:
            raise GraphCaptureError(f"a verify graph needs at least one draft a row, got {drafts}")
        self.scratch_slot = scratch_slot
        self.buckets = doubling_buckets(1, rows)
        self.keys = verify_keys(self.buckets, drafts)
        self.max_context = max_context
        self.keep = keep
        self._width, self.length = self.buckets[-1], drafts + 1
        self._layout = verify_layout(self._width, self.length)
        self._inputs = torch.zeros(buffer_size(self._layout), dtype=torch.int64, device=device)
        self._arange = torch.arange(self._width * self.length, dtype=torch.int64, device=device)
        # What does not change from step to step, per row length n: lens, cu_lens, each token's row.
        ar = self._arange
        self._fixed = {
            n: (ar[: self._width] * 0 + n, ar[: self._width + 1] * n, ar // n) for _, n in self.keys
        }

    def capture(self, forward: Forward) -> int:
        """Capture every key, largest first so the others fit in the pool it sized. Returns the
        bytes the device allocator holds more than before; raises GraphCaptureError (none kept)."""
        before = self._reserved()
        self._pool = torch.cuda.graph_pool_handle()
        try:
            for key in self.keys:
                self._stage(None, key[1])
                batch = self._static_batch(*key)
                with pointwise.fused():  # as the decode graphs: fused kernels cost a replay nothing
                    eager = forward(batch)  # first eagerly: kernels compiled and tuned outside the capture
                    self._record(key, forward, batch, eager, self._width * self.length)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self.release()
            raise GraphCaptureError(f"verify graph capture failed: {type(e).__name__}: {e}") from e
        self.held_bytes = max(0, self._reserved() - before)
        return self.held_bytes

    def release(self) -> None:
        """Drop every graph and its output."""
        self._drop()

    def key_of(self, seqs: StepBatch | Rows) -> tuple[int, int] | None:
        """The key of a step these graphs serve (`verify_key`), captured or not."""
        return verify_key(as_batch(seqs), self.buckets, self.keep) if seqs else None

    def can_use(self, seqs: StepBatch | Rows, mixed: bool = False) -> bool:
        """A captured graph serves this step (`verify_key`); `mixed`: the int8 KV store is in use
        (another kernel sequence, run eagerly)."""
        return bool(self._graphs) and not mixed and self.key_of(seqs) in self._graphs

    def replay(self, seqs: StepBatch | Rows) -> Tensor:
        """Logits [n x tokens a row, vocab], row after row, position after position; a view of the
        graphs' output, valid until the next replay. Call only where `can_use(seqs)`."""
        batch = as_batch(seqs)
        key = self.key_of(batch) or (0, 0)  # (0, 0): no graph's key
        assert key in self._graphs and self._logits is not None, "replay needs can_use(seqs)"
        self._stage(batch, key[1])
        self._graphs[key].replay()
        self.replays += 1
        self._hand_back(key, batch.num_seqs * key[1])
        return self._logits[: batch.num_seqs * key[1]]

    def _stage(self, batch: StepBatch | None, length: int) -> None:
        """The step's rows (and padding) into the static inputs, one copy, then the token ids the
        host does not hold filled on the device."""
        # Pinned and non-blocking: a pageable copy would wait for the step still on the GPU.
        on_gpu = self._inputs.is_cuda
        host = torch.empty(self._inputs.shape[0], dtype=torch.int64, pin_memory=on_gpu)
        staged(batch, self._layout, self._width, length, self.scratch_slot, host)
        self._inputs.copy_(host, non_blocking=on_gpu)
        if batch is not None and batch.fill_tokens is not None:
            n = batch.num_seqs * length
            batch.fill_tokens(self.field("token_ids")[:n], self.field("slot_of_token")[:n])

    def field(self, name: str) -> Tensor:
        at, size = self._layout[name]
        return self._inputs[at : at + size]

    def _static_batch(self, b: int, length: int) -> StepBatch:
        """The batch a graph of b rows of `length` tokens is captured with: views of the static
        inputs and constants. The host-side lists fix shapes and branches only (none at 0)."""
        t, ar = b * length, self._arange
        lens, cu_lens, seq_of_token = self._fixed[length]
        tensors = {
            "token_ids": self.field("token_ids")[:t],
            "positions": self.field("positions")[:t],
            "slots": self.field("slots")[:b],
            "starts": self.field("starts")[:b],
            "lens": lens[:b],
            "cu_lens": cu_lens[: b + 1],
            "logit_index": ar[:t],
            "seq_of_token": seq_of_token[:t],
            "slot_of_token": self.field("slot_of_token")[:t],
            "pad_index": ar[:t],
        }
        rows = [length] * b
        batch = StepBatch.over(tensors, [self.scratch_slot] * b, [PAD_POSITION] * b, rows, self.max_context)
        batch.all_logits = (True,) * b
        batch.verify = (True,) * b if self.keep else ()
        return batch
