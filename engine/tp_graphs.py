"""Decode CUDA graphs under tensor parallel: every rank captures the same graphs, and a decode step
rank 0 replays is replayed by every worker.

NCCL collectives can sit inside a CUDA graph when every rank captures the same sequence of them:
each rank then replays its graph as its half of the same all-reduces. So the ranks capture in
lockstep, bucket by bucket, in the same order (same `DecodeGraphs` buckets: same slot count and
model length everywhere); the eager warm-up before each capture runs its collectives for real on
every rank, and the capture records them.

The protocol over each worker's pipe (rank 0 decides; its allocator gave the scratch slot's KV
blocks, whose table changes ride in the first message, made before anything is captured):

    rank 0 -> workers  CaptureGraphs(ops)            workers apply ops, then capture
    per bucket:  workers -> rank 0  BucketCaptured(error | None)
                 rank 0 -> workers  CaptureVerdict(go)    go: every rank captured it
    if all went:  workers -> rank 0  GraphsHeld(bytes)    leased on each die's ledger

One failed bucket anywhere and every rank stops at that bucket and releases its graphs: the engine
decodes eagerly on all ranks (never one rank replaying while another runs eagerly, which would
pair a graph's all-reduces with an eager step's and deadlock). The agreement goes over the pipes,
not a collective, so a rank that failed mid-capture issues nothing the others could mis-pair. A
warm-up forward that fails on one rank (`WarmupFailed`) is not agreed on: its collectives ran,
the ranks may be out of step, and the load fails (the same forward would fail eager decode).

A `StepMessage` whose `graph` names a bucket tells the worker to stage the same rows into its
static inputs and replay that graph; rows without it run eagerly, as before.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from ballast.engine.faults import WorkerLost
from ballast.engine.graph_runner import GraphRunner
from ballast.engine.graphs import Agree, GraphCaptureError
from ballast.engine.shard_checkpoints import CheckpointOp
from ballast.models.kv_store import StoreOp
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CaptureGraphs:
    """Capture the decode graphs, after making rank 0's changes since the last step (the scratch
    slot's KV blocks among them) in its order."""

    ops: list[StoreOp | CheckpointOp]


@dataclass(frozen=True)
class BucketCaptured:
    """A worker's capture of one bucket: its error, or None."""

    error: str | None


@dataclass(frozen=True)
class CaptureVerdict:
    """Whether every rank captured the bucket (False: release all graphs and stop)."""

    go: bool


@dataclass(frozen=True)
class GraphsHeld:
    """The bytes a worker's graphs hold on its die, once every bucket is captured."""

    nbytes: int


@dataclass(frozen=True)
class ReleaseGraphs:
    """Drop the decode graphs (rank 0 dropped its own: every step runs eagerly from now)."""


@dataclass(frozen=True)
class ReportGraphs:
    """Ask each worker for a `GraphsReport`."""


@dataclass(frozen=True)
class GraphsReport:
    captured: int  # graphs held
    replays: int  # steps replayed since they were captured


class Rank0Agreement:
    """Rank 0's side of the per-bucket agreement: gather every worker's result, answer with one
    verdict. `recv_each` takes one message from every worker (raising if one is gone)."""

    def __init__(self, send: Callable[[Any], None], recv_each: Callable[[], Sequence[Any]]) -> None:
        self._send = send
        self._recv_each = recv_each
        self.buckets = 0

    def __call__(self, error: str | None) -> bool:
        reports = self._recv_each()
        failed = [
            f"rank {rank}: {r.error if isinstance(r, BucketCaptured) else f'unexpected {r!r}'}"
            for rank, r in enumerate(reports, start=1)
            if not isinstance(r, BucketCaptured) or r.error is not None
        ]
        if error is not None:
            failed.insert(0, f"rank 0: {error}")
        go = not failed
        self._send(CaptureVerdict(go))
        self.buckets += 1
        if not go:
            log.warning(
                "decode graph bucket %d not captured on every rank: %s", self.buckets, "; ".join(failed)
            )
        return go


