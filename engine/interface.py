"""What the scheduler and server may use of an engine. The real `Engine` and the tests' fake engine
both satisfy these protocols, so the scheduler never depends on tensors or on a model."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol

from ballast.engine.plan import KVFigures, StepPlan, StepResult
from ballast.memory.types import CostModel

if TYPE_CHECKING:  # llguidance and torch: loaded only where grammars are compiled
    from ballast.engine.text.grammar import GrammarCompiler


class TokenizerLike(Protocol):
    eos_token_ids: frozenset[int]

    @property
    def chat_template(self) -> str | None:
        """The model's chat template (Jinja source), where it has one: the server reads the tool
        call format from it."""
        ...

    def grammar_compiler(self, vocab_size: int) -> GrammarCompiler | None:
        """A compiler of grammars for logits `vocab_size` wide (0.3 s to build: the server keeps
        one), or None where it cannot constrain sampling."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of raw text (special tokens the text spells out are not parsed); with
        add_special_tokens, a BOS where the tokenizer wants one."""
        ...

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of a chat, with the generation prompt for the assistant's turn appended."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token, also when it holds part of a UTF-8 character."""
        ...


class DetokenizerLike(Protocol):
    """Turns a stream of token ids into text deltas: never emits a broken UTF-8 sequence, and
    holds back text that may be the start of a stop string."""

    stopped: bool  # a stop string was found; text after it is never emitted

    def add(self, token_id: int) -> str:
        """Feed one generated token; return the new text that is safe to emit (maybe "")."""
        ...

    def flush(self) -> str:
        """The request finished (not by a stop string): return whatever text was held back."""
        ...


class EngineLike(Protocol):
    model_name: str
    num_slots: int  # slots allocated at load: the hard ceiling
    max_model_len: int  # prompt + generated tokens per slot
    prefill_chunk_tokens: int  # the largest prefill the engine profiled (tokens per step)
    busy_prefill_chunk_tokens: int  # the most prompt tokens of a step beside decodes
    # Prefill chunks end at multiples of this, where the scheduler orders checkpoint saves (a
    # recurrent state exists only at the position a chunk ended); 0 = prefix caching is off.
    checkpoint_interval: int
    # Whether the model has recurrent layers. Without them a checkpoint is only the KV blocks of a
    # prefix, which any step that wrote them can save: a cold prompt is not split at the interval.
    recurrent_state: bool
    cost_model: CostModel
    quantized_kv: bool  # the main KV pool holds int8 (--kv-quant int8)
    # It runs a decode plan submitted before the last step's tokens are back (a decode fed from the
    # device): not under tensor parallel, where the other ranks would need the sampled tokens first.
    decodes_ahead: bool

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def vocab_size(self) -> int:
        """The width of the logits sampled from (may exceed the tokenizer's vocabulary)."""
        ...

    @property
    def gpu_die(self) -> int | None:
        """The GPU whose ledger admission checks (None: the engine runs on the host)."""
        ...

    @property
    def sampling_defaults(self) -> dict[str, float]:
        """What the model's makers sample with (generation_config.json, a GGUF's defaults), for
        the values a request omits; empty where they state nothing. The server reads it once at
        load, so a malformed file fails the load rather than a request."""
        ...

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        """Queue a plan on the engine thread; plans run in submission order. The future raises
        `StepFailed` if the engine recovered from the step's failure; any other exception means
        the engine is unsound (see `healthy`)."""
        ...

    def match_prefix(self, prompt_ids: Sequence[int]) -> int:
        """How many leading tokens of this prompt a `CheckpointRestore` could cover in the next
        plan (fewer than the prompt's length; 0 = none). Called on the event loop: checkpoints
        change only inside steps, so the answer holds for the next plan."""
        ...

    def match_parked(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` a sequence the engine parked when it preempted it
        holds (0: none, it will be recomputed). A `CheckpointRestore` of them resumes it."""
        ...

    def new_detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> DetokenizerLike: ...

    def kv_figures(self, int8: bool = False) -> KVFigures | None:
        """A KV block pool's figures before any step (later ones come with each StepResult): the
        main pool, or the int8 pool new sequences use under pressure; None where there is none."""
        ...

    @property
    def healthy(self) -> bool: ...

    def shutdown(self) -> None: ...

    def abandon(self) -> None:
        """A step never returned: end what would outlive the process (tensor-parallel workers)
        without waiting for the engine thread, which `shutdown` would wait for forever."""
        ...
