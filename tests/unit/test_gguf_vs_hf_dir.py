"""The same weights loaded from a GGUF file and from a Hugging Face directory give identical logits.

The directory is written from the GGUF's own config and dequantized tensors (config.json +
model.safetensors), so any difference comes from the two loaders, not from the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ballast.models.arch.registry import build_model
from ballast.models.base import ForwardBatch
from ballast.models.layers.state import allocate_states
from ballast.models.weights.gguf_loader import load_gguf
from ballast.models.weights.hf_loader import load_hf_dir
from safetensors.torch import save_file
from test_gguf_loader import write_tiny_llama
from torch import nn


def _logits(model: nn.Module, seqs: list[tuple[int, list[int], int]]) -> torch.Tensor:
    states = allocate_states(model.layer_specs(4), num_slots=4, max_len=64, device="cpu", dtype=torch.float32)
    with torch.inference_mode():
        return model(ForwardBatch.build(seqs, "cpu"), states)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_and_hf_dir_give_identical_logits(tmp_path: Path, arch: str) -> None:
    tiny = write_tiny_llama(tmp_path / f"{arch}.gguf", arch=arch, seed=3)
    gguf = load_gguf(tiny.path)
    from_gguf = build_model(gguf.config)
    from_gguf.load_state_dict(gguf.tensors, strict=False)
    from_gguf.tie_weights()

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(gguf.config))
    save_file({k: v.contiguous() for k, v in gguf.tensors.items()}, str(hf_dir / "model.safetensors"))
    from_dir = load_hf_dir(hf_dir)

    seqs = [(0, [5, 17, 42, 99, 7], 0), (1, [250, 3, 11], 0), (2, [8], 0)]
    a, b = _logits(from_gguf, seqs), _logits(from_dir, seqs)
    assert a.shape == (3, gguf.config["vocab_size"])
    assert torch.equal(a, b)
