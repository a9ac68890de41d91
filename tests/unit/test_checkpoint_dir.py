"""bench/checkpoint_dir writes a random-weight directory in the real checkpoint layout: sharded
safetensors with an index, config, generation config and the default model's tokenizer (from the
archive in the repository, no network), which transformers and ballast both load as they would a
downloaded checkpoint - in bfloat16 and in the fine-grained FP8 layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from ballast.bench.checkpoint_dir import write_dir
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine


@pytest.mark.parametrize("fp8", [False, True])
def test_a_written_directory_loads_in_transformers_and_ballast(tmp_path: Path, fp8: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "model"
    info = write_dir("tiny-qwen3-next", out, torch.device("cpu"), fp8=fp8, shard_gib=0.03)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert info["shards"] > 1 and len(set(index["weight_map"].values())) == info["shards"]
    if fp8:
        assert any(k.endswith("weight_scale_inv") for k in index["weight_map"])
    else:
        _, missing = AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
        assert not any(missing.values())  # every tensor of transformers' model, nothing extra
    tok = AutoTokenizer.from_pretrained(str(out))
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")
    eng = Engine.load(EngineConfig(model=str(out), device="cpu", max_num_seqs=1, max_model_len=128))
    try:
        assert eng.tokenizer.encode("hello world") == tok.encode("hello world")
        assert eng.hf_config["num_experts"] == 16
    finally:
        eng.shutdown()
