"""The engine's tokenizer: a transformers tokenizer behind `TokenizerLike`.

End of generation is more than `eos_token_id`: chat models end a turn with a token such as
`<|im_end|>` that the base eos may not be, so the eos set also takes `generation_config.json`'s
ids and the special token the chat template writes right after an assistant message.

Chat content is text: a user who writes `<|im_end|><|im_start|>system` gets those characters, not
the control tokens, in every field the template renders, so nobody can forge a turn
(`special_tokens_in_content=True` is the operator's way out).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
from ballast.engine.text.detok import Detokenizer
from ballast.engine.text.grammar import GrammarCompiler
from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_TURN_MARKER = "ballastturnmarker"
# Placeholders for message content while the template renders: private-use characters, which no
# template writes and which a tokenizer never merges with the text around them.
_OPEN, _CLOSE = "\ue000", "\ue001"
_PLACEHOLDER = re.compile(f"{_OPEN}(\\d+){_CLOSE}")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenizerError(Exception):
    """The tokenizer could not be loaded or used as asked."""


class TokenizerInputError(ValueError):
    """The text cannot be tokenized (it is not valid Unicode): the client's error, never the server's."""


def _unicode(text: str) -> str:
    """`text` itself if it is valid Unicode. JSON may carry lone UTF-16 surrogates ("\\ud800"),
    which Python keeps in a str but no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerInputError(
            f"the text is not valid Unicode: {e.reason} at position {e.start}"
        ) from None
    return text


class Tokenizer:
    """Implements `ballast.engine.interface.TokenizerLike`."""

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        ids = set(extra_eos_ids) | _end_of_turn_ids(hf)
        if hf.eos_token_id is not None:
            ids.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        added = getattr(hf, "added_tokens_decoder", {})
        texts = {str(t) for t in hf.all_special_tokens} | {t.content for t in added.values() if t.special}
        # Longest first: a spelling that contains another is taken whole.
        self._special_re = (
            re.compile("|".join(re.escape(t) for t in sorted(texts, key=len, reverse=True) if t))
            if any(texts)
            else None
        )
        self._byte_decoder = _byte_level_decoder()

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        try:
            hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise TokenizerError(f"cannot load a tokenizer from {path}: {e}") from e
        return cls(hf, _generation_config_eos(path / "generation_config.json"))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    @property
    def chat_template(self) -> str | None:
        template = getattr(self.hf, "chat_template", None)
        return str(template) if template else None

    def grammar_compiler(self, vocab_size: int) -> GrammarCompiler:
        return GrammarCompiler(self.hf, vocab_size, self.eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._ids(text, special=False, bos=add_special_tokens)

    @property
    def template_knows_tools(self) -> bool:
        """The chat template renders a `tools` list (else a caller must describe tools itself)."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        *,
        special_tokens_in_content: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        if self.chat_template is None:
            raise TokenizerError("this model's tokenizer has no chat template; use a raw completion")
        # Every string the client sent (content, names, tool descriptions and schemas, a call's
        # arguments: the template may render any of them, often through `tojson`) has each
        # special-token spelling swapped for a placeholder; the template's own markers are then
        # parsed, and each placeholder becomes its spelling tokenized as text.
        spelled: list[str] = []
        if not special_tokens_in_content and self._special_re is not None:
            marked_messages = [self._mask(m, spelled) for m in messages]
            marked_tools = [self._mask(t, spelled) for t in tools] if tools else None
        if not spelled:  # the common case: nothing to keep apart
            return self._ids(self.render_chat(messages, tools, template_kwargs), special=True)
        pieces = _PLACEHOLDER.split(self.render_chat(marked_messages, marked_tools, template_kwargs))
        if any(_OPEN in piece or _CLOSE in piece or "\\ue00" in piece for piece in pieces[::2]):
            raise TokenizerError(
                "this chat template rewrites the request's text, so text that spells a special token "
                "cannot be kept as text"
            )
        ids: list[int] = []
        for k, piece in enumerate(pieces):
            ids += (
                self._ids(piece, special=True)
                if k % 2 == 0
                else self._ids(spelled[int(piece)], special=False)
            )
        return ids

    def _mask(self, value: Any, spelled: list[str]) -> Any:
        """`value` with every special-token spelling in its strings replaced by a placeholder
        naming its index in `spelled` (keys are the protocol's field names: kept)."""
        if isinstance(value, str):
            assert self._special_re is not None

            def placeholder(match: re.Match[str]) -> str:
                spelled.append(match.group(0))
                return f"{_OPEN}{len(spelled) - 1}{_CLOSE}"

            return self._special_re.sub(placeholder, value)
        if isinstance(value, dict):
            return {k: self._mask(v, spelled) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._mask(v, spelled) for v in value]
        return value

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """`template_kwargs`: further variables the template reads (`enable_thinking`)."""
        try:
            text = self.hf.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=True,
                tokenize=False,
                **(template_kwargs or {}),
            )
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template cannot render this conversation: {e}") from e
        if not isinstance(text, str):
            raise TokenizerError(f"chat template rendered {type(text).__name__}, expected text")
        return text

    def _ids(self, text: str, *, special: bool, bos: bool = False) -> list[int]:
        if not text and not bos:
            return []
        ids = self.hf(_unicode(text), add_special_tokens=bos, split_special_tokens=not special)["input_ids"]
        return [int(i) for i in ids]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also when it holds only part of a UTF-8 character
        (decoding it alone would give U+FFFD)."""
        text = self.decode([token_id])
        if "\ufffd" not in text:
            return text.encode()
        piece = str(self.hf.convert_ids_to_tokens(int(token_id)))
        byte = _BYTE_TOKEN.fullmatch(piece)
        if byte:  # sentencepiece byte fallback
            return bytes([int(byte.group(1), 16)])
        if piece and all(c in self._byte_decoder for c in piece):  # byte-level BPE
            return bytes(self._byte_decoder[c] for c in piece)
        return text.encode()

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=True))

    def new_detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> Detokenizer:
        return Detokenizer(self, prompt_ids, stop)


def _byte_level_decoder() -> dict[str, int]:
    """Byte-level BPE writes each byte as one printable character: printable Latin-1 bytes as
    themselves, the other 68 bytes as the code points from 256 up, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("\xa1"), ord("\xac") + 1),
        *range(ord("\xae"), 256),
    ]
    mapping = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    mapping.update({chr(256 + k): b for k, b in enumerate(others)})
    return mapping


def _generation_config_eos(path: Path) -> set[int]:
    if not path.is_file():
        return set()
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"unreadable {path}: {e}") from e
    eos = data.get("eos_token_id")
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos}
    if isinstance(eos, list) and all(isinstance(i, int) for i in eos):
        return set(eos)
    raise TokenizerError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")


def _end_of_turn_ids(hf: PreTrainedTokenizerBase) -> set[int]:
    """The special token the chat template writes right after an assistant message, if any."""
    if not getattr(hf, "chat_template", None):
        return set()
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _TURN_MARKER}]
    try:
        text = hf.apply_chat_template(chat, tokenize=False)
    except jinja2.TemplateError as e:
        # Some templates refuse conversations of this shape; eos alone then ends generation.
        log.warning("chat template cannot render an assistant turn (%s); using eos only", e)
        return set()
    if not isinstance(text, str) or _TURN_MARKER not in text:
        return set()
    tail = text[text.rindex(_TURN_MARKER) + len(_TURN_MARKER) :]
    ids = hf(tail, add_special_tokens=False)["input_ids"]
    special = {int(i) for i in hf.all_special_ids}
    return {int(ids[0])} if ids and int(ids[0]) in special else set()
