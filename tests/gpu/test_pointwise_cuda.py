"""On CUDA the pointwise pieces of a layer (norms, rope, gated activations) run compiled by
torch.compile inside the decode graphs, one kernel each: the same values as their eager code, the
eager code outside the graphs, and an engine with them compiled generates the same greedy tokens
as one without. Skips cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.models.layers import pointwise

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(autouse=True)
def compiled() -> object:
    pointwise.set_enabled(True)
    yield None
    pointwise.set_enabled(True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 300])
def test_compiled_pieces_match_their_eager_code(dtype: torch.dtype, tokens: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    dev = torch.device("cuda")
    x = torch.randn(tokens, 256, device=dev, dtype=dtype, generator=gen)
    w = torch.randn(256, device=dev, dtype=dtype, generator=gen)
    gate = torch.randn(tokens, 256, device=dev, dtype=dtype, generator=gen)
    heads = torch.randn(tokens, 4, 64, device=dev, dtype=dtype, generator=gen)
    angle = torch.randn(tokens, 64, device=dev, generator=gen)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    with pointwise.fused():
        pairs = [
            (pointwise.rms_norm(x, w, 1e-6), pointwise._rms_norm(x, w, 1e-6)),
            (pointwise.centered_rms_norm(x, w, 1e-6), pointwise._centered_rms_norm(x, w, 1e-6)),
            (pointwise.gated_rms_norm(x, gate, w, 1e-6), pointwise._gated_rms_norm(x, gate, w, 1e-6)),
            (pointwise.rope(heads, cos, sin), pointwise.apply_rope(heads, cos, sin)),
            (
                pointwise.rope(heads, cos[:, :32], sin[:, :32]),
                pointwise.apply_rope(heads, cos[:, :32], sin[:, :32]),
            ),
            (
                pointwise.silu_mul(torch.cat((x, gate), 1), 256),
                pointwise._silu_mul(torch.cat((x, gate), 1), 256),
            ),
            *zip(
                pointwise.add_rms_norm(x, gate, w, 1e-6),
                pointwise._add_rms_norm(x, gate, w, 1e-6),
                strict=True,
            ),
            *zip(
                pointwise.centered_add_rms_norm(x, gate, w, 1e-6),
                pointwise._centered_add_rms_norm(x, gate, w, 1e-6),
                strict=True,
            ),
        ]
    assert pointwise.enabled(), "compiling failed on this machine"
    for got, want in pairs:
        torch.testing.assert_close(got, want, **tol)


def test_the_compiled_kernels_run_only_inside_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside a graph's capture a call takes the eager code (dynamo's guards cost the host more
    than the launches they save); inside `fused()` the compiled one."""
    calls: list[str] = []

    def compiled(*args: object) -> torch.Tensor:
        calls.append("compiled")
        return pointwise._rms_norm(*args)  # type: ignore[arg-type]

    monkeypatch.setitem(pointwise._compiled, "rms_norm", compiled)
    x = torch.randn(3, 64, device="cuda")
    w = torch.ones(64, device="cuda")
    pointwise.rms_norm(x, w, 1e-6)
    assert calls == []
    with pointwise.fused():
        pointwise.rms_norm(x, w, 1e-6)
    assert calls == ["compiled"]
    pointwise.rms_norm(x, w, 1e-6)
    assert calls == ["compiled"]


def generate(model: str, compile: bool) -> list[int]:
    engine = Engine.load(
        EngineConfig(
            model=model,
            device="cuda",
            dtype="float32",
            max_num_seqs=2,
            max_model_len=256,
            prefill_chunk_tokens=64,
            compile=compile,
        )
    )
    try:
        prompt = tuple(range(5, 45))
        out = engine.step(
            StepPlan(prefills=(PrefillChunk(0, prompt, 0, True),), sampling={0: GREEDY})
        ).outputs
        tokens = [out[0].token_id]
        for pos in range(len(prompt), len(prompt) + 24):
            out = engine.step(
                StepPlan(decodes=(DecodeToken(0, tokens[-1], pos),), sampling={0: GREEDY})
            ).outputs
            tokens.append(out[0].token_id)
        return tokens
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model", ["builtin:tiny-llama", "builtin:tiny-qwen3-next"])
def test_compiled_engine_generates_the_same_tokens(model: str) -> None:
    eager = generate(model, compile=False)
    assert not pointwise.enabled()
    assert generate(model, compile=True) == eager
    assert pointwise.enabled()
