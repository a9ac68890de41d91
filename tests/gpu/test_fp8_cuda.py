"""The Triton FP8 GEMMs (weights float8 with block scales, activations bf16) against the dequantized
reference, dense and grouped by expert; and models with kept FP8 weights on the GPU giving the
reference's tokens, in eager steps and CUDA graphs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from ballast.models.layers.fp8 import dequantize_blocks, kernels_available, quantize_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))  # the CPU tests' helpers
cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not kernels_available(torch.device("cuda")),
    reason="needs CUDA with compute capability 8.9+ and Triton",
)
DEV = torch.device("cuda")


def close(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest error relative to the output's scale."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


@cuda
@pytest.mark.parametrize("m", [1, 5, 16, 64, 200, 1000])
@pytest.mark.parametrize(
    ("n", "k", "block"), [(4096, 4096, (128, 128)), (1000, 704, (128, 128)), (96, 64, (32, 32))]
)
def test_dense_block_fp8_matmul(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    from ballast.models.kernels.fp8_triton import block_fp8_matmul

    torch.manual_seed(m + n)
    w, scale = quantize_blocks(torch.randn(n, k, device=DEV) * 0.02, block)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    want = x.float() @ dequantize_blocks(w, scale, block, torch.float32).T
    assert close(block_fp8_matmul(x, w, scale, block), want) < 2e-2


@cuda
@pytest.mark.parametrize("m", [16, 64, 200, 1000])
def test_fp8_activations_matmul(m: int) -> None:
    """The FP8 x FP8 kernel: activations quantized per row and 128 columns, rounded to nearest (each
    within 1/16 of itself, or e4m3's smallest step at its group's scale); the product's error is
    that of FP8 activations: ~2.5% of the output's mean magnitude (Triton's interpreter, exactly
    quantized inputs: the GEMM itself agreed to 4e-7)."""
    from ballast.models.kernels.w8a8_triton import quantize_rows, w8a8_matmul

    torch.manual_seed(m)
    block = (128, 128)
    w, scale = quantize_blocks(torch.randn(1000, 4096, device=DEV) * 0.02, block)
    x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
    q, s = quantize_rows(x)
    back = (q.float().view(m, 32, 128) * s.unsqueeze(-1)).view(m, 4096)
    step = s.repeat_interleave(128, 1) * 2**-9
    assert ((back - x.float()).abs() <= x.float().abs() / 16 + step).all()
    want = x.float() @ dequantize_blocks(w, scale, block, torch.float32).T
    got = w8a8_matmul(x, w, scale, block).float()
    assert close(got, want) < 0.1
    assert ((got - want).abs().mean() / want.abs().mean()).item() < 0.035


@cuda
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(1, 512, 10), (32, 512, 10), (300, 64, 4), (7, 8, 2)]
)
def test_grouped_fp8_matmul_by_expert(tokens: int, experts: int, top_k: int) -> None:
    from ballast.models.blocks.moe import Routing
    from ballast.models.kernels.fp8_triton import Groups, grouped_fp8_matmul

    torch.manual_seed(tokens)
    n, k, block = 1024, 512, (128, 128)
    w, scale = quantize_blocks(torch.randn(experts, n, k, device=DEV) * 0.02, block)
    choice = torch.stack([torch.randperm(experts, device=DEV)[:top_k] for _ in range(tokens)])
    routing = Routing.sort(choice, experts)
    rows = torch.randn(tokens * top_k, k, device=DEV, dtype=torch.bfloat16)
    got = grouped_fp8_matmul(rows, Groups.plan(routing.counts, rows.shape[0], block), w, scale, block)
    expert_of_row = choice.reshape(-1)[routing.order]
    dense = dequantize_blocks(w, scale, block, torch.float32)
    want = torch.einsum("rk,rnk->rn", rows.float(), dense[expert_of_row])
    assert close(got, want) < 2e-2


@torch.no_grad()
def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    from ballast.models.base import ForwardBatch
    from ballast.models.layers.state import allocate_states

    states = allocate_states(model.layer_specs(2), 1, 32, DEV, torch.bfloat16)
    return model(ForwardBatch.build([(0, ids, 0)], DEV), states)[0]


@cuda
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3-next"])
def test_kept_fp8_model_on_gpu_matches_its_dequantized_twin(tmp_path: Path, name: str) -> None:
    """One FP8 checkpoint loaded kept (Triton GEMMs on float8) and dequantized to bf16 (cuBLAS):
    close logits; through the engine (decode graphs on) the kept load holds fewer bytes and
    replays graphs, and starts with the same greedy token."""
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine
    from ballast.models.arch.builtin import build_builtin, builtin_config
    from ballast.models.weights.hf_loader import load_hf_dir
    from test_fp8_weights import greedy_run, quantize_state
    from test_hf_loader import HYBRID_IDS, write_checkpoint

    block = (16, 32)
    tensors, _ = quantize_state(build_builtin(name).state_dict(), block)
    config = {
        **builtin_config(name),
        "quantization_config": {"quant_method": "fp8", "weight_block_size": block},
    }
    write_checkpoint(tmp_path, config, tensors)
    kept = load_hf_dir(tmp_path, torch.bfloat16, DEV, keep_fp8=True)
    twin = load_hf_dir(tmp_path, torch.bfloat16, DEV)
    assert close(logits(kept, HYBRID_IDS), logits(twin, HYBRID_IDS)) < 3e-2
    runs = {}
    for mode in ("keep", "dequantize"):
        engine = Engine.load(
            EngineConfig(
                model=str(tmp_path), device="cuda", max_num_seqs=2, max_model_len=128, fp8_weights=mode
            )
        )
        try:
            tokens = greedy_run(engine, 24)
            graphs = engine.runner.graph_runner.graphs
            runs[mode] = (engine.load_report.weights_bytes, tokens, graphs.replays if graphs else 0)
        finally:
            engine.shutdown()
    assert runs["keep"][0] < runs["dequantize"][0]
    assert runs["keep"][2] > 0  # the float8 GEMMs were captured and replayed
    assert runs["keep"][1][0] == runs["dequantize"][1][0]
