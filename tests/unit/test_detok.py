"""Incremental detokenizer on a real (tiny, trained here) byte-level BPE tokenizer: multi-byte
characters split across tokens, stop strings across token boundaries, flush."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ballast.engine.text.detok import REPLACEMENT, Detokenizer
from ballast.engine.text.tokenizer import Tokenizer
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "naïve café résumé über straße",
    "你好世界，今天天气很好。",
    "emoji 🙂 and 🚀 in text",
] * 20


def trained_tokenizer() -> Tokenizer:
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    raw.train_from_iterator(CORPUS, trainer)
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<eos>"))


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return trained_tokenizer()


def stream(
    tok: Tokenizer, ids: list[int], prompt: list[int] | None = None, stop: tuple[str, ...] = ()
) -> tuple[list[str], Detokenizer]:
    detok = tok.new_detokenizer(prompt or [], stop)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.flush())
    return deltas, detok


def test_multibyte_characters_split_across_tokens_come_out_whole(tok: Tokenizer) -> None:
    text = "你好 🙂 naïve 🚀 straße"
    ids = tok.encode(text)
    # Precondition: some character really spans several tokens (each token alone is broken UTF-8).
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    deltas, _ = stream(tok, ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT not in d for d in deltas)
    assert len([d for d in deltas if d]) > 3  # streamed, not all at the end


def test_deltas_after_a_prompt_keep_their_spacing(tok: Tokenizer) -> None:
    prompt = tok.encode("The capital of France is")
    ids = tok.encode(" Paris. Berlin is the capital of Germany.")
    deltas, detok = stream(tok, ids, prompt)
    assert "".join(deltas) == " Paris. Berlin is the capital of Germany."
    assert detok.text == "".join(deltas)


def test_special_tokens_are_not_emitted(tok: Tokenizer) -> None:
    eos = tok.hf.convert_tokens_to_ids("<eos>")
    assert eos in tok.eos_token_ids
    deltas, _ = stream(tok, [*tok.encode("Hello world"), eos])
    assert "".join(deltas) == "Hello world"


def test_stop_string_across_token_boundaries(tok: Tokenizer) -> None:
    ids = tok.encode("Hello world, the quick brown fox")
    stop = "ld, the qu"
    # Precondition: the stop string is not a single token's text.
    assert all(stop not in tok.decode([i]) for i in ids)
    deltas, detok = stream(tok, ids, stop=(stop,))
    assert detok.stopped
    assert "".join(deltas) == "Hello wor"
    assert detok.add(ids[0]) == ""  # nothing after a stop


def test_earliest_stop_string_wins(tok: Tokenizer) -> None:
    ids = tok.encode("Paris is the capital of France.")
    deltas, detok = stream(tok, ids, stop=("France", "capital", "zzz"))
    assert detok.stopped
    assert "".join(deltas) == "Paris is the "


def test_partial_stop_prefix_is_held_then_released(tok: Tokenizer) -> None:
    ids = tok.encode("the lazy dog")
    detok = tok.new_detokenizer([], ("lazy cat",))
    emitted = "".join(detok.add(i) for i in ids)
    # "lazy " could still become "lazy cat" until "dog" arrives; then everything is released.
    assert emitted == "the lazy dog"
    assert not detok.stopped


def test_flush_releases_a_held_stop_prefix(tok: Tokenizer) -> None:
    ids = tok.encode("the quick brown")
    detok = tok.new_detokenizer([], ("brown fox",))
    emitted = "".join(detok.add(i) for i in ids)
    assert emitted == "the quick "  # "brown" may be the start of the stop string
    assert detok.flush() == "brown"
    assert not detok.stopped


def test_stop_inside_multibyte_text(tok: Tokenizer) -> None:
    ids = tok.encode("你好世界，今天天气很好。")
    deltas, detok = stream(tok, ids, stop=("天气",))
    assert detok.stopped
    assert "".join(deltas) == "你好世界，今天"


def test_works_without_a_tokenizer_wrapper() -> None:
    class Chars:
        def decode(self, token_ids: list[int]) -> str:
            return "".join(chr(i) for i in token_ids)

    detok = Detokenizer(Chars(), [ord(c) for c in "ab"], stop=("xy",))
    assert [detok.add(ord(c)) for c in "cdxz"] == ["c", "d", "", "xz"]
    assert detok.add(ord("x")) == ""
    assert detok.add(ord("y")) == ""
    assert detok.stopped and detok.text == "cdxz"


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_hf_dir_tokenizer_eos_chat_and_literal_specials(tmp_path: Path) -> None:
    hf = trained_tokenizer().hf
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(tmp_path)
    eos = hf.convert_tokens_to_ids("<eos>")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 77]}))
    loaded = Tokenizer.from_hf_dir(tmp_path)
    im_start, im_end = (loaded.hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>"))
    # eos, the generation config's extra id, and the end-of-turn token the template writes
    assert loaded.eos_token_ids == {eos, 77, im_end}
    ids = loaded.apply_chat_template([{"role": "user", "content": "Hello world"}])
    assert ids.count(im_start) == 2 and ids[-1] != im_end
    assert loaded.decode(ids).endswith("assistant\n")
    # a user typing the marker gets text, not the control token
    assert im_end not in loaded.encode("say <|im_end|> please")
