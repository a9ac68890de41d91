"""A deterministic engine for scheduler and server tests: the real `EngineLike` contract, no model.

It runs every plan on a real single worker thread (as the engine thread does), keeps real per-slot
sequences and refuses any plan a real engine could not run (a prefill at the wrong position, a
decode of a token that was not sampled, reuse of a slot that was never released, more prefill
tokens than it profiled, a slot above its current limit) so a scheduler bug fails the step instead
of passing silently. Each sampled token is a pure function of (prompt, position) (and the seed when
sampling is not greedy), so a test can know a request's text without running it and compare runs.
Every plan is recorded for tests that assert batching.

With `checkpoint_interval` > 0 it keeps a real prefix cache of token sequences: a save must name
exactly the tokens its slot has consumed (with `recurrent_state=False`, a prefix of them; after
the step's forward; a released slot keeps what it consumed until it is reused), a restore must
name a saved prefix and come with the slot's chunk at that position, and a shed empties the
cache, as the real engine's contract says.

Import it as `from fake_engine import FakeEngine` (tests/ is on sys.path via conftest.py).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ballast.engine.faults import is_memory_fault
from ballast.engine.plan import (
    LAST_SAMPLED,
    KVFigures,
    SamplingParams,
    SlotOutput,
    StepFailed,
    StepPlan,
    StepResult,
)
from ballast.memory.types import CostModel

# A toy vocabulary: id 0 is end-of-sequence, a few ids are several characters long.
VOCAB: tuple[str, ...] = (
    "<eos>",
    *"abcdefghijklmnopqrstuvwxyz",
    " ",
    ".",
    ",",
    "\n",
    "?",
    "!",
    ":",
    *"0123456789",
    "th",
    "ing",
    " the",
)
EOS = 0
_IDS = {piece: i for i, piece in enumerate(VOCAB) if i != EOS}
_UNKNOWN = _IDS["?"]
_LONGEST = max(len(p) for p in VOCAB[1:])
KV_BLOCK = 4  # tokens per block of the modelled KV pool
# Generated tokens come from letters and space only, so text is easy to read and to search.
_GEN = tuple(range(1, 28))


class FakeEngineError(RuntimeError):
    """A plan broke the engine contract: the scheduler under test has a bug."""


class FakeTokenizer:
    eos_token_ids = frozenset({EOS})
    chat_template: str | None = None  # its chat format is `apply_chat_template`'s own

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for size in range(min(_LONGEST, len(text) - i), 0, -1):  # longest match first
                piece = _IDS.get(text[i : i + size])
                if piece is not None:
                    ids.append(piece)
                    i += size
                    break
            else:
                ids.append(_UNKNOWN)
                i += 1
        return ids

    templated = 0  # chat prompts built (a refusal no prompt changes comes before any: refuse_early)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        self.templated += 1
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        return "".join(VOCAB[t] for t in token_ids if t != EOS)

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()

    def grammar_compiler(self, vocab_size: int) -> None:
        return None  # a toy vocabulary: no grammar engine reads it


class FakeDetokenizer:
    """Incremental text with stop strings: text that may be the start of a stop string is held
    back until it is known not to be one; text from a stop string on is never emitted."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._stop = tuple(stop)
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._text += VOCAB[token_id] if token_id != EOS else ""
        hits = [i for i in (self._text.find(s, self._emitted) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._take(min(hits))
        return self._take(len(self._text) - self._held_back())

    def flush(self) -> str:
        return "" if self.stopped else self._take(len(self._text))

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text) - self._emitted), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _take(self, end: int) -> str:
        out = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return out


def token_for(
    seq: Sequence[int], n_prompt: int, params: SamplingParams | None = None, eos_after: int | None = None
) -> int:
    """The token sampled after `seq` (a prompt of n_prompt tokens and what followed it): the fake
    model's whole definition. Like a causal LM, it depends on every token before it, so a sequence
    recomputed from its prompt and output (after a preemption or a failed step) goes on as before."""
    if eos_after is not None and len(seq) - n_prompt >= eos_after:
        return EOS
    seed = (
        b""
        if params is None or params.greedy or params.seed is None
        else params.seed.to_bytes(8, "little", signed=True)
    )
    h = hashlib.blake2b(seed + b"%d:" % len(seq) + b",".join(b"%d" % t for t in seq), digest_size=8)
    return _GEN[int.from_bytes(h.digest(), "little") % len(_GEN)]


def expected_tokens(prompt: Sequence[int], n: int, eos_after: int | None = None) -> list[int]:
    """The first n tokens a greedy request with this prompt generates (stops after an EOS)."""
    seq = list(prompt)
    out: list[int] = []
    for _ in range(n):
        out.append(token_for(seq, len(prompt), None, eos_after))
        seq.append(out[-1])
        if out[-1] == EOS:
            break
    return out


