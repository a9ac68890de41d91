"""The default model (SmolLM2-135M-Instruct, real weights) through our engine: a chat answer, the
real tokenizer's end-of-turn id, and its multi-byte text streamed whole."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.generate import Generation, generate_stream
from ballast.engine.plan import SamplingParams
from ballast.engine.text.detok import REPLACEMENT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.load(
        EngineConfig(
            model="default",
            device="cpu",
            dtype="float32",
            max_num_seqs=1,
            max_model_len=512,
            prefill_chunk_tokens=128,
        )
    )
    yield eng
    eng.shutdown()


def test_capital_of_france_is_paris(engine: Engine) -> None:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    result = Generation()
    text = "".join(
        generate_stream(engine, ids, SamplingParams(temperature=0.0), max_tokens=48, result=result)
    )
    assert "Paris" in text
    assert result.finish_reason == "stop"  # it ended its turn with <|im_end|>, not by length
    assert result.token_ids[-1] in engine.tokenizer.eos_token_ids


def test_dense_weights_answer_paris_too() -> None:
    """--cpu-weights dense (the CPU's fallback where the block kernel cannot build; the fixture's
    engine holds blocks where it can) gives the same answer."""
    eng = Engine.load(
        EngineConfig(
            model="default",
            device="cpu",
            dtype="float32",
            cpu_weights="dense",
            max_num_seqs=1,
            max_model_len=512,
            prefill_chunk_tokens=128,
        )
    )
    try:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        ids = eng.tokenizer.apply_chat_template(question)
        text = "".join(generate_stream(eng, ids, SamplingParams(temperature=0.0), max_tokens=48))
        assert "Paris" in text
    finally:
        eng.shutdown()


def test_end_of_turn_id_comes_from_the_chat_template(engine: Engine) -> None:
    tok = engine.tokenizer
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids


def test_real_tokenizer_multibyte_stream(engine: Engine) -> None:
    tok = engine.tokenizer
    text = "Tea 茶 is 🍵 — naïve café, 你好世界!"
    ids = tok.encode(text)
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)  # some character spans several tokens
    detok = engine.new_detokenizer(
        tok.apply_chat_template([{"role": "user", "content": "hi"}]), stop=("世界",)
    )
    deltas = [detok.add(i) for i in ids]
    assert all(REPLACEMENT not in d for d in deltas)
    assert detok.stopped and "".join(deltas) == "Tea 茶 is 🍵 — naïve café, 你好"
