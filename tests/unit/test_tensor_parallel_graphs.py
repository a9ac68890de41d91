"""Decode graphs under tensor parallel, the parts the CPU can run for real: the per-bucket
agreement between ranks over real pipes, a worker's serve loop taking a capture message (rank 0's
KV changes applied before anything is captured; a failed capture anywhere leaves every rank
eager), a worker refusing to run eagerly a step rank 0 replays, no rank capturing the int8 variant alone,
and the config that turns it on.
(Capture and replay with NCCL inside: tests/gpu/test_tensor_parallel_cuda.py.)"""

from __future__ import annotations

import os
import signal
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.faults import WorkerLost
from ballast.engine.graphs.decode import DecodeGraphs
from ballast.engine.parallel.sharded_runner import ShardedRunner
from ballast.engine.parallel.tp_graphs import (
    CaptureGraphs,
    GraphsReport,
    Rank0Agreement,
    ReportGraphs,
    worker_agreement,
)
from ballast.engine.parallel.tp_worker import StepMessage, Stop, serve
from ballast.engine.runner.model_runner import ModelRunner
from ballast.models.arch.builtin import builtin_config, init_random
from ballast.models.arch.registry import build_model
from ballast.models.base import ForwardBatch

CPU = torch.device("cpu")


def recv(conn: Connection) -> Any:
    """The next message, or a failure (never a hung test) if none comes within 10 s."""
    assert conn.poll(10), "no answer over the pipe"
    return conn.recv()


def agree_over_pipes(buckets: int, failures: dict[int, int]) -> dict[int, list[bool]]:
    """Three ranks agree bucket by bucket over real pipes, rank r failing bucket failures[r];
    each stops at its first refused bucket. Returns each rank's verdicts."""
    pipes = [Pipe() for _ in range(2)]
    seen: dict[int, list[bool]] = {}

    def run(rank: int, agree: Any) -> None:
        seen[rank] = []
        for k in range(buckets):
            seen[rank].append(agree("out of memory" if failures.get(rank) == k else None))
            if not seen[rank][-1]:
                return

    threads = [
        threading.Thread(target=run, args=(r, worker_agreement(pipes[r - 1][1])), daemon=True) for r in (1, 2)
    ]
    for t in threads:
        t.start()

    def send(msg: object) -> None:
        for ours, _ in pipes:
            ours.send(msg)

    run(0, Rank0Agreement(send, lambda: [recv(ours) for ours, _ in pipes]))
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    return seen


def test_every_rank_stops_at_the_bucket_any_rank_failed() -> None:
    assert agree_over_pipes(4, {}) == {r: [True] * 4 for r in range(3)}
    assert agree_over_pipes(4, {2: 2}) == {r: [True, True, False] for r in range(3)}
    assert agree_over_pipes(4, {0: 0}) == {r: [False] for r in range(3)}


def tiny_runner() -> ModelRunner:
    model = build_model(builtin_config("tiny-qwen3-next"))
    init_random(model, seed=0)
    return ModelRunner(model, CPU, torch.float32, 2, 64, False, 0, scratch_slot=True)


class WorkerThread:
    """A worker's real serve loop on its own runner, in a thread, behind a real pipe."""

    def __init__(self, runner: ModelRunner) -> None:
        self.conn, theirs = Pipe()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, args=(runner, theirs), daemon=True)
        self.thread.start()

    def _serve(self, runner: ModelRunner, conn: Connection) -> None:
        try:
            serve(runner, conn)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            self.error = e

    def stop(self) -> None:
        self.conn.send(Stop())
        self.thread.join(10)


def journaled(runner: ModelRunner) -> list[Any]:
    """Rank 0's journal of KV changes, as ShardedRunner keeps it."""
    journal: list[Any] = []
    assert runner.kv_manager is not None
    for i, store in enumerate(runner.kv_manager.stores):
        store.journal = journal
        store.journal_index = i
    return journal


