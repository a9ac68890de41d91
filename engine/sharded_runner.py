"""Rank 0's runner under tensor parallel: before each forward it sends the step (rows, and the KV
stores' and prefix cache's changes since the last one) to every worker, so all ranks run the same
forward on the same block tables; a decode step it replays from a CUDA graph, every worker
replays from the same bucket (`tp_graphs`).

A step that fails on this rank, or a collective that fails under it, leaves the ranks out of
step: the forward raises `WorkerLost` (a device fault: the step's requests fail with a 5xx and
/health turns red).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from ballast.engine import tp_graphs
from ballast.engine.faults import WorkerLost
from ballast.engine.graphs import PAD_POSITION, FeedLastTokens, GraphCaptureError
from ballast.engine.runner import ModelRunner
from ballast.engine.tp_worker import StepMessage
from ballast.models.base import ForwardBatch, Rows
from torch import Tensor

if TYPE_CHECKING:
    from ballast.engine.tensor_parallel import TPWorkers

# How long rank 0 waits for a worker's answer during the capture: the ranks capture in lockstep
# (their collectives pair), so a live worker answers moments after rank 0 finishes a bucket; the
# bound only matters for one stuck in a collective a failed peer never joined.
CAPTURE_REPLY_TIMEOUT_S = 300.0
Row = tuple[int, tuple[int, ...], int]


class ShardedRunner(ModelRunner):
    """Rank 0's runner: each forward goes to every worker first (see the module doc)."""

    def __init__(self, *args: Any, workers: TPWorkers, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers
        self._pending: tuple[list[Row], list[bool]] | None = None
        self._worker_graph_bytes: list[int] = []
        # Every change the workers must make before the next forward, in the order made here: the
        # KV stores' and (once the engine hands it to its prefix cache) slot-state copies.
        self.journal: list[Any] = []
        if self.kv_manager is not None:
            self.kv_manager.journal_to(self.journal)

    @property
    def sound(self) -> bool:
        return self.workers.lost() is None

    def forward(self, seqs: Rows, all_logits: Sequence[bool] = ()) -> Tensor:
        self._pending = (
            [(int(s), tuple(int(t) for t in toks), int(st)) for s, toks, st in seqs],
            list(all_logits),
        )
        return super().forward(seqs, all_logits)

    def _eager(self, batch: ForwardBatch) -> Tensor:
        rows, every = self._take_pending()
        self.workers.send(self._message(rows, every))
        return self._checked(lambda: self._run(batch))

    def _replay(self, seqs: Rows, last: FeedLastTokens | None, mixed: bool) -> Tensor:
        assert self.graphs is not None
        key = self.graphs.key_of(seqs, mixed)
        assert key is not None and not key[2], "under tensor parallel only plain graphs are captured"
        rows, every = self._take_pending()
        self.workers.send(self._message(rows, every, graph=(key[0], key[1])))
        replay = super()._replay
        return self._checked(lambda: replay(seqs, last, mixed))

    def _take_pending(self) -> tuple[list[Row], list[bool]]:
        assert self._pending is not None, "a tensor-parallel forward goes through forward()"
        pending, self._pending = self._pending, None
        return pending

    def _checked(self, run: Callable[[], Tensor]) -> Tensor:
        """This rank's half of a step, trusted only once it finished with every worker alive."""
        try:
            logits = run()
            if logits.is_cuda:
                # A collective aborted under the step (a worker died) leaves partial logits behind
                # without an error: wait for the step, then look at the workers before trusting it.
                torch.cuda.current_stream(logits.device).synchronize()
        except Exception as e:
            # The ranks are out of step now (a collective failed, or this rank failed where the
            # others did not): nothing can run on the group any more.
            time.sleep(0.1)  # a peer that dropped the connection is exiting: name it if we can
            cause = self.workers.lost() or "tensor-parallel step failed"
            raise WorkerLost(f"{cause}: {type(e).__name__}: {e}") from e
        lost = self.workers.lost()
        if lost is not None:
            raise WorkerLost(f"{lost} during the step")
        return logits

    def _drain_journal(self) -> list[Any]:
        ops = list(self.journal)
        self.journal.clear()  # the same list object: the stores and the cache append to it
        return ops

    def _message(
        self, rows: list[Row], every: list[bool], graph: tuple[int, int] | None = None
    ) -> StepMessage:
        int8_slots = self.kv_manager.int8_list if self.kv_manager is not None else []
        return StepMessage(rows, every, self._drain_journal(), int8_slots, graph)

    # --- decode graphs on every rank ---------------------------------------------------------

    def capture_graphs(self) -> int:
        """Every rank captures the same decode graphs in lockstep (`tp_graphs`); the scratch slot's
        blocks come from this rank's allocator and reach the workers before they capture. Raises
        GraphCaptureError (every rank then runs eagerly) if any rank failed a bucket."""
        self.check_capturable()
        if self.kv is not None and not self.kv.ensure(self.num_slots, PAD_POSITION + 1):
            raise GraphCaptureError("no KV block for the graphs' scratch slot")
        self.workers.send(tp_graphs.CaptureGraphs(self._drain_journal()))
        agree = tp_graphs.Rank0Agreement(self.workers.send, self._replies)
        held = self.capture_in_lockstep(agree)
        replies = self._replies()
        if not all(isinstance(r, tp_graphs.GraphsHeld) for r in replies):
            raise WorkerLost(f"tensor-parallel workers answered the capture with {replies!r}")
        self._worker_graph_bytes = [r.nbytes for r in replies]
        return held

    def _replies(self) -> list[Any]:
        return self.workers.recv_each(CAPTURE_REPLY_TIMEOUT_S)

    @property
    def graph_bytes_per_rank(self) -> list[int]:
        return [] if self.graphs is None else [self.graphs.held_bytes, *self._worker_graph_bytes]

    def capture_prefill_graphs(self, max_tokens: int) -> int | None:
        """None: under tensor parallel a prompt's step runs eagerly on every rank."""
        return None

    def release_graphs(self) -> None:
        """Every rank drops its graphs (a worker that is gone has nothing left to drop)."""
        had = self.graphs is not None
        super().release_graphs()
        self._worker_graph_bytes = []
        if had:
            with contextlib.suppress(WorkerLost):  # the loss itself is reported by `sound`
                self.workers.send(tp_graphs.ReleaseGraphs())

    def worker_graphs(self) -> list[tp_graphs.GraphsReport]:
        """Each worker's graphs: how many it holds and how many steps it replayed (engine thread,
        between steps)."""
        self.workers.send(tp_graphs.ReportGraphs())
        return [r for r in self._replies() if isinstance(r, tp_graphs.GraphsReport)]

    def close(self) -> None:
        self.workers.close()

    def abandon(self) -> None:
        self.workers.kill()
