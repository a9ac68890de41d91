"""BALLAST_FAULTS: the settings' strict parsing and when each fault fires (real engine steps)."""

from __future__ import annotations

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.injected_faults import FaultInjector, FaultSpec, parse_faults
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepFailed, StepPlan

from ballast.settings import ConfigError

GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize(
    ("value", "names"),
    [
        ("not json", "is not JSON"),
        ('{"kind": "oom"}', "JSON list"),
        ('[{"kind": "explode"}]', "kind 'explode'"),
        ('[{"kind": "oom", "when": "sometimes"}]', "when 'sometimes'"),
        ('[{"kind": "oom", "count": 0}]', "count"),
        ('[{"kind": "oom", "after_steps": -1}]', "after_steps"),
        ('[{"kind": "hang", "seconds": "long"}]', "seconds"),
        ('[{"kind": "oom", "rank": 9}]', "rank"),
        ('[{"kind": "oom", "steps": 3}]', "unknown fields ['steps']"),
    ],
)
def test_a_bad_value_is_a_start_up_error_naming_the_entry(value: str, names: str) -> None:
    with pytest.raises(ConfigError, match="BALLAST_FAULTS") as err:
        EngineConfig(faults=value)
    assert names in str(err.value)


def test_defaults_and_fields() -> None:
    (hang,) = parse_faults('[{"kind": "hang"}]')
    assert hang == FaultSpec("hang", 0, 1, "any", 3600.0, 0)
    (oom,) = parse_faults('[{"kind": "oom", "after_steps": 2, "count": -1, "when": "decode", "rank": 1}]')
    assert (oom.after_steps, oom.count, oom.when, oom.rank) == (2, -1, "decode", 1)
    assert parse_faults(None) == ()


def test_faults_fire_on_their_steps_only() -> None:
    specs = parse_faults('[{"kind": "oom", "after_steps": 1, "count": 2, "when": "decode"}]')
    inj = FaultInjector(specs, torch.device("cpu"))
    inj.before_forward(prefill=False)  # step 0: before after_steps
    inj.before_forward(prefill=True)  # step 1: a prefill, not its kind
    for _ in range(2):
        with pytest.raises(MemoryError, match="injected by BALLAST_FAULTS"):
            inj.before_forward(prefill=False)
    inj.before_forward(prefill=False)  # count spent
    other_rank = FaultInjector(parse_faults('[{"kind": "oom", "rank": 1}]'), torch.device("cpu"), rank=0)
    other_rank.before_forward(prefill=False)  # rank 1's fault never fires on rank 0


def test_an_injected_oom_is_a_recoverable_memory_failure_of_a_real_step() -> None:
    cfg = EngineConfig(
        model="builtin:tiny-llama",
        device="cpu",
        max_num_seqs=2,
        max_model_len=64,
        faults='[{"kind": "oom", "when": "decode"}]',
    )
    eng = Engine.load(cfg)
    try:
        first = eng.submit(
            StepPlan(prefills=(PrefillChunk(0, (1, 2, 3), 0, sample=True),), sampling={0: GREEDY})
        ).result()
        tok = first.outputs[0].token_id
        with pytest.raises(StepFailed) as failed:
            eng.submit(StepPlan(decodes=(DecodeToken(0, tok, 3),), sampling={0: GREEDY})).result()
        assert failed.value.memory and failed.value.slots == frozenset({0}) and eng.healthy
        plan = StepPlan(prefills=(PrefillChunk(1, (1, 2, 3), 0, sample=True),), sampling={1: GREEDY})
        again = eng.submit(plan).result()
        assert again.outputs[0].token_id == tok  # the engine serves on, the same tokens
    finally:
        eng.shutdown()


def test_a_device_hang_needs_cuda_and_says_so_on_the_cpu() -> None:
    (spin,) = parse_faults('[{"kind": "device_hang", "after_steps": 5}]')
    assert spin == FaultSpec("device_hang", 5, 1, "any", 3600.0, 0)
    with pytest.raises(ConfigError, match="device_hang .* needs a CUDA device.*kind hang"):
        FaultInjector((spin,), torch.device("cpu"))
    FaultInjector((spin,), torch.device("cpu"), rank=1)  # another rank's fault: not this engine's
