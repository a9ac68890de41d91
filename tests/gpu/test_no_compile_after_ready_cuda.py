"""On CUDA: once an engine is loaded (start-up's warm-up, engine/runner/warm_up.py, ran), prompts of
lengths it never served, alone, several at once and beside decode tokens, make Triton compile
nothing: every variant a step can meet was made before /ready. Triton's post-compile hook counts
each compile (from its disk cache too), for every kernel of the process. The hybrid MoE tiny model
(gated DeltaNet, attention, routed experts: the 80B's kernel families). Skips cleanly without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from engine_steps import fresh_prompts_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_prompts_of_new_lengths_compile_nothing_after_load() -> None:
    import triton

    if getattr(getattr(triton, "knobs", None), "runtime", None) is None:
        pytest.skip("this Triton has no compile hooks (triton.knobs, 3.4 on)")
    engine = Engine.load(
        EngineConfig(
            model="builtin:tiny-qwen3-next", device="cuda", dtype="bfloat16", max_num_seqs=8,
            max_model_len=1024, prefill_chunk_tokens=512,
        )
    )  # fmt: skip
    compiled: list[str] = []

    def hook(*args: Any, **kwargs: Any) -> bool:
        compiled.append(str(kwargs.get("repr", args))[:160])  # the kernel and its specialization
        return False

    knobs = triton.knobs.runtime
    knobs.jit_post_compile_hook = hook
    try:

        def step(lengths: list[int], seed: int, decode: bool = False) -> None:

            fresh_prompts_step(engine, lengths, seed, 7 if decode else None)

        for seed, lengths in enumerate([[266], [3], [48], [200, 31], [411], [97, 5, 6], [512], [25, 26]]):
            step(lengths, seed)
            step(lengths, 100 + seed, decode=True)
        assert compiled == []
    finally:
        knobs.jit_post_compile_hook = None
        engine.shutdown()
