"""Constrained decoding: a grammar per request, a matcher per slot, one token mask per step.

llguidance is the grammar engine, over xgrammar: its mask fill was 2-11x cheaper at batch 32 on
the default model's 49k vocabulary (bench/grammar_mask), and it pulls no triton into a CPU install.

A `Constraint` is checked once, when the server builds it (an invalid schema is a 400 before any
work). The sampler keeps one matcher per constrained slot (`SlotMatchers`): every row's bitmask is
written into one host buffer that crosses to the device in one copy, so there is no host sync per
sequence; after sampling, each matcher consumes the token its row drew.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import llguidance
import llguidance.hf
import torch
from ballast.models.base import to_device

# Compact JSON: flexible whitespace lets a small model pad an answer with newlines until it runs
# out of tokens, and no client needs the whitespace.
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar the engine cannot enforce; the message says why."""


@dataclass(frozen=True)
class Constraint:
    """Output tokens must follow the grammar. `prompt_tokens`: where the constrained output starts
    (a sequence resumed after preemption is fed prompt and output again; its matcher replays the
    output part)."""

    grammar: str  # llguidance's grammar text (for logs and equality)
    prompt_tokens: int
    prototype: llguidance.LLMatcher = field(compare=False, repr=False)

    def matcher(self) -> llguidance.LLMatcher:
        return self.prototype.deep_copy()


class GrammarCompiler:
    """Builds checked grammars for one tokenizer; the tokenizer view is built once (~0.3 s)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(
            hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )

    def json_schema(self, schema: dict[str, Any]) -> str:
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"invalid JSON schema: {exc}") from exc

    def lark(self, text: str) -> str:
        return str(llguidance.LLMatcher.grammar_from_lark(text))

    def constraint(self, grammar: str, prompt_tokens: int) -> Constraint:
        """A checked constraint; raises GrammarError for a grammar llguidance refuses."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if is_error:
            raise GrammarError(_first_line(messages[0] if messages else "invalid grammar"))
        prototype = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if prototype.is_error():
            raise GrammarError(_first_line(prototype.get_error()))
        return Constraint(grammar, prompt_tokens, prototype)


def json_object_schema() -> dict[str, Any]:
    """`response_format: json_object`: any JSON object."""
    return {"type": "object"}


def lark_json(schema: dict[str, Any]) -> str:
    """A JSON schema as a Lark rule body (llguidance's `%json` extension), with the same compact
    whitespace as `GrammarCompiler.json_schema` (the options travel in the schema's x-guidance)."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, separators=(",", ":"))


def lark_literal(text: str) -> str:
    return json.dumps(text)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"


class SlotMatchers:
    """The matchers of the constrained slots, owned by the sampler (engine thread only)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._matchers: dict[int, llguidance.LLMatcher] = {}
        self._history: dict[int, list[int]] = {}  # tokens fed since the slot's last reset
        self._words = (vocab_size + 31) // 32
        self._powers: dict[torch.device, torch.Tensor] = {}
        self._host: torch.Tensor | None = None  # bitmask rows, reused (pinned when logits are on a GPU)
        # Fills the rows' masks on its own threads, without the GIL, so the event loop runs meanwhile;
        # made on first use (most engines never see a grammar).
        self._executor: llguidance.LLExecutor | None = None

    def reset(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._matchers.pop(slot, None)
            self._history.pop(slot, None)

    def observe(self, slot: int, token_ids: Sequence[int]) -> None:
        """Tokens fed to the slot by a prefill (a prompt, or a resumed sequence's prompt + output)."""
        if slot not in self._matchers:
            self._history.setdefault(slot, []).extend(token_ids)

    def mask(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        slots: Sequence[int],
        constraints: Sequence[Constraint],
    ) -> torch.Tensor:
        """`logits` with every token the grammar forbids set to -inf in the given rows."""
        matchers = [self._matcher(slot, c) for slot, c in zip(slots, constraints, strict=True)]
        bitmask = self._host_rows(len(rows), logits.device)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        self._executor.unsafe_compute_mask_ptr(
            [(m, k) for k, m in enumerate(matchers)], bitmask.data_ptr(), self._words * 4, len(rows)
        )
        # The copy may run ahead of the host: the buffer is next written a step later, after this
        # step's sampled tokens reached the host, by which time the copy has finished.
        bits = bitmask.to(logits.device, non_blocking=True)
        # Bit j of word w allows token 32 w + j: one AND against the 32 powers of two unpacks it.
        allowed = (
            (bits.unsqueeze(-1) & self._powers_on(logits.device))
            .ne(0)
            .view(len(rows), -1)[:, : logits.shape[1]]
        )
        if len(rows) < logits.shape[0]:
            every = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
            every[to_device(list(rows), torch.long, logits.device)] = allowed
            allowed = every
        return torch.where(allowed, logits, float("-inf"))

    def _host_rows(self, rows: int, device: torch.device) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < rows:
            self._host = torch.empty(rows, self._words, dtype=torch.int32, pin_memory=device.type == "cuda")
        return self._host[:rows]

    def _powers_on(self, device: torch.device) -> torch.Tensor:
        powers = self._powers.get(device)
        if powers is None:
            # 1 << 31 wraps to int32's minimum, which is the bit pattern wanted.
            powers = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32).to(device)
            self._powers[device] = powers
        return powers

    def accept(self, slots: Sequence[int], tokens: Sequence[int]) -> None:
        for slot, token in zip(slots, tokens, strict=True):
            matcher = self._matchers[slot]
            if not matcher.is_stopped():
                matcher.consume_token(token)

    def _matcher(self, slot: int, constraint: Constraint) -> llguidance.LLMatcher:
        matcher = self._matchers.get(slot)
        if matcher is None:
            matcher = constraint.matcher()
            # Replay output the slot already holds (a sequence resumed after preemption).
            replay = self._history.pop(slot, [])[constraint.prompt_tokens :]
            if replay:
                matcher.consume_tokens(replay)
            self._matchers[slot] = matcher
        return matcher
