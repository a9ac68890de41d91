"""Ranks 1..N-1 of a tensor-parallel engine as rank 0 sees them: the worker processes it spawns
(`tp_worker.worker_main`), the pipes each step goes through, and the watch on their health."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from ballast.engine.config import EngineConfig
from ballast.engine.faults import WorkerLost
from ballast.engine.parallel.split_admission import DieNeed
from ballast.engine.parallel.tp_worker import (
    Stop,
    WorkerFailed,
    WorkerReady,
    worker_main,
)

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1800.0  # a worker that has not loaded its shard by then has failed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TPWorkers:
    """Ranks 1..N-1: their processes and the pipes their steps go through."""

    def __init__(self, config: EngineConfig, quantized_kv: bool, need: DieNeed | None = None) -> None:
        """need: what each worker checks its own die has free before it loads (None: no check)."""
        self.world = config.tensor_parallel_size
        self.address = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        for rank in range(1, self.world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main,
                args=(rank, self.world, self.address, config, quantized_kv, theirs, need),
                name=f"ballast-tp{rank}",
            )
            proc.start()
            theirs.close()
            self._procs.append(proc)
            self._conns.append(ours)
        self.ready: list[WorkerReady] = []
        self._closed = False
        self._watchdog: threading.Thread | None = None
        self._abort_lock = threading.Lock()
        self._aborted = False

    def watch(self, nccl: bool) -> None:
        """Once the group runs: on NCCL a collective waiting for a dead peer would spin out the
        timeout, so a watchdog aborts the group once a worker exits (gloo sees the socket close)."""
        if not nccl or self._watchdog is not None:
            return

        def run() -> None:
            while not self._closed:
                if self.lost() is not None:
                    log.error("%s; aborting the tensor-parallel group", self.lost())
                    self._abort()
                    return
                time.sleep(0.25)

        self._watchdog = threading.Thread(target=run, name="ballast-tp-watchdog", daemon=True)
        self._watchdog.start()

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def lost(self) -> str | None:
        """Why the group is unusable (a worker exited), or None."""
        for proc in self._procs:
            if not proc.is_alive():
                return f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code {proc.exitcode}"
        return None

    def wait_loaded(self, timeout_s: float = LOAD_TIMEOUT_S) -> list[WorkerReady]:
        """Each worker's report once its shard is loaded; raises WorkerLost if one failed."""
        for msg in self._each(timeout_s):
            if isinstance(msg, WorkerFailed):
                raise WorkerLost(f"tensor-parallel rank {msg.rank} failed to load: {msg.error}")
            self.ready.append(msg)
        return self.ready

    def recv_each(self, timeout_s: float = LOAD_TIMEOUT_S) -> list[Any]:
        """One message from every worker, in rank order; WorkerLost if one exits or stays silent."""
        return list(self._each(timeout_s))

    def _each(self, timeout_s: float) -> Iterator[Any]:
        deadline = time.monotonic() + timeout_s
        for conn, proc in zip(self._conns, self._procs, strict=True):
            while not conn.poll(0.2):
                if not proc.is_alive() or time.monotonic() > deadline:
                    raise WorkerLost(self.lost() or f"{proc.name} did not answer in {timeout_s:.0f}s")
            try:
                yield conn.recv()
            except (EOFError, OSError) as e:
                raise WorkerLost(self.lost() or f"{proc.name} is gone: {e}") from e

    def send(self, msg: object) -> None:
        why = self.lost()
        if why is not None:
            raise WorkerLost(why)
        try:
            for conn in self._conns:
                conn.send(msg)
        except OSError as e:  # a pipe whose reader is gone
            raise WorkerLost(f"a tensor-parallel worker is gone: {e}") from e

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (Stop, then terminate any that linger) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        if self.lost() is None:
            with contextlib.suppress(WorkerLost):
                self.send(Stop())
        for proc in self._procs:
            proc.join(timeout_s)
        self.kill(timeout_s)  # any that linger
        for conn in self._conns:
            conn.close()
        if self.lost() is not None and self._watchdog is not None:
            self._abort()  # NCCL: destroying communicators with a dead peer may wait for it
        if dist.is_initialized():
            dist.destroy_process_group()

    def kill(self, grace_s: float = 2.0) -> None:
        """End every worker now, from any thread, without a Stop or a collective (rank 0's engine
        thread may be stuck in one with them), so no rank spins on after this process exits."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(grace_s)

    def _abort(self) -> None:
        with self._abort_lock:
            if self._aborted or not dist.is_initialized():
                return
            self._aborted = True
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                abort()
