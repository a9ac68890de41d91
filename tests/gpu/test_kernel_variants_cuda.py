"""On CUDA: serving prefills of any shape compiles no new variant of the Triton attention and
row-store kernels once the first steps ran. Triton compiles a kernel again for every 16-byte
alignment of its pointer arguments; a batch's index tensors used to be views of one packed
tensor at offsets their neighbours' lengths gave, so an H200 server spent most of its serving
time in Triton's compiler (seconds a step at 32 streams). Skips cleanly without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from engine_steps import fresh_prompts_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def variants(kernel: Any) -> int:
    """Compiled variants a Triton JITFunction holds, every device together."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def test_prefills_of_any_shape_compile_no_new_kernel_variant() -> None:
    from ballast.models.kernels.paged_triton import _prefill_kernel
    from ballast.models.layers import triton_attention as paged_store

    engine = Engine.load(
        EngineConfig(
            model="builtin:tiny-llama", device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=512
        )
    )
    try:

        def step(lengths: list[int], seed: int, decode: bool = False) -> None:

            fresh_prompts_step(engine, lengths, seed, 3 if decode else None)

        step([64], 0)
        step([33, 7], 1)
        before = (variants(_prefill_kernel), variants(paged_store._kernel))
        for seed, lengths in enumerate([[1, 2, 3], [17], [40, 41], [5, 6, 7], [100, 3, 9]]):
            step(lengths, 10 + seed)
            step(lengths, 20 + seed, decode=True)
        assert (variants(_prefill_kernel), variants(paged_store._kernel)) == before
    finally:
        engine.shutdown()
