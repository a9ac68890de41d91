"""The configuration a load fits to: the asked one when it fits, else the prefill chunk first,
then the context, then the slots; refused, naming what would fit, only below one short sequence."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.runner.activations import CPU_HEAP_FACTOR, activation_bytes, prefill_path
from ballast.engine.runner.load_fit import LoadDoesNotFit, LoadEstimate, MiB, bytes_beside_weights, fitted
from ballast.memory import heap


def estimate(cfg: EngineConfig) -> LoadEstimate:
    chunk = cfg.prefill_chunk_tokens or min(2048, cfg.max_model_len)
    return LoadEstimate(
        weights=200 * MiB,
        fixed=cfg.max_num_seqs * MiB,
        one_sequence=cfg.max_model_len * 45 * 1024,
        activations=chunk * cfg.max_model_len * 72,  # a steep one: the fit's order is what is tested
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


# SmolLM2-135M's shape (the default model's): 9 query heads over 3 KV heads of 64.
SMOL = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
}


def test_no_attention_path_holds_scores_over_the_context() -> None:
    """CPU flash in place, CPU gathered (int8 blocks) and CUDA: a chunk's bytes grow with the
    context by one layer's K/V (CPU; and the gathered path's mask, 5 bytes a query-key pair), never
    by float32 [heads, tokens, context] scores."""
    one_layer_kv = 2 * 3 * 64 * 4
    grow = {
        p: activation_bytes(SMOL, 2048, 8192, 4, p) - activation_bytes(SMOL, 2048, 2048, 4, p)
        for p in ("cpu", "device")
    }
    assert grow["cpu"] == 6144 * one_layer_kv
    gathered = activation_bytes(SMOL, 2048, 16384, 4, "cpu-gathered") - activation_bytes(
        SMOL, 2048, 8192, 4, "cpu-gathered"
    )
    assert gathered == pytest.approx(CPU_HEAP_FACTOR * 8192 * (one_layer_kv + 2048 * 5), abs=1)  # both
    assert grow["device"] == 0
    assert 2 * activation_bytes(SMOL, 2048, 8192, 4, "cpu") < 9 * 2048 * 8192 * 4  # scores alone
    assert prefill_path("cpu", False) == "cpu" and prefill_path("cpu", True) == "cpu-gathered"
    assert prefill_path("cuda", False) == "device"


def test_the_staging_is_gone_before_serving_holds_anything() -> None:
    est = LoadEstimate(
        weights=200 * MiB, fixed=MiB, one_sequence=100 * MiB, activations=50 * MiB, staging=120 * MiB
    )
    assert est.total == 351 * MiB
    assert dataclasses.replace(est, staging=400 * MiB).total == 600 * MiB
    assert (
        "max(staging 120.0, states+sampler 1.0 + one sequence 100.0 + activations 50.0) = 351.0 MiB"
        in est.describe()
    )
    # the tokenizer is held while the load stages and while serving: beside both
    assert dataclasses.replace(est, tokenizer=20 * MiB).total == 371 * MiB
    assert dataclasses.replace(est, tokenizer=20 * MiB, staging=400 * MiB).total == 620 * MiB


def test_the_heap_a_load_freed_goes_back_to_the_os() -> None:
    """The estimate takes the staging as gone before the first step: glibc kept 89 MiB of the
    default model's freed blocks resident until start-up trims the heap (memory/heap.py)."""
    if not heap.trim():
        pytest.skip("no glibc malloc_trim here")
    before = heap.resident_bytes()
    held = [bytearray(64 * 1024) for _ in range(1024)]  # 64 MiB in chunks under the mmap threshold
    pin = bytearray(64 * 1024)  # above them: the heap's top cannot shrink past it on its own
    grown = heap.resident_bytes() - before
    del held
    kept = heap.resident_bytes() - before
    heap.trim()
    after = heap.resident_bytes() - before
    assert grown > 48 * MiB and kept > grown - 8 * MiB, (grown, kept)  # freed, still resident
    assert after < grown / 4, (grown, after)
    del pin


def test_one_sequence_counts_the_whole_segments_the_pool_commits() -> None:
    """A CPU pool writes a 64 MiB segment whole when it adds it: one 8k sequence (45 KiB a token,
    360 MiB) and the sink take six."""
    cfg = EngineConfig(max_num_seqs=16, max_model_len=8192, device="cpu")
    _, one_sequence, _ = bytes_beside_weights(SMOL, cfg, torch.float32, "cpu")
    assert 8192 * 45 * 1024 < one_sequence < 8192 * 45 * 1024 + 64 * MiB
    big = dataclasses.replace(cfg, kv_segment_bytes=512 * MiB)
    assert 511 * MiB < bytes_beside_weights(SMOL, big, torch.float32, "cpu")[1] <= 512 * MiB  # one segment


def test_a_gpu_estimate_carries_the_step_workspace_start_up_leases() -> None:
    """engine/startup.py leases a full batch's sampling workspace and a prompt-logprob chunk on the
    die before the first step; the load estimate counts them there (on the 8B shape at 128 slots,
    552 MiB it left out), so a start they do not fit is fitted or refused before the weights load.
    A CPU engine leases neither."""
    from ballast.engine.workspace import step_workspace

    cfg = EngineConfig(max_num_seqs=128, max_model_len=4096)
    gpu, _, _ = bytes_beside_weights(SMOL, cfg, torch.bfloat16, "cuda")
    cpu, _, _ = bytes_beside_weights(SMOL, cfg, torch.bfloat16, "cpu")
    workspace = step_workspace(128, SMOL["vocab_size"], 2)
    assert gpu - cpu == workspace.sampler_bytes + workspace.prompt_logprobs_bytes > 500 * MiB
