"""CUDA graphs of a lone prompt's prefill, padded to a multiple of `GRANULE` tokens. An eager
prefill is bound by the host: measured on an H200 (Llama-3B shape, bf16, a 945-token prompt) the
engine thread took 18-26 ms to launch its ~450 kernels for 11 ms of GPU work, most of an idle
server's time to first token. A graph launches once, for up to GRANULE - 1 padding tokens of work.

A graph of T tokens serves one sequence's chunk of n <= T new tokens at any start, alone in its
step, for models whose rows meet only in attention (`prefill_graphs_safe`: dense attention-only
models): the length, start, slot and last row come from a static device buffer the attention
kernel reads. The T - n padding rows feed token 0 at `PAD_POSITION` of the decode graphs' scratch
slot, whose one block nothing real reads. Longer chunks, batches of prompts, prompt logprobs and
steps that read the int8 KV store run eagerly: a chunk of thousands of tokens is bound by its
matrix products, not its launches.

A chunk beside decode tokens may replay this graph and a decode graph: two reads of the weights
where the eager step makes one, so `split_pays` allows it only where the eager launch, timed at
capture, takes the host longer than both replays take the GPU. The engine leases what the shared
pool holds (tag cuda-graphs-prefill); without room it drops them and prefill runs eagerly.
"""

from __future__ import annotations

import statistics
import time
from array import array
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
)
from ballast.models.base import ForwardBatch, Rows, StepBatch
from torch import Tensor

GRANULE = 128  # tokens between two captured sizes
# Where each sequence field sits in the static buffer after its three token rows; every field
# starts on 16 bytes (Triton compiles a kernel once per alignment of a pointer argument).
_SLOT, _START, _LEN, _CU, _LAST = 0, 2, 4, 6, 8  # _CU: two entries, 0 and the length
_SEQ_FIELDS = 10


def token_buckets(max_tokens: int, granule: int = GRANULE) -> tuple[int, ...]:
    """granule, 2 * granule, ... up to max_tokens rounded down to a granule (none below one)."""
    if granule < 1:
        raise ValueError(f"granule must be >= 1, got {granule}")
    return tuple(range(granule, max_tokens + 1, granule))


