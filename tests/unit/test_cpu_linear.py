"""Where the CPU's bfloat16 prompt chunks may run (models/blocks/cpu_linear.py `bf16_available`; what they
compute: tests/unit/test_cpu_prefill.py, which needs such a CPU)."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.models.blocks import cpu_linear

from ballast.settings import ConfigError


def test_bf16_prompts_are_refused_where_onednn_keeps_float32() -> None:
    """bf16_available tries the product: with oneDNN's matmuls off (as on a CPU whose oneDNN
    ignores the bfloat16 mode) --cpu-prefill bfloat16 is an error, not a silent float32 prefill."""
    cpu = torch.device("cpu")
    cpu_linear.bf16_available.cache_clear()
    try:
        with torch.backends.mkldnn.flags(enabled=False):
            assert not cpu_linear.bf16_available()
            with pytest.raises(ConfigError, match="cpu-prefill"):
                EngineConfig(device="cpu", cpu_prefill="bfloat16").cpu_prompt_bf16(cpu)
    finally:
        cpu_linear.bf16_available.cache_clear()
