"""The step's workspace beside the activations is counted (issue 31, item 4): the sampler's
[rows, vocab] temporaries and a prompt-logprob chunk's logits. The start-up capacity report names
each, with the bound that CUDA leases at load (tests/gpu/test_step_workspace_cuda.py measures the
sampler against it)."""

from __future__ import annotations

import logging

import pytest
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.workspace import PROMPT_LOGPROBS_ROWS, SAMPLER_BYTES_PER_LOGIT
from ballast.scheduler.planner import PROMPT_LOGPROBS_CHUNK


def test_the_capacity_report_names_the_sampler_and_logprob_workspaces(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = EngineConfig(model="builtin:tiny-llama", device="cpu", max_num_seqs=6, max_model_len=64)
    with caplog.at_level(logging.INFO, logger="ballast.engine.engine"):
        engine = Engine.load(cfg)
    try:
        vocab = engine.runner.sampler.vocab_size
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("capacity:"))
    finally:
        engine.shutdown()
    sampler = 6 * vocab * SAMPLER_BYTES_PER_LOGIT
    logprobs = PROMPT_LOGPROBS_ROWS * vocab * (4 + 8)  # float32 logits, their copy and log-softmax
    assert f"sampler workspace {sampler / (1 << 20):.1f} MiB" in line
    assert f"prompt-logprob chunk {logprobs / (1 << 20):.1f} MiB" in line
    assert "activations" in line
    assert PROMPT_LOGPROBS_CHUNK == PROMPT_LOGPROBS_ROWS  # the scheduler cuts a scoring chunk to the bound
