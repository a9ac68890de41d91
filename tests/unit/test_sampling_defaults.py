"""Defaults for omitted sampling values: generation_config.json, GGUF's documented ones, none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ballast.engine.text.sampling_defaults import GGUF_DEFAULTS, GenerationConfigError, sampling_defaults


def test_generation_config_values_become_defaults(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
                "do_sample": True,
                "eos_token_id": [1, 2],
                "max_new_tokens": 9,
            }
        )
    )
    assert sampling_defaults("hf", tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20.0}


def test_no_file_no_defaults_and_gguf_gets_the_documented_ones(tmp_path: Path) -> None:
    assert sampling_defaults("hf", tmp_path) == {}
    assert sampling_defaults("builtin", None) == {}
    assert sampling_defaults("gguf", tmp_path / "m.gguf") == GGUF_DEFAULTS


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_k": "40"}, {"min_p": True}])
def test_a_value_no_request_could_ask_for_is_an_error(tmp_path: Path, bad: dict[str, object]) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(bad))
    with pytest.raises(GenerationConfigError):
        sampling_defaults("hf", tmp_path)
