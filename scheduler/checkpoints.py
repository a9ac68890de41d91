"""The scheduler's side of prefix reuse: which checkpoints the next plan saves and restores.

A recurrent state exists only where a prefill chunk ends and cannot be cut back, and each save
copies a whole state, so saves go only where a later request can start:
- a finished request saves prompt + output[:-1] (the last token was sampled, never fed): what the
  next turn of a chat starts with;
- each prompt's end: a regenerated answer starts there, and so does the next turn when the
  client's re-rendered answer does not tokenize back to the same ids;
- multiples of the engine's checkpoint interval inside a cold prompt (a long system prompt or
  document that other conversations share). With recurrent layers a chunk of a cold prompt ends
  at each of them, the only place that state exists; an attention-only model's checkpoint is the
  KV blocks of the prefix, saved after the step that wrote them, so its prompt is not split (the
  split cost an idle server's 1k-token prompt a second step: 15 ms of its TTFT on an H200). A
  prompt that continues a restored checkpoint (a chat's next turn) is this conversation's own,
  whose next turn starts at its end or its answer's: it is neither split nor saved inside.
While the ladder sheds the prefix cache (WATCH and above) nothing is saved or restored, and the
engine is told to shed once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ballast.engine.plan import CheckpointRestore, CheckpointSave


class CheckpointPlanner:
    """Decides which checkpoint orders the next plan carries (the engine's `CheckpointExecutor`
    carries them out)."""

    def __init__(
        self,
        interval: int,
        match_prefix: Callable[[Sequence[int]], int],
        shedding: Callable[[], bool],
        recurrent: bool = True,
    ) -> None:
        """interval: the engine's checkpoint interval (0: its prefix cache is off); match_prefix:
        prompt tokens a restore would cover now; shedding: the ladder's plan sheds the cache now;
        recurrent: the model has recurrent state (chunks end where checkpoints go)."""
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
        """Order a preempted sequence's parked state back into slot: always, shedding or not
        (it is running work, not cache)."""
        self._resumes.append(CheckpointRestore(slot, prefix))

    def end_chunk_at_checkpoint(
        self, slot: int, prompt: tuple[int, ...], start: int, end: int, restored: int = 0
    ) -> int:
        """Where a chunk [start, end) of prompt may end: at the prompt's end, and for a cold prompt
        (`restored`: the tokens its first chunk restored, 0 if none) of a recurrent model at the
        next interval multiple at the latest; a save is ordered there. Without recurrent state a
        cold chunk is not cut: a save is ordered at every interval multiple it passes."""
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
        """A request ended normally in slot, which has consumed exactly these tokens: save them."""
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
