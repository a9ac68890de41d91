"""On CUDA, a step of prompt chunks beside decode tokens: the chunks are attended by the prefill
kernel and the one-token tail by the decode kernel, and the logits match the CPU model's (its
gathering reference) on the same weights and cache, with one KV store and with a sequence in the
int8 store beside the main one. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import PrefillChunk, SamplingParams, StepPlan
from ballast.models.arch.builtin import build_builtin
from ballast.models.base import ForwardBatch
from ballast.models.layers.state import allocate_states, dtype_bytes

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["builtin:tiny-llama", "builtin:tiny-qwen3-next"])
@pytest.mark.parametrize("quantized_kv", [False, True])
@torch.no_grad()
def test_mixed_step_matches_the_cpu_reference(name: str, quantized_kv: bool) -> None:
    cpu = build_builtin(name)
    gpu = build_builtin(name, device=CUDA)
    gpu.load_state_dict(cpu.state_dict())
    specs = cpu.layer_specs(dtype_bytes(torch.float32))
    cpu_states = allocate_states(specs, 5, 512, "cpu", torch.float32, quantized_kv)
    gpu_states = allocate_states(specs, 5, 512, CUDA, torch.float32, quantized_kv)

    def both(seqs: list[tuple[int, list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
        batch = ForwardBatch.build(seqs, CUDA)
        got = gpu(batch, gpu_states).float().cpu()
        return got, cpu(ForwardBatch.build(seqs, "cpu"), cpu_states), batch

    # Slots 0 and 2 hold 300 and 130 tokens of context; slot 4 a shorter one.
    both([(0, _tokens(300, 1), 0), (2, _tokens(130, 2), 0), (4, _tokens(20, 3), 0)])
    # Prompt chunks first (a cold 64-token one, a later 40-token one of slot 4), then one-token
    # sequences: a one-token prompt (slot 3) and the decodes of slots 0 and 2.
    mixed = [
        (1, _tokens(64, 4), 0),
        (4, _tokens(40, 5), 20),
        (3, [7], 0),
        (0, [11], 300),
        (2, [13], 130),
    ]
    got, want, batch = both(mixed)
    assert batch.tail_from == 2  # the decode kernel's share
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    # The next step reads what the mixed one wrote: every slot decodes once more.
    got, want, _ = both([(1, [5], 64), (4, [6], 60), (3, [8], 1), (0, [9], 301), (2, [10], 131)])
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@torch.no_grad()
def test_mixed_step_over_both_kv_stores_matches_the_cpu_engine() -> None:
    """A prompt beside decodes while one decoding sequence lives in the int8 store (the ladder's
    quantized-KV rung): each store is attended with the other store's sequences cut to their first
    position, in the prefill kernel and in the decode kernel's tail alike. The CUDA engine's logits
    of such a step are the CPU engine's (same weights, float32, its gathering reference)."""
    greedy = SamplingParams(temperature=0.0)
    p0, p1, p2 = _tokens(200, 6), _tokens(120, 7), _tokens(90, 8)
    got: dict[str, torch.Tensor] = {}
    for device in ("cpu", "cuda"):
        e = Engine.load(
            EngineConfig(
                model="builtin:tiny-llama",
                device=device,
                dtype="float32",
                max_num_seqs=4,
                max_model_len=512,
                cuda_graphs=False,
                compile=False,
            )
        )
        try:
            two = (PrefillChunk(0, tuple(p0), 0, True), PrefillChunk(1, tuple(p1), 0, True, int8_kv=True))
            e.step(StepPlan(prefills=two, sampling=dict.fromkeys((0, 1), greedy)))
            runner = e.runner
            assert runner.kv is not None and runner.kv_int8 is not None and runner.kv_manager is not None
            assert runner.kv_manager.in_int8(1)  # slot 1 lives in the int8 store
            runner.reset([2])
            assert runner.kv.ensure(2, len(p2)) and runner.kv.ensure(0, len(p0) + 1)
            assert runner.kv_int8.ensure(1, len(p1) + 1)
            seqs = [(2, p2, 0), (0, [5], len(p0)), (1, [6], len(p1))]
            assert ForwardBatch.build(seqs, "cpu").tail_from == 1
            got[device] = runner.forward(seqs).float().cpu()
        finally:
            e.shutdown()
    torch.testing.assert_close(got["cuda"], got["cpu"], atol=2e-3, rtol=2e-3)