class PrefillGraphs(GraphSet[int]):
    """Prefill graphs of one sequence, per token bucket."""

    def __init__(
        self,
        device: torch.device,
        scratch_slot: int,
        max_tokens: int,
        granule: int = GRANULE,
        leftover: Leftover | None = None,
    ) -> None:
        """scratch_slot: the decode graphs' padding slot (it must hold a KV block for PAD_POSITION)."""
        super().__init__(device, leftover)
        self.scratch_slot = scratch_slot
        self.buckets = token_buckets(max_tokens, granule)
        if not self.buckets:
            raise GraphCaptureError(f"no prefill graph size fits {max_tokens} tokens (granule {granule})")
        self._width = self.buckets[-1]
        # [tokens | positions | slot of each token], each `width` long, then the sequence's fields
        self._inputs = torch.zeros(3 * self._width + _SEQ_FIELDS, dtype=torch.int64, device=device)
        self._zeros = torch.zeros(self._width, dtype=torch.int64, device=device)
        self._arange = torch.arange(self._width, dtype=torch.int64, device=device)
        self.replay_s: dict[int, float] = {}  # each graph's GPU time, measured after capture
        self.eager_host_s = 0.0  # the host's time to launch an eager forward (0: not measured)
        self._host_s: list[float] = []

    def capture(self, forward: Forward) -> int:
        """Capture every bucket, largest first so the others fit in the pool it sized. Returns the
        bytes the device allocator holds more than before; raises GraphCaptureError (nothing kept)."""
        before = self._reserved()
        self._pool = torch.cuda.graph_pool_handle()
        try:
            for tokens in reversed(self.buckets):
                self._capture_one(forward, tokens)
            self._time_replays()
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            self.release()
            raise GraphCaptureError(f"prefill graph capture failed: {type(e).__name__}: {e}") from e
        # The first eager forward compiled and tuned kernels: the others time the launches alone.
        later = self._host_s[1:]
        self.eager_host_s = statistics.median(later) if later else 0.0
        self.held_bytes = max(0, self._reserved() - before)
        return self.held_bytes

    def _capture_one(self, forward: Forward, tokens: int) -> None:
        # Captured over a one-token "prompt" in the scratch slot at PAD_POSITION: the kernels see
        # a real length on the device and read only that slot's block.
        self._stage(self.scratch_slot, [PAD_TOKEN], PAD_POSITION, tokens)
        batch = self._static_batch(tokens)
        torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        eager = forward(batch)  # first eagerly: kernels compiled and tuned outside the capture
        self._host_s.append(time.perf_counter() - started)  # launching only: no sync inside
        self._record(tokens, forward, batch, eager, 1)

    def _time_replays(self) -> None:
        """Each graph's GPU time: one replay timed by events after one untimed, over the scratch
        slot's one-token prompt (attention's share is then the least; the matrix products, which
        take most of the time at these sizes, run on every row)."""
        for tokens, graph in self._graphs.items():
            self._stage(self.scratch_slot, [PAD_TOKEN], PAD_POSITION, tokens)
            graph.replay()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            self.replay_s[tokens] = start.elapsed_time(end) / 1e3

    def split_pays(self, n: int, decode_cost: float) -> bool:
        """Whether a step of an n-token chunk beside decode tokens takes less time as this chunk's
        replay plus a decode graph's than launched eagerly: both replays' GPU time under the host's
        time to launch the eager step (which is then what the step waits on). decode_cost: the
        decode replay's GPU time in units of the smallest graph's (both read every weight once; the
        caller adds the KV the decodes read)."""
        bucket = self.bucket_of(n)
        if bucket is None or not self.eager_host_s:
            return False
        gpu_s = self.replay_s[bucket] + decode_cost * self.replay_s[self.buckets[0]]
        return gpu_s < self.eager_host_s

    def release(self) -> None:
        """Drop every graph, its output and its timings."""
        self.replay_s.clear()
        self.eager_host_s = 0.0
        self._drop()

    def bucket_of(self, n: int) -> int | None:
        """The smallest captured size >= n tokens, or None."""
        return next((b for b in self.buckets if b >= n and b in self._graphs), None)

    def can_use(self, seqs: StepBatch | Rows, all_logits: Sequence[bool] = (), mixed: bool = False) -> bool:
        """A graph serves this step: one sequence of more than one new token (a decode token is
        the decode graphs'), no more than the largest bucket, last-token logits only, main KV
        store only."""
        if len(seqs) != 1 or mixed or any(all_logits):
            return False
        batch = as_batch(seqs)
        n = batch.lens_list[0]
        return n > 1 and not any(batch.all_logits) and self.bucket_of(n) is not None

    def replay(self, seqs: StepBatch | Rows) -> Tensor:
        """Logits [1, vocab] at the sequence's last token; a view of the graphs' output, valid
        until the next replay. Call only where `can_use(seqs)`."""
        batch = as_batch(seqs)
        bucket = self.bucket_of(batch.lens_list[0])
        assert bucket is not None and self._logits is not None, "replay needs can_use(seqs)"
        self._stage(batch.slots_list[0], batch.tokens, batch.starts_list[0], bucket)
        self._graphs[bucket].replay()
        self.replays += 1
        self._hand_back(bucket, batch.lens_list[0])
        return self._logits

    def _stage(self, slot: int, tokens: Sequence[int], start: int, bucket: int) -> None:
        """The step's tokens, positions and slots (padding to `bucket`) and its sequence fields
        into the static inputs, in one copy."""
        n, w = len(tokens), self._width
        # Pinned and non-blocking: a pageable copy would wait for the step still on the GPU.
        on_gpu = self._inputs.is_cuda
        host = torch.empty(3 * w + _SEQ_FIELDS, dtype=torch.int64, pin_memory=on_gpu)
        flat = tokens if isinstance(tokens, array) else array("q", tokens)
        host[:n] = torch.frombuffer(flat, dtype=torch.int64)
        host[n:w] = PAD_TOKEN
        torch.arange(start, start + n, out=host[w : w + n])
        host[w + n : 2 * w] = PAD_POSITION
        host[2 * w : 2 * w + n] = slot
        host[2 * w + n : 3 * w] = self.scratch_slot
        seq = host[3 * w :]
        seq.zero_()
        seq[_SLOT], seq[_START], seq[_LEN], seq[_CU + 1], seq[_LAST] = slot, start, n, n, n - 1
        self._inputs.copy_(host, non_blocking=on_gpu)

    def _static_batch(self, tokens: int) -> ForwardBatch:
        """The batch a graph of `tokens` rows is captured with: views of the static inputs. The
        host-side lists fix shapes and branches only (one sequence, more than one token)."""
        w, inp = self._width, self._inputs
        seq = inp[3 * w :]
        tensors = {
            "token_ids": inp[:tokens],
            "positions": inp[w : w + tokens],
            "slots": seq[_SLOT : _SLOT + 1],
            "starts": seq[_START : _START + 1],
            "lens": seq[_LEN : _LEN + 1],
            "cu_lens": seq[_CU : _CU + 2],
            "logit_index": seq[_LAST : _LAST + 1],
            "seq_of_token": self._zeros[:tokens],
            "slot_of_token": inp[2 * w : 2 * w + tokens],
            "pad_index": self._arange[:tokens],
        }
        return StepBatch.over(tensors, [self.scratch_slot], [PAD_POSITION], [tokens], PAD_POSITION + tokens)
