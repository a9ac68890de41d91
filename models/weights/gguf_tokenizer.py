"""A transformers fast tokenizer from a GGUF file's `tokenizer.ggml.*` metadata.

Built here rather than through transformers' GGUF code, whose API moves between versions; the
split rules follow llama.cpp's llama-vocab.cpp, so text tokenizes as llama.cpp would.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

from ballast.models.weights.gguf_reader import GGUFError, GGUFUnsupportedError
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> how text is split before BPE; these follow llama.cpp's llama-vocab.cpp.
# "smollm" & co. split every digit apart, then apply GPT-2's regex (ByteLevel's built-in one).
_GPT2_PRE = ("default", "gpt2", "mpt", "olmo", "jais")
_DIGITS_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")
_SPLIT_PRE = {
    "llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
}  # fmt: skip
# llama.cpp (and Llama 3's tokenizer.json) take a split piece that is a vocabulary entry whole,
# without merging, and add BOS unless the file says otherwise
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return gpt2
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre in _SPLIT_PRE:
        split = pre_tokenizers.Split(Regex(_SPLIT_PRE[pre]), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    known = sorted((*_GPT2_PRE, *_DIGITS_PRE, *_SPLIT_PRE))
    raise GGUFUnsupportedError(f"tokenizer.ggml.pre {pre!r} is not supported (supported: {', '.join(known)})")


def _spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece files list no merges: every split of a piece into two pieces is a merge,
    ranked by the merged piece's score (what SentencePiece's BPE picks first)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = [
        (-scores[ids[t]], ids[t], ids[t[:i]], ids[t[i:]])
        for t in ids
        for i in range(1, len(t))
        if t[:i] in ids and t[i:] in ids
    ]
    found.sort()
    return [(tokens[left], tokens[right]) for _, _, left, right in found]


def _skeleton(md: dict[str, Any], merges: list[str]) -> Tokenizer:
    """The tokenizer's pipeline (normalizer, splitting, model options, decoder) around an empty
    vocabulary; the vocabulary goes in as JSON (see build_tokenizer)."""
    kind = md.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = Tokenizer(models.BPE(vocab={}, merges=[]))
        tok.pre_tokenizer = _byte_level_pre_tokenizer(md.get("tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
        return tok
    if kind == "llama":  # SentencePiece BPE with byte fallback
        tokens: list[str] = md["tokenizer.ggml.tokens"]
        if not merges:
            merges.extend(f"{a} {b}" for a, b in _spm_merges(tokens, md["tokenizer.ggml.scores"]))
        unk_id = md.get("tokenizer.ggml.unknown_token_id")
        unk = tokens[unk_id] if unk_id is not None else None
        tok = Tokenizer(models.BPE(vocab={}, merges=[], unk_token=unk, fuse_unk=True, byte_fallback=True))
        spaces = normalizers.Replace(" ", "\u2581")
        if md.get("tokenizer.ggml.add_space_prefix", True):
            tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), spaces])
            strip: list[decoders.Decoder] = [decoders.Strip(" ", 1, 0)]
        else:
            tok.normalizer, strip = spaces, []
        tok.decoder = decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
        )
        return tok
    raise GGUFUnsupportedError(f"tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)")


def build_tokenizer(md: dict[str, Any]) -> PreTrainedTokenizerFast:
    """A transformers fast tokenizer equal to the one the GGUF describes (vocab, merges, split rules,
    control tokens kept whole, special tokens and their insertion, chat template), built as
    tokenizer.json text that transformers parses once: a Tokenizer object would cost a deep copy
    (serialise + parse) of the 49k-entry vocabulary and merges."""
    if "tokenizer.ggml.tokens" not in md:
        raise GGUFError("GGUF has no tokenizer (tokenizer.ggml.tokens missing)")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type", [])
    merges: list[str] = list(md.get("tokenizer.ggml.merges", []))
    skeleton = _skeleton(md, merges)

    def special(name: str) -> list[tuple[str, int]]:
        token_id = md.get(f"tokenizer.ggml.{name}_token_id")
        return [] if token_id is None else [(tokens[token_id], int(token_id))]

    def content(name: str) -> str | None:
        found = special(name)
        return found[0][0] if found else None

    # llama.cpp adds BOS for SentencePiece and Llama 3 vocabularies that do not say otherwise
    llama3 = md.get("tokenizer.ggml.model") == "gpt2" and md.get("tokenizer.ggml.pre") in _LLAMA3_PRE
    add_bos = bool(
        md.get("tokenizer.ggml.add_bos_token", md.get("tokenizer.ggml.model") == "llama" or llama3)
    )
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    first, last = special("bos") if add_bos else [], special("eos") if add_eos else []
    if first or last:
        template = [t for t, _ in first] + ["$A"] + [t for t, _ in last]
        skeleton.post_processor = processors.TemplateProcessing(
            single=template, pair=[*template, "$B:1"], special_tokens=[*first, *last]
        )
    spec = json.loads(skeleton.to_str())
    spec["model"]["vocab"] = {t: i for i, t in enumerate(tokens)}
    spec["model"]["merges"] = merges  # "a b" strings, the format every tokenizers version reads
    spec["model"]["ignore_merges"] = llama3
    spec["added_tokens"] = [
        {"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": t == _CONTROL}
        for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)
    ]  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
        f.flush()
        return PreTrainedTokenizerFast(
            tokenizer_file=f.name,
            bos_token=content("bos"),
            eos_token=content("eos"),
            unk_token=content("unknown"),
            pad_token=content("padding"),
            add_bos_token=bool(first),
            add_eos_token=bool(last),
            chat_template=md.get("tokenizer.chat_template"),
            model_max_length=int(md.get(f"{md.get('general.architecture')}.context_length", 2**31 - 1)),
        )