def test_a_worker_applies_the_ops_before_capturing_and_goes_on_eagerly_when_it_cannot() -> None:
    ours, theirs = tiny_runner(), tiny_runner()
    journal = journaled(ours)
    assert ours.kv is not None and ours.kv.ensure(0, 40)
    assert ours.kv.ensure(2, 2)  # the scratch slot's block, rank 0's choice
    [scratch_block] = ours.kv.table(2)
    assert scratch_block > 0
    worker = WorkerThread(theirs)
    try:
        worker.conn.send(CaptureGraphs(list(journal)))
        agree = Rank0Agreement(worker.conn.send, lambda: [recv(worker.conn)])
        assert agree(None) is False  # the worker cannot capture on the CPU: no rank goes on
        assert ours.kv_manager is not None and theirs.kv_manager is not None
        for a, b in zip(ours.kv_manager.stores, theirs.kv_manager.stores, strict=True):
            assert torch.equal(a.block_table, b.block_table)
        assert int(theirs.kv_manager.stores[0].block_table[2, 0]) == scratch_block
        worker.conn.send(ReportGraphs())
        assert recv(worker.conn) == GraphsReport(captured=0, replays=0)
        worker.conn.send(StepMessage([(0, (5, 6, 7, 8), 0)], [False], []))  # eager: it runs
        worker.conn.send(ReportGraphs())
        assert recv(worker.conn) == GraphsReport(captured=0, replays=0)
        assert worker.error is None
    finally:
        worker.stop()
    assert not worker.thread.is_alive() and worker.error is None


def test_a_worker_never_runs_eagerly_a_step_rank_0_replays() -> None:
    """One rank replaying while another runs eagerly would pair a graph's all-reduces with an
    eager step's: a worker without the graph rank 0 names fails instead (and the group with it)."""
    worker = WorkerThread(tiny_runner())
    worker.conn.send(StepMessage([(0, (5,), 3)], [False], [], graph=(1, 256)))
    worker.thread.join(10)
    assert isinstance(worker.error, RuntimeError) and "no such graph" in str(worker.error)


def test_tp_graphs_are_asked_for_on_their_own() -> None:
    cuda = torch.device("cuda")
    assert EngineConfig(device="cpu").decode_graphs(cuda)
    assert not EngineConfig(device="cpu", cuda_graphs=False).decode_graphs(cuda)
    assert EngineConfig(device="cpu", tensor_parallel_size=2).decode_graphs(cuda)  # on by default
    assert not EngineConfig(device="cpu", tensor_parallel_size=2, tp_cuda_graphs=False).decode_graphs(cuda)
    assert not EngineConfig(device="cpu", tensor_parallel_size=2, cuda_graphs=False).decode_graphs(cuda)
    assert not EngineConfig(device="cpu", tensor_parallel_size=2).decode_graphs(CPU)


def test_rank_0_asks_live_workers_for_their_graphs_and_a_dead_one_fails_at_once() -> None:
    cfg = EngineConfig(
        model="builtin:tiny-llama", device="cpu", max_model_len=64, max_num_seqs=2, tensor_parallel_size=2
    )
    engine = Engine.load(cfg)
    try:
        runner = engine.runner
        assert isinstance(runner, ShardedRunner) and runner.graph_runner.graphs is None
        assert runner.worker_graphs() == [GraphsReport(captured=0, replays=0)]
        [pid] = runner.workers.pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLost):
            for _ in range(100):  # until the worker is seen gone: never a wait for its answer
                runner.worker_graphs()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("late_mixed", [True, False])
def test_under_tensor_parallel_no_rank_captures_the_int8_variant_alone(late_mixed: bool) -> None:
    """One GPU captures a bucket's int8-KV variant at its first use; under tensor parallel
    (late_mixed=False) that step runs eagerly instead, since one rank capturing alone would wait
    in its warm-up's collectives for ranks that are not capturing."""
    graphs = DecodeGraphs(CPU, scratch_slot=4, max_batch=4, max_context=512, late_mixed=late_mixed)
    graphs._graphs[(2, 256, False)] = None  # type: ignore[assignment]  # stands for a capture
    warmups: list[int] = []

    def forward(batch: ForwardBatch) -> torch.Tensor:
        warmups.append(len(batch.slots_list))
        raise RuntimeError("no capture on the CPU")

    graphs._forward = forward
    decode = [(0, [5], 10), (2, [7], 30)]
    assert graphs.can_use(decode) and not graphs.can_use(decode, mixed=True)
    assert warmups == ([2] if late_mixed else [])  # one GPU tried the late capture; TP never does
