"""`--speculative-config` (BALLAST_SPECULATIVE_CONFIG): vLLM's JSON form, checked once at start."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ballast.engine.workspace import VerifySize

from ballast.settings import ConfigError

# ngram: prompt lookup (engine.spec.ngram), any model; mtp: the model's multi-token-prediction
# layer (engine.spec.mtp), a model that carries one (the engine refuses one that does not).
METHODS = ("ngram", "mtp")
FLAG = "--speculative-config / BALLAST_SPECULATIVE_CONFIG"
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_streams"}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: drafts verified per sequence and step
    prompt_lookup_min: int = 1  # shortest suffix n-gram looked up in the context
    prompt_lookup_max: int = 4  # longest
    # Drafting pays at small batches (a step reads the weights once for every row) and costs at
    # large ones (the verify positions are compute): from this many decoding streams on, none.
    max_streams: int = 8

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"{FLAG}: method {self.method!r} is not supported (supported: {', '.join(METHODS)})"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(
                f"{FLAG}: num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 64:
            raise ConfigError(
                f"{FLAG}: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if not 1 <= self.max_streams <= 1 << 16:
            raise ConfigError(f"{FLAG}: max_streams must be in 1..65536, got {self.max_streams}")

    def verify_size(self, max_num_seqs: int) -> VerifySize:
        """The verify steps this drafting asks of an engine of max_num_seqs slots: fewer streams
        than max_streams draft (the planner's rule), k drafts each at most."""
        return VerifySize(min(max_num_seqs, self.max_streams - 1), self.num_speculative_tokens)

    def check_verify(self, size: VerifySize | None, max_num_seqs: int) -> None:
        """A hybrid model rolls a rejected draft back to the state its verify step kept: its engine
        must keep them for the verify steps this drafting makes."""
        need, have = self.verify_size(max_num_seqs), size or VerifySize()
        if have.rows < need.rows or have.drafts < need.drafts:
            raise ConfigError(
                f"{FLAG}: a hybrid model's verify steps keep per-position states, for {need.rows} "
                f"rows of {need.drafts} drafts here; this engine keeps {have.rows} of {have.drafts} "
                "(Engine.load(..., verify=SpeculativeConfig.verify_size(n)); none under tensor parallel)"
            )


def parse_speculative_config(text: str) -> SpeculativeConfig | None:
    """The config a flag's JSON text asks for; None for an empty text (drafting off)."""
    if not text.strip():
        return None
    try:
        raw: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{FLAG}: not JSON ({exc.msg} at column {exc.colno})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{FLAG}: expected a JSON object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _KEYS)
    if unknown:
        raise ConfigError(f"{FLAG}: unknown keys {unknown} (known: {sorted(_KEYS)})")
    if "method" not in raw:
        raise ConfigError(f"{FLAG}: 'method' is required")
    for key, value in raw.items():
        want = str if key == "method" else int
        if not isinstance(value, want) or isinstance(value, bool):
            raise ConfigError(
                f"{FLAG}: {key} must be {'a string' if want is str else 'an integer'}, got {value!r}"
            )
    return SpeculativeConfig(**raw)
