"""The engine's tokenizer: a transformers tokenizer behind `TokenizerLike`.

End of generation is more than `eos_token_id`: chat models end a turn with a token such as
`<|im_end|>` or `<|eot_id|>` that the base eos may not be. We collect the eos id, the ids a
`generation_config.json` lists, and the special token the chat template itself writes right after
an assistant message, so a chat reply stops where the template says a turn ends.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jinja2
from ballast.engine.detok import Detokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

_TURN_MARKER = "ballastturnmarker"


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
        raise TokenizerInputError(f"the text is not valid Unicode: {e.reason} at position {e.start}") from None
    return text


class Tokenizer:
    """Implements `ballast.engine.interface.TokenizerLike`."""

    def __init__(self, hf: PreTrainedTokenizerBase, extra_eos_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        ids = set(extra_eos_ids) | _end_of_turn_ids(hf)
        if hf.eos_token_id is not None:
            ids.add(int(hf.eos_token_id))
        self.eos_token_ids: frozenset[int] = frozenset(ids)
        self._special_ids = frozenset(int(i) for i in hf.all_special_ids)

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
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        # add_special_tokens adds a BOS where the tokenizer wants one (llama-style); split_special
        # keeps a user's literal "<|im_end|>" as plain text instead of a control token.
        ids = self.hf(_unicode(text), add_special_tokens=True, split_special_tokens=True)["input_ids"]
        return [int(i) for i in ids]

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> list[int]:
        if not self.has_chat_template:
            raise TokenizerError("this model's tokenizer has no chat template; use a raw completion")
        text = self.render_chat(messages)
        # The template writes BOS and the turn markers itself: parse them, add nothing.
        ids = self.hf(_unicode(text), add_special_tokens=False)["input_ids"]
        return [int(i) for i in ids]

    def render_chat(self, messages: Sequence[dict[str, str]]) -> str:
        text = self.hf.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise TokenizerError(f"chat template rendered {type(text).__name__}, expected text")
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self.hf.decode(list(token_ids), skip_special_tokens=True))

    def new_detokenizer(self, prompt_ids: Sequence[int], stop: Sequence[str] = ()) -> Detokenizer:
        return Detokenizer(self, prompt_ids, stop)


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