def worker_agreement(conn: Connection) -> Callable[[str | None], bool]:
    """A worker's side: report this bucket, wait for rank 0's verdict."""

    def agree(error: str | None) -> bool:
        try:
            conn.send(BucketCaptured(error))
            verdict = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            raise SystemExit(0) from None
        if not isinstance(verdict, CaptureVerdict):
            # rank 0 gave the load up mid-capture (it sends Stop): leave; it reaps this process
            raise SystemExit(0)
        return verdict.go

    return agree


class Rank0(Protocol):
    """What rank 0's lockstep uses of its runner (`ShardedRunner`)."""

    def send(self, msg: object) -> None:
        """To every worker."""
        ...

    def replies(self) -> list[Any]:
        """One message from every worker, in rank order."""
        ...

    def drain_journal(self) -> list[Any]:
        """The changes made since the last forward, for the workers to make first."""
        ...

    def send_step(self, graph: tuple[int, int] | None) -> None:
        """The step being run, to every worker: replaying `graph` (None: eagerly)."""
        ...

    def checked(self, run: Callable[[], Tensor]) -> Tensor:
        """This rank's half of a step, trusted only once every worker is seen alive after it."""
        ...


class Rank0Lockstep:
    """Rank 0's side of the lockstep (see the module doc): the capture agreed bucket by bucket,
    every replay sent to the workers first, a release told to them."""

    late_mixed = False  # one rank capturing alone would wait in its warm-up's collectives

    def __init__(self, rank0: Rank0) -> None:
        self._rank0 = rank0
        self.worker_bytes: list[int] = []

    def capture(self, capture: Callable[[Agree | None], int]) -> int:
        """The scratch slot's blocks (in the journal) reach the workers before they capture;
        raises GraphCaptureError (every rank then runs eagerly) if any rank failed a bucket."""
        rank0 = self._rank0
        rank0.send(CaptureGraphs(rank0.drain_journal()))
        held = capture(Rank0Agreement(rank0.send, rank0.replies))
        replies = rank0.replies()
        if not all(isinstance(r, GraphsHeld) for r in replies):
            raise WorkerLost(f"tensor-parallel workers answered the capture with {replies!r}")
        self.worker_bytes = [r.nbytes for r in replies]
        return held

    def replay(self, graph: tuple[int, int], launch: Callable[[], Tensor]) -> Tensor:
        self._rank0.send_step(graph)
        return self._rank0.checked(launch)

    def released(self) -> None:
        """Every worker drops its graphs (a worker that is gone has nothing left to drop)."""
        self.worker_bytes = []
        with contextlib.suppress(WorkerLost):  # the loss itself is reported by `sound`
            self._rank0.send(ReleaseGraphs())


def capture_as_worker(graphs: GraphRunner, conn: Connection) -> None:
    """A worker's capture, once rank 0's ops are applied: in lockstep with rank 0; on success the
    bytes held go back for the ledger, on a failure anywhere every rank runs eagerly."""
    agree = worker_agreement(conn)
    try:
        graphs.check_capturable()
    except GraphCaptureError as e:
        # Rank 0 checked the same config before asking, so this is a bug, not a state: answer its
        # first bucket with it, so every rank stops there and decodes eagerly.
        agree(str(e))
        log.warning("%s; decode runs eagerly", e)
        return
    try:
        held = graphs.capture_in_lockstep(agree)
    except GraphCaptureError as e:
        log.warning("%s; decode runs eagerly", e)
        return
    conn.send(GraphsHeld(held))


def replay_as_rank0(
    runner: GraphRunner, rows: Sequence[tuple[int, tuple[int, ...], int]], graph: tuple[int, int]
) -> None:
    """Replay the bucket rank 0 replays for these rows. A worker without that graph cannot take
    the step eagerly (rank 0's graph all-reduces would meet an eager step's): it fails, and the
    group with it, rather than hang."""
    graphs = runner.graphs
    key = None if graphs is None else graphs.key_of(rows)
    if graphs is None or key is None or key[:2] != graph or not graphs.can_use(rows):
        raise RuntimeError(f"rank 0 replays decode graph {graph}; this rank has {key} and no such graph")
    graphs.replay(rows)


def report(runner: GraphRunner) -> GraphsReport:
    graphs = runner.graphs
    return GraphsReport(0, 0) if graphs is None else GraphsReport(graphs.captured, graphs.replays)