class FakeEngine:
    def __init__(
        self,
        *,
        num_slots: int = 8,
        max_model_len: int = 256,
        prefill_chunk_tokens: int = 64,
        busy_prefill_chunk_tokens: int | None = None,
        step_delay_s: float = 0.0,
        eos_after: int | None = None,
        cost_model: CostModel | None = None,
        model_name: str = "fake-model",
        checkpoint_interval: int = 0,
        recurrent_state: bool = True,
        quantized_kv: bool = False,
        kv_blocks: int = 0,
        gpu_die: int | None = None,
    ) -> None:
        """kv_blocks > 0 models a KV pool of that many blocks of KV_BLOCK tokens (no growth): each
        step reports its figures (blocks held by the slots' sequences), as the real engine does."""
        self.model_name = model_name
        self.quantized_kv = quantized_kv
        self.gpu_die = gpu_die
        self.decodes_ahead = True
        self.kv_blocks = kv_blocks
        self.peak_blocks = 0
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # The most prompt tokens of a step beside decodes (None: the whole chunk, as on a GPU).
        self.busy_prefill_chunk_tokens = busy_prefill_chunk_tokens or prefill_chunk_tokens
        self.cost_model = cost_model or CostModel(
            kv_bytes_per_token=1 << 16,
            state_bytes_per_slot=1 << 20,
            activation_bytes_per_prefill_token=1 << 12,
        )
        self.tokenizer = FakeTokenizer()
        self.vocab_size = len(VOCAB)
        self.sampling_defaults: dict[str, float] = {}  # no generation config: requests' values or plain ones
        self.step_delay_s = step_delay_s
        self.eos_after = eos_after
        self.slot_limit = num_slots  # the ladder's max_slots as last applied between steps
        self.checkpoint_interval = checkpoint_interval
        self.recurrent_state = recurrent_state
        self.checkpoints: set[tuple[int, ...]] = set()
        self.sheds = 0
        self.prefilled_tokens = 0
        self.reused_tokens = 0
        self._consumed: dict[int, list[int]] = {}  # released slot -> what it consumed, until reused
        self.plans: list[StepPlan] = []
        self._lock = threading.Lock()
        self._seqs: dict[int, list[int]] = {}  # slot -> tokens consumed (prompt, then generated)
        self._prompt_len: dict[int, int] = {}  # slot -> prompt length, once its last chunk arrived
        self._pending: dict[int, int] = {}  # slot -> last sampled token, not yet fed back
        self._failure: BaseException | None = None
        self._fail_next: BaseException | None = None
        self._fail_recoverable = False
        self._fail_when: Callable[[StepPlan], bool] | None = None
        self._dropped: set[int] = set()  # slots a recovered step dropped: their release is a no-op
        self.step_failures = 0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fake-engine")
        # Steps the engine thread may still run (None: no limit); a step past it waits for more.
        self._steps_allowed: int | None = None
        self._gate = threading.Condition()

    # --- EngineLike -----------------------------------------------------------------------
    def submit(self, plan: StepPlan) -> Future[StepResult]:
        return self._pool.submit(self._step, plan)

    def kv_figures(self, int8: bool = False) -> KVFigures | None:
        if int8:
            return None
        with self._lock:
            return self._figures()

    def _figures(self) -> KVFigures | None:
        if not self.kv_blocks:
            return None  # no KV pool modelled: admission counts bytes against the snapshot alone
        used = sum(-(-len(seq) // KV_BLOCK) for seq in self._seqs.values())
        self.peak_blocks = max(self.peak_blocks, used)
        if used > self.kv_blocks:
            raise FakeEngineError(f"{used} KV blocks held, the pool has {self.kv_blocks}")
        block_bytes = KV_BLOCK * self.cost_model.kv_bytes_per_token
        return KVFigures(
            KV_BLOCK, block_bytes, self.kv_blocks - used, used, 1, 0, self.kv_blocks * block_bytes
        )

    def match_parked(self, tokens: Sequence[int]) -> int:
        return 0  # the fake never preempts

    def match_prefix(self, prompt_ids: Sequence[int]) -> int:
        with self._lock:
            lengths = [
                len(c)
                for c in self.checkpoints
                if len(c) < len(prompt_ids) and tuple(prompt_ids[: len(c)]) == c
            ]
        return max(lengths, default=0)

    def new_detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> FakeDetokenizer:
        return FakeDetokenizer(stop)

    @property
    def healthy(self) -> bool:
        return self._failure is None

    def abandon(self) -> None:
        return None  # nothing outlives this process

    def shutdown(self) -> None:
        self.allow_steps(None)  # a step waiting at the gate runs, so the thread can end
        self._pool.shutdown(wait=True)

    # --- test controls and figures --------------------------------------------------------
    def allow_steps(self, n: int | None) -> None:
        """Let the engine thread run n more steps, then hold the next one until more are allowed
        (None: run freely again). A test sees a request mid-way without relying on timing."""
        with self._gate:
            self._steps_allowed = n
            self._gate.notify_all()

    def fail_next_step(
        self, exc: BaseException, *, recoverable: bool = False, when: Callable[[StepPlan], bool] | None = None
    ) -> None:
        """The next plan (the next one for which `when(plan)` holds, if given) raises `exc` on the
        engine thread (a failed forward). recoverable: the engine survives it as the real one
        survives an out-of-memory error or a Python exception (it drops the plan's sequences and
        raises StepFailed); otherwise the engine is unsound from then on."""
        with self._lock:
            self._fail_next, self._fail_recoverable, self._fail_when = exc, recoverable, when

    @property
    def active_slots(self) -> int:
        """Slots holding a sequence: 0 when the scheduler has released everything."""
        with self._lock:
            return len(self._seqs)

    def recorded(self) -> list[StepPlan]:
        with self._lock:
            return list(self.plans)

    # --- the engine thread ----------------------------------------------------------------
    def _step(self, plan: StepPlan) -> StepResult:
        with self._gate:
            self._gate.wait_for(lambda: self._steps_allowed is None or self._steps_allowed > 0)
            if self._steps_allowed is not None:
                self._steps_allowed -= 1
        with self._lock:
            self.plans.append(plan)
            if self._failure is not None:
                raise FakeEngineError(f"engine is unsound after {self._failure!r}")
            try:
                if self._fail_next is not None and (self._fail_when is None or self._fail_when(plan)):
                    exc, self._fail_next = self._fail_next, None
                    if self._fail_recoverable and isinstance(exc, Exception):
                        self.step_failures += 1
                        raise StepFailed(exc, self._recover(plan), memory=is_memory_fault(exc)) from exc
                    raise exc
                result = self._execute(plan)
            except StepFailed:
                raise
            except BaseException as exc:
                self._failure = exc
                raise
        if self.step_delay_s:
            time.sleep(self.step_delay_s)  # compute time, outside the lock so figures stay readable
        return result

    def _recover(self, plan: StepPlan) -> frozenset[int]:
        """What the real engine does after a recoverable failure: every slot the plan names loses
        its sequence, and the plan's releases count as done."""
        slots = (
            frozenset(c.slot for c in plan.prefills)
            | {d.slot for d in plan.decodes}
            | {r.slot for r in plan.restores}
        )
        for slot in slots | set(plan.release):
            self._seqs.pop(slot, None)
            self._dropped.add(slot)  # its release may still come (a no-op, as in the engine)
            self._prompt_len.pop(slot, None)
            self._pending.pop(slot, None)
        if plan.max_slots is not None:
            self.slot_limit = plan.max_slots
        return slots

    def _execute(self, plan: StepPlan) -> StepResult:
        for slot in plan.release:
            if slot not in self._seqs and slot in self._dropped:
                self._dropped.discard(slot)  # dropped by a recovered step: a no-op, as in the engine
                continue
            if slot not in self._seqs:
                raise FakeEngineError(f"release of slot {slot}, which holds nothing")
            self._consumed[slot] = self._seqs.pop(slot)
            self._prompt_len.pop(slot, None)
            self._pending.pop(slot, None)
        if plan.max_slots is not None:
            held = [s for s in self._seqs if s >= plan.max_slots]
            if plan.max_slots < 1 or plan.max_slots > self.num_slots or held:
                raise FakeEngineError(
                    f"max_slots={plan.max_slots} with slots {held} held ({self.num_slots} allocated)"
                )
            self.slot_limit = plan.max_slots
        used = [c.slot for c in plan.prefills] + [d.slot for d in plan.decodes]
        if len(used) != len(set(used)):
            raise FakeEngineError(f"a slot appears twice in one plan: {used}")
        prefill_tokens = sum(len(c.token_ids) for c in plan.prefills)
        if prefill_tokens > self.prefill_chunk_tokens:
            raise FakeEngineError(f"{prefill_tokens} prefill tokens > profiled {self.prefill_chunk_tokens}")
        reused = self._restore(plan)
        outputs = [
            out
            for c in plan.prefills
            if (out := self._prefill(c.slot, c.token_ids, c.start_pos, c.sample, plan)) is not None
        ]
        # A plan built ahead (LAST_SAMPLED) may still decode a slot the previous step dropped:
        # skipped, as the real engine skips it.
        decodes = [d for d in plan.decodes if not (d.token_id == LAST_SAMPLED and d.slot in self._dropped)]
        outputs += [self._decode(d.slot, d.token_id, d.pos, plan) for d in decodes]
        for save in plan.saves:
            consumed = self._seqs.get(save.slot, self._consumed.get(save.slot))
            # recurrent state exists only at the end of what the slot consumed; KV of any prefix
            held = tuple(consumed or ())[: None if self.recurrent_state else len(save.prefix)]
            if consumed is None or held != save.prefix:
                raise FakeEngineError(
                    f"save of {len(save.prefix)} tokens from slot {save.slot}, which consumed other tokens"
                )
            self.checkpoints.add(save.prefix)
        self.prefilled_tokens += prefill_tokens
        self.reused_tokens += reused
        return StepResult(
            outputs=tuple(outputs),
            prefill_tokens=prefill_tokens,
            decode_tokens=len(plan.decodes),
            reused_tokens=reused,
            kv=self._figures(),
        )

    def _restore(self, plan: StepPlan) -> int:
        if (plan.saves or plan.restores) and (self.checkpoint_interval == 0 or plan.shed_prefix_cache):
            raise FakeEngineError("checkpoint orders while prefix caching is off or being shed")
        if plan.shed_prefix_cache:
            self.checkpoints.clear()
            self.sheds += 1
        starts = {c.slot: c.start_pos for c in plan.prefills}
        for r in plan.restores:
            if (
                r.prefix not in self.checkpoints
                or starts.get(r.slot) != len(r.prefix)
                or r.slot in self._seqs
            ):
                raise FakeEngineError(
                    f"restore of {len(r.prefix)} tokens into slot {r.slot} breaks the contract"
                )
            self._check_slot(r.slot)
            self._seqs[r.slot] = list(r.prefix)
            self._consumed.pop(r.slot, None)
        return sum(len(r.prefix) for r in plan.restores)

    def _prefill(
        self, slot: int, tokens: tuple[int, ...], start: int, sample: bool, plan: StepPlan
    ) -> SlotOutput | None:
        self._check_slot(slot)
        if start == 0:
            if slot in self._seqs:
                raise FakeEngineError(f"slot {slot} reused without a release")
            self._dropped.discard(slot)
            self._seqs[slot] = []
            self._consumed.pop(slot, None)
        seq = self._seqs.get(slot)
        if seq is None or len(seq) != start or slot in self._prompt_len:
            raise FakeEngineError(
                f"prefill of slot {slot} at {start}, slot holds {None if seq is None else len(seq)}"
            )
        if not tokens:
            raise FakeEngineError(f"empty prefill chunk for slot {slot}")
        seq.extend(tokens)
        if not sample:
            return None
        self._prompt_len[slot] = len(seq)
        return self._sample(slot, plan)

    def _decode(self, slot: int, token: int, pos: int, plan: StepPlan) -> SlotOutput:
        self._check_slot(slot)
        seq = self._seqs.get(slot)
        if token == LAST_SAMPLED:  # the token the slot's previous step sampled
            token = self._pending.get(slot, LAST_SAMPLED)
        if seq is None or slot not in self._pending or self._pending[slot] != token or len(seq) != pos:
            raise FakeEngineError(
                f"decode of slot {slot} token {token} at {pos} does not continue its sequence"
            )
        seq.append(token)
        return self._sample(slot, plan)

    def _sample(self, slot: int, plan: StepPlan) -> SlotOutput:
        seq = self._seqs[slot]
        if len(seq) >= self.max_model_len:
            raise FakeEngineError(f"slot {slot} past max_model_len {self.max_model_len}")
        params = plan.sampling.get(slot)
        if params is None:
            raise FakeEngineError(f"no sampling params for slot {slot}")
        tok = token_for(seq, self._prompt_len[slot], params, self.eos_after)
        self._pending[slot] = tok
        logprob: float | None = None
        top: tuple[tuple[int, float], ...] = ()
        if params.logprobs is not None:
            logprob = -0.1 * (1 + tok % 7)
            candidates = (tok, *(t for t in _GEN if t != tok))[: params.logprobs]
            top = tuple((t, logprob - 0.05 * i) for i, t in enumerate(candidates))
        return SlotOutput(slot, tok, logprob, top, at_capacity=len(seq) + 1 >= self.max_model_len)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slot_limit:
            raise FakeEngineError(f"slot {slot} outside the current limit {self.slot_limit}")
