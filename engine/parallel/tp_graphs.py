"""Decode CUDA graphs under tensor parallel. NCCL collectives can sit inside a graph when every
rank captures the same sequence of them, so the ranks capture the same `DecodeGraphs` buckets in
lockstep; the eager warm-up before each runs its collectives for real on every rank. Over each
worker's pipe (rank 0 decides; the scratch slot's block-table changes ride in the first message):

    rank 0 -> workers  CaptureGraphs(ops)            workers apply ops, then capture
    per bucket:  workers -> rank 0  BucketCaptured(error | None)
                 rank 0 -> workers  CaptureVerdict(go)    go: every rank captured it
    if all went:  workers -> rank 0  GraphsHeld(bytes)    leased on each die's ledger

One failed bucket anywhere and every rank releases its graphs and decodes eagerly: one rank
replaying while another runs eagerly would pair a graph's all-reduces with an eager step's and
deadlock. The agreement goes over the pipes, not a collective, so a rank that failed mid-capture
issues nothing the others could mis-pair. A failed warm-up (`WarmupFailed`) fails the load: its
collectives ran, so the ranks may be out of step. A `StepMessage` naming a bucket in `graph`
tells the worker to replay that graph for the same rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from ballast.engine.graphs.decode import GraphCaptureError, as_batch
from ballast.engine.graphs.graph_runner import GraphRunner
from ballast.engine.kv.shard_checkpoints import CheckpointOp
from ballast.models.kv_store import StoreOp

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
    graphs.launch(graphs.stage(as_batch(rows)), len(rows))


def report(runner: GraphRunner) -> GraphsReport:
    graphs = runner.graphs
    return GraphsReport(0, 0) if graphs is None else GraphsReport(graphs.captured, graphs.replays)
