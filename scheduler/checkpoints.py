"""The scheduler's side of prefix reuse: which checkpoints the next plan saves and restores.

A recurrent state exists only where a prefill chunk ends, and each save copies a whole state, so
saves go only where a later request can start: a finished turn (prompt + output[:-1], the last
token never fed), each prompt's end (a regenerated answer, or a next turn whose re-rendered answer
tokenizes differently), and interval multiples inside a cold prompt (a shared system prompt). With
recurrent layers a cold prompt's chunk ends at each multiple, the only place that state exists; an
attention-only model saves the prefix's KV blocks after the step, so its prompt is not split (the
split cost a 1k-token prompt 15 ms of TTFT on an H200). A prompt continuing a restored checkpoint
is one conversation's own: neither split nor saved inside. While the ladder sheds the prefix cache
nothing is saved or restored, and the engine is told to shed once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ballast.engine.interface import TokenizerLike
from ballast.engine.plan import CheckpointRestore, CheckpointSave, StepPlan
from ballast.scheduler.sequence import Seq


class CheckpointPlanner:
    """The checkpoint orders the next plan carries (the engine's `CheckpointExecutor` runs them)."""

    def __init__(
        self,
        interval: int,
        match_prefix: Callable[[Sequence[int]], int],
        shedding: Callable[[], bool],
        recurrent: bool = True,
    ) -> None:
        """interval: 0 when the prefix cache is off; match_prefix: what a restore would cover now."""
        self.interval = interval
        self.recurrent = recurrent
        self._match = match_prefix
        self._shedding = shedding
        self._saves: list[CheckpointSave] = []  # for the next plan
        self._restores: list[CheckpointRestore] = []
        self._resumes: list[CheckpointRestore] = []
        self._shed_sent = False  # the engine has been told to shed since the ladder asked

    @property
    def active(self) -> bool:
        return self.interval > 0 and not self._shedding()

    def queue_restore(self, slot: int, prompt: tuple[int, ...]) -> int:
        """Order a restore of the longest cached prefix of prompt into slot; its length (0: none)."""
        n = self._match(prompt) if self.active else 0
        if n > 0:
            self._restores.append(CheckpointRestore(slot, prompt[:n]))
        return n

    def queue_resume(self, slot: int, prefix: tuple[int, ...]) -> None:
        """Order a preempted sequence's parked state back: even while shedding (it is running work)."""
        self._resumes.append(CheckpointRestore(slot, prefix))

    def end_chunk_at_checkpoint(
        self, slot: int, prompt: tuple[int, ...], start: int, end: int, restored: int = 0
    ) -> int:
        """Where a chunk [start, end) may end, with a save ordered there: the prompt's end, and for a
        cold prompt (`restored` 0) of a recurrent model the next interval multiple at the latest.
        Without recurrent state a cold chunk is not cut: it saves at every multiple it passes."""
        if not self.active:
            return end
        if not restored:
            first = (start // self.interval + 1) * self.interval
            if self.recurrent:
                end = min(end, first)
            else:
                for n in range(first, end, self.interval):
                    self._saves.append(CheckpointSave(slot, prompt[:n]))
        if end == len(prompt) or (not restored and end % self.interval == 0):
            self._saves.append(CheckpointSave(slot, prompt[:end]))
        return end

    def queue_final_save(self, slot: int, consumed: tuple[int, ...]) -> None:
        """A request ended normally in slot, which has consumed exactly `consumed`."""
        if self.active:
            self._saves.append(CheckpointSave(slot, consumed))

    def take_orders(self) -> tuple[bool, tuple[CheckpointSave, ...], tuple[CheckpointRestore, ...]]:
        """(shed the cache now, saves, restores) for the next plan; a plan that sheds carries no
        checkpoint order, only the resumes of parked sequences."""
        shedding = self._shedding()
        shed = self.interval > 0 and shedding and not self._shed_sent
        self._shed_sent = shedding
        saves, restores = ((), ()) if shed else (tuple(self._saves), tuple(self._restores))
        restores += tuple(self._resumes)
        self._saves, self._restores, self._resumes = [], [], []
        return shed, saves, restores


class TurnSaves:
    """The checkpoint a finished turn leaves, where the next turn starts: prompt + answer less the
    last token (sampled, never fed), before the slot's release; when the plan submitted ahead feeds
    that token, the save waits for that plan to have run and covers the whole answer."""

    def __init__(self, checkpoints: CheckpointPlanner, tokenizer: TokenizerLike) -> None:
        self._checkpoints = checkpoints
        self._tokenizer = tokenizer
        # Slots the plan submitted ahead feeds from the device, and the saves that wait for it.
        self.fed_ahead: frozenset[int] = frozenset()
        self.after_ahead: dict[int, tuple[int, ...]] = {}

    def completed(self, seq: Seq) -> None:
        """`seq` completed while decoding and still holds its slot (int8 sequences save nothing:
        the prefix cache holds main-pool blocks)."""
        if seq.slot is None or seq.int8_kv or not self._checkpoints.active:
            return
        ahead = seq.slot in self.fed_ahead
        answer = tuple(seq.output) if ahead else tuple(seq.output[:-1])
        if seq.req.resent_as_text and not self._comes_back(seq.output, answer):
            return
        if ahead:  # the plan in flight feeds it output[-1]: saved once that plan has run
            self.after_ahead[seq.slot] = seq.req.prompt_ids + answer
        else:  # saved before the release: the slot has consumed prompt + output[:-1]
            self._checkpoints.queue_final_save(seq.slot, seq.req.prompt_ids + answer)

    def ran(self, plan: StepPlan, preempted: Sequence[int]) -> None:
        """`plan` has run: it fed the last token of the turns that wait for it."""
        for d in plan.decodes:
            consumed = self.after_ahead.pop(d.slot, None)
            if consumed is not None and d.slot not in preempted:
                self._checkpoints.queue_final_save(d.slot, consumed)

    def failed(self, plan: StepPlan) -> None:
        """`plan` failed: the step that would have fed their last token did not run."""
        for d in plan.decodes:
            self.after_ahead.pop(d.slot, None)

    def _comes_back(self, output: Sequence[int], saved: tuple[int, ...]) -> bool:
        """Whether a next turn resending this answer as text starts with its `saved` tokens (EOS
        aside, which the chat template writes back). Without this check, on an H200 with answers
        that seldom tokenize back, every turn saved a 150 MB checkpoint no turn could use and the
        LRU evicted the prompt-end ones next turns do use (4 restores of 258 saves)."""
        tok = self._tokenizer
        eos = tok.eos_token_ids
        answer = [t for t in output if t not in eos]
        part = list(saved)
        while part and part[-1] in eos:
            part.pop()
        return tok.encode(tok.decode(answer), add_special_tokens=False)[: len(part)] == part
