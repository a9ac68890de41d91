"""Sampling parameters a request gets for the ones it omits, from what the model ships.

A Hugging Face directory's `generation_config.json` gives them (as vLLM applies it). A GGUF has
no such file, so it gets llama.cpp's server defaults (`GGUF_DEFAULTS`): at temperature 1 with no
truncation the embedded SmolLM2-135M wanders into gibberish within a sentence. Built-in models
keep the plain defaults. A request's own values always win.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GGUF_DEFAULTS: dict[str, float] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
_KEYS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "top_k": (0, 1 << 30),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.0, 10.0),
}


class GenerationConfigError(ValueError):
    """generation_config.json holds a sampling value outside what a request may ask for."""


def sampling_defaults(kind: str, path: Path | None) -> dict[str, float]:
    """Defaults for a model of this source kind ("builtin" | "gguf" | "hf") at this path."""
    if kind == "gguf":
        return dict(GGUF_DEFAULTS)
    if kind != "hf" or path is None:
        return {}
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    try:
        data: dict[str, Any] = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GenerationConfigError(f"unreadable {file}: {e}") from e
    out: dict[str, float] = {}
    for key, (lo, hi) in _KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or not lo <= value <= hi
        ):
            raise GenerationConfigError(f"{file}: {key} must be a number in [{lo}, {hi}], got {value!r}")
        out[key] = float(value)
    if out.get("top_p") == 0.0:
        raise GenerationConfigError(f"{file}: top_p must be > 0")
    return out
