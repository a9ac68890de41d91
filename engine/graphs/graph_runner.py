"""The one owner of a runner's CUDA graphs: decode (`DecodeGraphs`), verify (`VerifyGraphs`) and
prefill (`PrefillGraphs`) graphs, the choice of which serves a step, their capture at start-up under
leases from the memory layer, and the lockstep with the other ranks under tensor parallel
(`Lockstep`).

A step is served by a decode graph (every sequence feeds one token), else a verify graph (every
sequence a decode and its drafts, where the engine drafts), else a prefill graph (one prompt
chunk alone), else both (a chunk then decodes, where `PrefillGraphs.split_pays`), else eagerly.
Graphs are a speed-up, never a reason to fail: a capture that fails on any rank, or a ledger
without room for them, leaves that kind of step eager (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from ballast.engine.graphs.decode import (
    PAD_POSITION,
    Agree,
    DecodeGraphs,
    Forward,
    GraphCaptureError,
    Leftover,
)
from ballast.engine.graphs.prefill import GRANULE, PrefillGraphs
from ballast.engine.graphs.verify import VerifyGraphs
from ballast.engine.kv.kv_budget import segment_grant
from ballast.engine.workspace import VerifySize
from ballast.memory.errors import LedgerFull
from ballast.memory.ledger import Lease
from ballast.memory.types import MiB
from ballast.memory.watch import MemWatch
from ballast.models.base import StepBatch
from torch import Tensor

log = logging.getLogger(__name__)


class Lockstep:
    """What one rank's graphs agree on with the other ranks of a tensor-parallel group: here, on
    one GPU, nothing (rank 0's is `sharded_runner.Rank0Lockstep`)."""

    alone = True
    worker_bytes: list[int] = []  # what the other ranks' graphs hold, rank by rank

    def capture(self, capture: Callable[[Agree | None], int]) -> int:
        """Run this rank's capture, given how to agree after each bucket; its bytes held."""
        return capture(None)

    def replay(self, batch: StepBatch, graph: tuple[int, int], launch: Callable[[], Tensor]) -> Tensor:
        """Launch this rank's replay of the batch's (batch, context) graph, the other ranks theirs."""
        return launch()

    def released(self) -> None:
        """This rank dropped its decode graphs: so do the others."""


class GraphRunner:
    """A runner's graphs: which serves a step, and their capture and release."""

    def __init__(
        self,
        device: torch.device,
        num_slots: int,
        max_model_len: int,
        scratch_slot: bool,
        run: Forward,
        scratch_block: Callable[[int], bool] = lambda n: True,
        prefill_safe: bool = False,
        kv_per_weight: float = 0.0,
        verify: tuple[VerifySize, bool] = (VerifySize(), False),
        leftover: Leftover | None = None,
    ) -> None:
        """scratch_slot: the states hold a slot past num_slots for padding rows; scratch_block(n)
        gives it KV blocks for its first n positions (False: none to be had). run: the forward the
        graphs capture. prefill_safe: the model's rows meet only in attention. kv_per_weight: one
        token's KV bytes over the weights' bytes (what a split step's decode replay reads besides
        the weights). verify: the verify steps the engine drafts in (none: no verify graphs), and
        whether the model's recurrent layers keep their per-position states. leftover: what else
        the forward leaves on the model (hidden states a drafter reads), handed back by replays."""
        self.device = device
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self._scratch = scratch_slot
        self._run = run
        self._scratch_block = scratch_block
        self._prefill_safe = prefill_safe
        self._kv_per_weight = kv_per_weight
        self._verify = verify
        self._leftover = leftover
        self.lockstep = Lockstep()
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.split_replays = 0  # steps of a prompt chunk and decodes run as the two graphs' replays

    # --- which serves a step ---------------------------------------------------------------

    def forward(self, batch: StepBatch, mixed: bool, eager: Callable[[StepBatch], Tensor]) -> Tensor:
        """The step's logits from the graphs that serve it, else from `eager`. `mixed`: the int8
        KV store is in use (another kernel sequence: its own decode variant, no prefill graph)."""
        if self.graphs is not None and self.graphs.can_use(batch, mixed):
            return self._replay(batch, mixed)
        if self.verify_graphs is not None and self.verify_graphs.can_use(batch, mixed):
            return self.verify_graphs.replay(batch)
        if self.prefill_graphs is not None and self.prefill_graphs.can_use(batch, mixed=mixed):
            return self.prefill_graphs.replay(batch)
        split = self._split(batch, mixed)
        if split is not None:
            assert self.prefill_graphs is not None
            first = self.prefill_graphs.replay(split[0])
            rest = self._replay(split[1], mixed)
            self.split_replays += 1
            return torch.cat((first, rest))
        return eager(batch)

    def _split(self, batch: StepBatch, mixed: bool) -> tuple[StepBatch, StepBatch] | None:
        """The step as a prompt chunk and decode tokens where both graphs serve them and their
        replays pay (`PrefillGraphs.split_pays`; the decode replay reads the weights and its
        sequences' KV), or None (also where replays hand back what the forward leaves on the
        model: each would hand back its half alone)."""
        prefill, decode = self.prefill_graphs, self.graphs
        n = batch.num_seqs
        if prefill is None or decode is None or n < 2 or mixed or any(batch.all_logits) or self._leftover:
            return None
        head, rest = batch.part(0, 1), batch.part(1, n)
        if not prefill.can_use(head) or not decode.can_use(rest):
            return None
        kv_read = sum(start + 1 for start in rest.starts_list)
        pays = prefill.split_pays(head.lens_list[0], 1.0 + kv_read * self._kv_per_weight)
        return (head, rest) if pays else None

    def _replay(self, batch: StepBatch, mixed: bool) -> Tensor:
        graphs = self.graphs
        assert graphs is not None
        key = graphs.stage(batch, mixed)
        return self.lockstep.replay(batch, (key[0], key[1]), lambda: graphs.launch(key, batch.num_seqs))

    # --- capture and release ---------------------------------------------------------------

    def check_capturable(self) -> None:
        if self.device.type != "cuda" or not self._scratch:
            raise GraphCaptureError("decode graphs need CUDA and a scratch slot")

    def capture_graphs(self) -> int:
        """Capture decode graphs for batches up to num_slots and every context bucket (attention
        reads blocks in place, so a graph's memory does not grow with its context), on every
        rank. Returns the bytes they hold here; raises GraphCaptureError if the model cannot be
        captured."""
        self.check_capturable()
        if not self._scratch_block(PAD_POSITION + 1):
            raise GraphCaptureError("no KV block for the graphs' scratch slot")
        return self.lockstep.capture(self.capture_in_lockstep)

    def capture_in_lockstep(self, agree: Agree | None) -> int:
        """Capture the decode graphs over the scratch slot's blocks (under tensor parallel rank 0
        gave them), agreeing with the other ranks after each bucket; the bytes held here."""
        graphs = DecodeGraphs(  # the int8-KV variant captured late on one GPU only
            self.device, self.num_slots, self.num_slots, self.max_model_len, agree is None, self._leftover
        )
        held = graphs.capture(self._run, agree)
        self.graphs = graphs
        return held

    def capture_prefill_graphs(self, max_tokens: int) -> int | None:
        """After the decode graphs (whose scratch block takes the padding rows): prefill graphs of
        one prompt of up to max_tokens; their bytes held. None (prefill stays eager) where rows
        meet outside attention (recurrent state, expert routing), under tensor parallel, or below
        the smallest graph; raises GraphCaptureError if the capture fails (nothing kept)."""
        if self.graphs is None or not self._prefill_safe or not self.lockstep.alone or max_tokens < GRANULE:
            return None
        graphs = PrefillGraphs(self.device, self.num_slots, max_tokens, leftover=self._leftover)
        held = graphs.capture(self._run)
        self.prefill_graphs = graphs
        return held

    def capture_verify_graphs(self) -> int | None:
        """After the decode graphs (whose scratch slot takes the padding rows): verify graphs of
        the engine's verify steps; their bytes held. None (verify rows stay eager) without drafting,
        under tensor parallel, or without scratch blocks for a padding row; raises
        GraphCaptureError if the capture fails (nothing kept)."""
        size, keep = self._verify
        if self.graphs is None or not size.rows or not size.drafts or not self.lockstep.alone:
            return None
        if not self._scratch_block(PAD_POSITION + size.drafts + 1):
            return None
        graphs = VerifyGraphs(
            self.device, self.num_slots, size.rows, size.drafts, self.max_model_len, keep, self._leftover
        )
        held = graphs.capture(self._run)
        self.verify_graphs = graphs
        return held

    def release_verify_graphs(self) -> None:
        if self.verify_graphs is not None:
            self.verify_graphs.release()
            self.verify_graphs = None

    @property
    def graph_bytes_per_rank(self) -> list[int]:
        """What the decode graphs hold on each rank's device (none without graphs)."""
        return [] if self.graphs is None else [self.graphs.held_bytes, *self.lockstep.worker_bytes]

    def release_prefill_graphs(self) -> None:
        if self.prefill_graphs is not None:
            self.prefill_graphs.release()
            self.prefill_graphs = None

    def release_graphs(self) -> None:
        """Every rank drops its graphs; every step runs eagerly from now."""
        self.release_prefill_graphs()
        self.release_verify_graphs()
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
            self.lockstep.released()

    def capture_at_start(self, watch: MemWatch | None, dies: list[int], prefill_tokens: int) -> list[Lease]:
        """The decode graphs, then the verify and the prefill graphs, each under its leases."""
        leases = capture_graphs(self, watch, dies) + capture_verify_graphs(self, watch, dies)
        return leases + capture_prefill_graphs(self, watch, dies, prefill_tokens)


def capture_graphs(graphs: GraphRunner, watch: MemWatch | None, dies: Sequence[int]) -> list[Lease]:
    """Decode graphs under one lease per die (rank r's on dies[r]), or none where the model cannot
    be captured on a rank or a die's ledger has no room: decode then runs eagerly (logged)."""
    try:
        held = graphs.capture_graphs()
    except GraphCaptureError as e:
        log.warning("%s; decode runs eagerly", e)
        return []
    leases: list[Lease] = []
    if watch is not None:
        try:
            for die, nbytes in zip(dies, graphs.graph_bytes_per_rank, strict=True):
                leases.append(watch.ledger.lease(die, nbytes, "cuda-graphs"))
        except LedgerFull as e:
            for lease in leases:
                lease.release()
            graphs.release_graphs()
            log.warning("no VRAM for decode graphs (%s); decode runs eagerly", e)
            return []
    g = graphs.graphs
    assert g is not None
    if watch is not None and g.late_mixed:  # the int8-KV variant, captured while serving
        g.acquire = segment_grant(watch, dies[0], "cuda-graphs-int8")
    log.info(
        "decode graphs: %d captured of %d buckets (batch <= %d, context <= %d), %.1f MiB on rank 0 of %d",
        g.captured,
        len(g.batch_buckets) * len(g.context_buckets),
        max(b for b, _ in g.pairs),
        max(c for _, c in g.pairs),
        held / MiB,
        len(graphs.graph_bytes_per_rank),
    )
    return leases


def capture_prefill_graphs(
    graphs: GraphRunner, watch: MemWatch | None, dies: Sequence[int], max_tokens: int
) -> list[Lease]:
    """Prefill graphs under their lease (tag cuda-graphs-prefill), or none where a capture fails or
    the ledger has no room: prefill stays eager (logged), the decode graphs as they are."""
    if max_tokens <= 0 or graphs.graphs is None:
        return []
    try:
        held = graphs.capture_prefill_graphs(max_tokens)
    except GraphCaptureError as e:
        log.warning("%s; prefill runs eagerly", e)
        return []
    if held is None:
        return []  # the model's rows meet outside attention: eager prefill
    leases = lease_or_drop(watch, dies, held, "prefill", graphs.release_prefill_graphs)
    p = graphs.prefill_graphs
    if p is None:
        return []
    log.info(
        "prefill graphs: %d captured (one prompt of up to %d tokens, in steps of %d), %.1f MiB; "
        "replays %.2f-%.2f ms of GPU time against %.2f ms to launch an eager step (what decides "
        "whether a prompt beside decodes replays both graphs)",
        p.captured,
        p.buckets[-1],
        p.buckets[0],
        held / MiB,
        1e3 * min(p.replay_s.values(), default=0.0),
        1e3 * max(p.replay_s.values(), default=0.0),
        1e3 * p.eager_host_s,
    )
    return leases


def capture_verify_graphs(graphs: GraphRunner, watch: MemWatch | None, dies: Sequence[int]) -> list[Lease]:
    """Verify graphs under their lease (tag cuda-graphs-verify), or none where the engine does not
    draft, a capture fails or the ledger has no room: verify rows stay eager (logged)."""
    try:
        held = graphs.capture_verify_graphs()
    except GraphCaptureError as e:
        log.warning("%s; verify rows run eagerly", e)
        return []
    if held is None:
        return []
    leases = lease_or_drop(watch, dies, held, "verify", graphs.release_verify_graphs)
    v = graphs.verify_graphs
    if v is None:
        return []
    log.info(
        "verify graphs: %d captured (one row of 2-%d tokens, up to %d rows of %d; every context), %.1f MiB",
        v.captured,
        v.length,
        v.buckets[-1],
        v.length,
        held / MiB,
    )
    return leases


def lease_or_drop(
    watch: MemWatch | None, dies: Sequence[int], held: int, kind: str, drop: Callable[[], None]
) -> list[Lease]:
    """The lease of a graph set's `held` bytes on rank 0's die (tag cuda-graphs-{kind}; none
    without a watch), or none and the set dropped (`drop`) where the ledger has no room for it."""
    if watch is None:
        return []
    try:
        return [watch.ledger.lease(dies[0], held, f"cuda-graphs-{kind}")]
    except LedgerFull as e:
        drop()
        log.warning("no VRAM for %s graphs (%s); those steps run eagerly", kind, e)
        return []
