"""What the engine knows reaches admission from the engine itself, through `create_app` as
`ballast serve` wires it: the die its memory lives on and the format of its KV. An engine that
stores int8 KV (BALLAST_KV_QUANT=int8) is charged int8 bytes: on a die with room for 128 tokens of
model-dtype KV, a 220-token request is admitted whole in int8 and capped in the model dtype."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from ballast.memory.config import MemoryConfig
from ballast.memory.device import DieReading, StaticDeviceReader
from ballast.memory.types import CostModel, KiB, Level, MiB
from ballast.memory.watch import MemWatch
from ballast.scheduler.config import SchedulerConfig
from ballast.server.app import create_app
from ballast.server.config import ServerConfig
from fake_engine import FakeEngine
from memfixtures import level_tree
from serverproc import running_server

# 64 KiB per token in the model dtype, 16 KiB in int8; the die's ledger has 8 MiB of headroom:
# 128 tokens of model-dtype KV, 512 of int8.
COST = CostModel(
    kv_bytes_per_token=64 * KiB,
    state_bytes_per_slot=0,
    activation_bytes_per_prefill_token=0,
    quantized_kv_bytes_per_token=16 * KiB,
    state_preallocated=True,
)
MAX_TOKENS = 200


def completion_tokens(root: Path, quantized_kv: bool) -> tuple[int, str | None]:
    root.mkdir()
    cfg = MemoryConfig(root=str(root), poll_interval_s=0.05, vram_usable_fraction=1.0, die_reserve_bytes=0)
    level_tree(root, Level.OK, config=cfg)
    watch = MemWatch(cfg, StaticDeviceReader([DieReading(0, "test-gpu", 64 * MiB, 60 * MiB)]))
    watch.ledger.register_die(0, 64 * MiB, 8 * MiB)  # the ceiling: 8 MiB of leases
    engine = lambda: FakeEngine(gpu_die=0, quantized_kv=quantized_kv, cost_model=COST, max_model_len=1024)  # noqa: E731
    app = create_app(ServerConfig(), SchedulerConfig(), engine, memwatch=watch)
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        out = client.completions.create(model="fake-model", prompt="hello " * 10, max_tokens=MAX_TOKENS)
    assert out.usage is not None
    return out.usage.completion_tokens, out.choices[0].finish_reason


@pytest.mark.parametrize(("quantized_kv", "whole"), [(True, True), (False, False)])
def test_admission_charges_the_engines_kv_format(tmp_path: Path, quantized_kv: bool, whole: bool) -> None:
    tokens, reason = completion_tokens(tmp_path / "root", quantized_kv)
    assert reason == "length"
    if whole:
        assert tokens == MAX_TOKENS
    else:  # capped to what 8 MiB of model-dtype KV holds: 128 tokens, prompt included
        assert 0 < tokens < 128
