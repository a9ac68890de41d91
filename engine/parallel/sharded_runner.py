"""Rank 0's runner under tensor parallel: before each forward it sends the step (rows, and the KV
stores' and prefix cache's changes since the last one) to every worker, so all ranks run the same
forward on the same block tables; a decode step it replays from a CUDA graph, every worker
replays from the same bucket (`Rank0Lockstep`, rank 0's side of `tp_graphs`).

A step that fails on this rank, or a collective that fails under it, leaves the ranks out of
step: the forward raises `WorkerLost` (a device fault: the step's requests fail with a 5xx and
/health turns red).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from ballast.engine.faults import WorkerLost
from ballast.engine.graphs.decode import Agree
from ballast.engine.graphs.graph_runner import Lockstep
from ballast.engine.parallel import tp_graphs
from ballast.engine.parallel.tp_worker import StepMessage
from ballast.engine.parallel.workers import TPWorkers
from ballast.engine.runner.model_runner import ModelRunner
from ballast.models.base import StepBatch
from torch import Tensor

# How long rank 0 waits for a worker's answer during the capture: the ranks capture in lockstep
# (their collectives pair), so a live worker answers moments after rank 0 finishes a bucket; the
# bound only matters for one stuck in a collective a failed peer never joined.
CAPTURE_REPLY_TIMEOUT_S = 300.0


class ShardedRunner(ModelRunner):
    """Rank 0's runner: each forward goes to every worker first (see the module doc)."""

    def __init__(self, *args: Any, workers: TPWorkers, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.workers = workers
        # Every change the workers must make before the next forward, in the order made here: the
        # KV stores' and (once the engine hands it to its prefix cache) slot-state copies.
        self.journal: list[Any] = []
        if self.kv_manager is not None:
            self.kv_manager.journal_to(self.journal)
        self.graph_runner.lockstep = Rank0Lockstep(self)

    @property
    def sound(self) -> bool:
        return self.workers.lost() is None

    def _eager(self, batch: StepBatch) -> Tensor:
        self.send_step(batch, None)
        eager = super()._eager
        return self.checked(lambda: eager(batch))

    def send(self, msg: object) -> None:
        self.workers.send(msg)

    def replies(self) -> list[Any]:
        return self.workers.recv_each(CAPTURE_REPLY_TIMEOUT_S)

    def drain_journal(self) -> list[Any]:
        ops = list(self.journal)
        self.journal.clear()  # the same list object: the stores and the cache append to it
        return ops

    def send_step(self, batch: StepBatch, graph: tuple[int, int] | None) -> None:
        int8_slots = self.kv_manager.int8_list if self.kv_manager is not None else []
        rows, every = [(slot, tuple(t), start) for slot, t, start in batch], list(batch.all_logits)
        self.workers.send(StepMessage(rows, every, self.drain_journal(), int8_slots, graph))

    def checked(self, run: Callable[[], Tensor]) -> Tensor:
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

    def worker_graphs(self) -> list[tp_graphs.GraphsReport]:
        """Each worker's graphs: how many it holds and how many steps it replayed (engine thread,
        between steps)."""
        self.workers.send(tp_graphs.ReportGraphs())
        return [r for r in self.replies() if isinstance(r, tp_graphs.GraphsReport)]

    def close(self) -> None:
        self.workers.close()

    def abandon(self) -> None:
        self.workers.kill()


class Rank0Lockstep(Lockstep):
    """Rank 0's side of the lockstep (`tp_graphs`): the capture agreed bucket by bucket, every
    replay sent to the workers first, a release told to them."""

    alone = False

    def __init__(self, rank0: ShardedRunner) -> None:
        self._rank0 = rank0
        self.worker_bytes: list[int] = []

    def capture(self, capture: Callable[[Agree | None], int]) -> int:
        """The scratch slot's blocks (in the journal) reach the workers before they capture;
        raises GraphCaptureError (every rank then runs eagerly) if any rank failed a bucket."""
        rank0 = self._rank0
        rank0.send(tp_graphs.CaptureGraphs(rank0.drain_journal()))
        held = capture(tp_graphs.Rank0Agreement(rank0.send, rank0.replies))
        replies = rank0.replies()
        if not all(isinstance(r, tp_graphs.GraphsHeld) for r in replies):
            raise WorkerLost(f"tensor-parallel workers answered the capture with {replies!r}")
        self.worker_bytes = [r.nbytes for r in replies]
        return held

    def replay(self, batch: StepBatch, graph: tuple[int, int], launch: Callable[[], Tensor]) -> Tensor:
        self._rank0.send_step(batch, graph)
        return self._rank0.checked(launch)

    def released(self) -> None:
        """Every worker drops its graphs (a worker that is gone has nothing left to drop)."""
        self.worker_bytes = []
        with contextlib.suppress(WorkerLost):  # the loss itself is reported by `sound`
            self._rank0.send(tp_graphs.ReleaseGraphs())
