"""An FP8 checkpoint (128 x 128 block scales) of the Qwen3-Next shape on two GPUs: each rank keeps
its float8 parts and their scales and multiplies them with the FP8 kernels; the logits equal one
GPU's holding the same checkpoint, within bf16 tolerance.

Run with NVLink SHARP off: NCCL_NVLS_ENABLE=0 pytest tests/gpu/test_tensor_parallel_fp8_cuda.py"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from ballast.models.layers.fp8 import FP8, kernels_available
from ballast.models.weights.hf_loader import load_hf_dir
from test_tensor_parallel_cuda import qwen3_next_shaped
from tp_harness import (
    assert_close_in_bf16,
    dequantized_logits,
    run_steps,
    sharded_logits,
    steps_for,
    write_checkpoint,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def test_tp2_fp8_logits_match_tp1(tmp_path: Path) -> None:
    assert kernels_available(torch.device("cuda", 0)), "the FP8 kernels need compute capability 8.9+"
    hf = write_checkpoint(qwen3_next_shaped(), tmp_path / "fp8", True, (128, 128))
    steps = steps_for(hf["vocab_size"])
    one = load_hf_dir(hf["checkpoint_dir"], torch.bfloat16, "cuda:0", keep_fp8=True)
    experts = next(m for n, m in one.named_modules() if n.endswith("mlp.experts"))
    assert experts.gate_up_proj.dtype == FP8
    want = run_steps(one, steps, torch.bfloat16, torch.device("cuda", 0))
    del one
    [got] = sharded_logits([{**hf, "keep_fp8": True}], steps, 2, torch.bfloat16, "cuda")
    assert_close_in_bf16(got, want, dequantized_logits(hf["checkpoint_dir"], steps))
