"""The configuration a load fits to: the asked one when it fits, else the prefill chunk first,
then the context, then the slots; refused, naming what would fit, only below one short sequence."""

from __future__ import annotations

import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.runner.load_fit import LoadDoesNotFit, LoadEstimate, MiB, fitted


def estimate(cfg: EngineConfig) -> LoadEstimate:
    chunk = cfg.prefill_chunk_tokens or min(2048, cfg.max_model_len)
    return LoadEstimate(
        weights=200 * MiB,
        fixed=cfg.max_num_seqs * MiB,
        one_sequence=cfg.max_model_len * 45 * 1024,
        activations=chunk * cfg.max_model_len * 72,  # grows with chunk x context, as scores do
        staging=0,
    )


def test_the_asked_configuration_when_it_fits() -> None:
    cfg = EngineConfig(max_num_seqs=16, max_model_len=8192)
    assert fitted(cfg, estimate, 4096 * MiB) == (cfg, "")


def test_the_prefill_chunk_goes_first_then_the_context_then_the_slots() -> None:
    cfg = EngineConfig(max_num_seqs=16, max_model_len=8192)
    got, note = fitted(cfg, estimate, 900 * MiB)
    assert got.max_model_len == 8192 and got.max_num_seqs == 16 and got.prefill_chunk_tokens < 2048
    assert note.startswith("fitted to memory: prefill_chunk_tokens 2048 -> ") and "--fit off" in note
    got, note = fitted(cfg, estimate, 400 * MiB)
    assert got.prefill_chunk_tokens == 256 and got.max_model_len < 8192 and got.max_num_seqs == 16
    assert f"max_model_len 8192 -> {got.max_model_len}" in note
    assert estimate(got).total <= 400 * MiB


def test_below_one_short_sequence_it_refuses_naming_what_would_fit() -> None:
    with pytest.raises(LoadDoesNotFit, match=r"one 512-token sequence.*would fit with [0-9.,]+ MiB more"):
        fitted(EngineConfig(max_num_seqs=16, max_model_len=8192), estimate, 100 * MiB)
