"""Our engine against the transformers reference, float32 on CPU, same weights: prefill logits,
and greedy step-by-step decode of 4 slots at different lengths batched together versus each
prompt generated alone by transformers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.models.kernels import cpu_kernel
from transformers import LlamaConfig, LlamaForCausalLM

GREEDY = SamplingParams(temperature=0.0)
TINY_LOGIT_BOUND = 1e-4
DEFAULT_LOGIT_BOUND = 5e-4  # 30 layers 576 wide; measured 5.6e-5 (float32 summation order differs from HF)


def reference(engine: Engine) -> LlamaForCausalLM:
    """transformers' Llama with our engine's exact weights."""
    hf_config: dict[str, Any] = {k: v for k, v in engine.hf_config.items() if k != "seed"}
    ref = LlamaForCausalLM(LlamaConfig(**hf_config)).eval()
    missing, unexpected = ref.load_state_dict(engine.runner.model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ref.tie_weights()
    return ref


def prompts(vocab: int) -> dict[int, list[int]]:
    gen = torch.Generator().manual_seed(123)
    return {
        slot: torch.randint(3, vocab, (n,), generator=gen).tolist()
        for slot, n in {0: 4, 1: 13, 2: 1, 3: 29}.items()
    }


def hf_greedy(ref: LlamaForCausalLM, ids: list[int], new_tokens: int) -> list[int]:
    out = ref.generate(
        torch.tensor([ids]),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return list(out[0, len(ids) :].tolist())


def batched_greedy(engine: Engine, prompts: dict[int, list[int]], new_tokens: int) -> dict[int, list[int]]:
    """Prefill all slots in one step, then decode them together, each at its own position."""
    sampling = dict.fromkeys(prompts, GREEDY)
    res = engine.submit(
        StepPlan(
            prefills=tuple(PrefillChunk(s, tuple(p), 0, True) for s, p in prompts.items()), sampling=sampling
        )
    ).result()
    got = {o.slot: [o.token_id] for o in res.outputs}
    for step in range(new_tokens - 1):
        plan = StepPlan(
            decodes=tuple(DecodeToken(s, got[s][-1], len(p) + step) for s, p in prompts.items()),
            sampling=sampling,
        )
        for o in engine.submit(plan).result().outputs:
            got[o.slot].append(o.token_id)
    return got


def max_prefill_logit_diff(engine: Engine, ref: LlamaForCausalLM, prompts: dict[int, list[int]]) -> float:
    kv = engine.runner.kv
    assert kv is not None
    for s, p in prompts.items():
        kv.release(s)
        assert kv.ensure(s, len(p))
    ours = engine.runner.forward([(s, p, 0) for s, p in prompts.items()])
    worst = 0.0
    with torch.inference_mode():
        for row, p in enumerate(prompts.values()):
            theirs = ref(torch.tensor([p])).logits[0, -1]
            worst = max(worst, float((ours[row] - theirs).abs().max()))
    return worst


@pytest.fixture(scope="module")
def tiny() -> Iterator[Engine]:
    eng = Engine.load(
        EngineConfig(
            model="builtin:tiny-llama",
            device="cpu",
            max_num_seqs=4,
            max_model_len=64,
            prefill_chunk_tokens=32,
        )
    )
    yield eng
    eng.shutdown()


def test_tiny_prefill_logits_match_transformers(tiny: Engine) -> None:
    ref = reference(tiny)
    assert max_prefill_logit_diff(tiny, ref, prompts(49152)) < TINY_LOGIT_BOUND


def test_tiny_batched_decode_matches_transformers_alone(tiny: Engine) -> None:
    ref = reference(tiny)
    ps = prompts(49152)
    ours = batched_greedy(tiny, ps, new_tokens=10)
    for slot, ids in ps.items():
        assert ours[slot] == hf_greedy(ref, ids, 10), f"slot {slot} ({len(ids)} prompt tokens)"


def default_engine(cpu_weights: str) -> Engine:
    return Engine.load(
        EngineConfig(
            model="default",
            device="cpu",
            dtype="float32",
            max_num_seqs=4,
            max_model_len=128,
            prefill_chunk_tokens=64,
            cpu_weights=cpu_weights,
        )
    )


@pytest.fixture(scope="module")
def default_dense() -> Iterator[Engine]:
    eng = default_engine("dense")
    yield eng
    eng.shutdown()


@pytest.mark.slow
def test_default_model_matches_transformers(default_dense: Engine) -> None:
    ref = reference(default_dense)
    ps = prompts(49152)
    assert max_prefill_logit_diff(default_dense, ref, ps) < DEFAULT_LOGIT_BOUND
    ours = batched_greedy(default_dense, ps, new_tokens=8)
    for slot, ids in ps.items():
        assert ours[slot] == hf_greedy(ref, ids, 8), f"slot {slot} ({len(ids)} prompt tokens)"


@pytest.mark.slow
def test_default_model_blocks_match_transformers(default_dense: Engine) -> None:
    """--cpu-weights blocks (the CPU default where its kernel builds) against transformers on the
    float32 values of the same blocks: the float32 bound and the same greedy tokens, as dense."""
    if not cpu_kernel.available():
        pytest.skip("no C compiler or no AVX2/FMA here")
    ref = reference(default_dense)
    eng = default_engine("blocks")
    try:
        assert eng.load_report.weights_bytes < 0.5 * default_dense.load_report.weights_bytes
        ps = prompts(49152)
        assert max_prefill_logit_diff(eng, ref, ps) < DEFAULT_LOGIT_BOUND
        ours = batched_greedy(eng, ps, new_tokens=8)
        for slot, ids in ps.items():
            assert ours[slot] == hf_greedy(ref, ids, 8), f"slot {slot} ({len(ids)} prompt tokens)"
    finally:
        eng.shutdown()
