"""Qwen3-Next and Qwen3.5-MoE against transformers (CPU, float32, tiny random configs).

Bound: logits agree within 1e-4 absolute (observed ~2e-6 on these configs)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ballast.memory.specs import AttentionSpec, RecurrentStateSpec
from ballast.models.arch.registry import build_model
from ballast.models.base import ForwardBatch, ModelConfigError, UnsupportedModel
from ballast.models.layers.state import LayerState, PagedKV, RecurrentState, allocate_states
from test_state import read_kv
from torch import nn
from transformers import Qwen3NextConfig
from transformers import Qwen3NextForCausalLM as HFQwen3Next
from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM as HFQwen35Moe
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig, modeling_qwen3_5_moe
from transformers.models.qwen3_next import modeling_qwen3_next

ATOL = 1e-4
VOCAB = 96
KINDS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": len(KINDS),
    "layer_types": KINDS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}
ARCHS: dict[str, tuple[Any, Any, dict[str, Any]]] = {
    "qwen3_next": (
        Qwen3NextConfig,
        HFQwen3Next,
        {
            "intermediate_size": 80,
            "mlp_only_layers": [2],
            "norm_topk_prob": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        },
    ),
    "qwen3_5_moe_text": (
        Qwen3_5MoeTextConfig,
        HFQwen35Moe,
        {
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            }
        },
    ),
}


@pytest.fixture(scope="module", autouse=True)
def reference_in_pure_torch() -> Iterator[None]:
    """With fla (or causal-conv1d) installed, transformers routes these layers to CUDA-only
    kernels even for CPU tensors; the reference here is its own pure-torch fallback."""
    names = (
        "torch_chunk_gated_delta_rule",
        "torch_recurrent_gated_delta_rule",
        "causal_conv1d_fn",
        "causal_conv1d_update",
    )
    with pytest.MonkeyPatch.context() as mp:
        for module in (modeling_qwen3_next, modeling_qwen3_5_moe):
            for name in names:
                if hasattr(module, name):
                    mp.setattr(module, name, inspect.unwrap(getattr(module, name)))
        yield


def random_pair(arch: str) -> tuple[nn.Module, nn.Module]:
    """(ours, reference) with the same random weights."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    reference = model_cls(config_cls(**COMMON, **extra)).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue  # keep the reference's decay init
            p.copy_(torch.randn(p.shape, generator=gen) * (0.1 if p.dim() > 1 else 0.3))
    ours = build_model({"model_type": arch, **COMMON, **extra})
    ours.load_state_dict(reference.state_dict(), strict=True)
    return ours.eval(), reference


@pytest.fixture(scope="module", params=sorted(ARCHS))
def pair(request: pytest.FixtureRequest) -> tuple[nn.Module, nn.Module]:
    return random_pair(request.param)


def _states(model: nn.Module, num_slots: int = 6, max_len: int = 256) -> list[LayerState]:
    return allocate_states(model.layer_specs(4), num_slots, max_len, "cpu", torch.float32)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def test_prefill_logits_match(pair: tuple[nn.Module, nn.Module]) -> None:
    ours, reference = pair
    prompt = _prompt(150, seed=2)
    want = reference(torch.tensor([prompt])).logits[0, -1]
    got = ours(ForwardBatch.build([(3, prompt, 0)], "cpu"), _states(ours))[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_batched_greedy_decode_matches_each_prompt_alone(pair: tuple[nn.Module, nn.Module]) -> None:
    """Four slots at different lengths, prefilled in one step, then decoded together step by step,
    give each prompt's own greedy continuation from transformers' generate."""
    ours, reference = pair
    steps = 6
    prompts = [_prompt(n, seed=10 + n) for n in (3, 11, 40, 70)]
    slots = [4, 0, 2, 5]
    want_tokens, want_logits = [], []
    for p in prompts:
        out = reference.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.int64),
            max_new_tokens=steps,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        want_tokens.append(out.sequences[0, len(p) :].tolist())
        want_logits.append(torch.stack([lg[0] for lg in out.logits]))
    states = _states(ours)
    logits = ours(ForwardBatch.build([(s, p, 0) for s, p in zip(slots, prompts, strict=True)], "cpu"), states)
    got_tokens: list[list[int]] = [[] for _ in prompts]
    positions = [len(p) for p in prompts]
    for step in range(steps):
        for i in range(len(prompts)):
            torch.testing.assert_close(logits[i], want_logits[i][step], atol=ATOL, rtol=0)
            got_tokens[i].append(int(logits[i].argmax()))
        batch = ForwardBatch.build(
            [(s, [got_tokens[i][-1]], positions[i]) for i, s in enumerate(slots)], "cpu"
        )
        positions = [p + 1 for p in positions]
        logits = ours(batch, states)
    assert got_tokens == want_tokens


@torch.no_grad()
def test_chunked_prefill_equals_one_shot(pair: tuple[nn.Module, nn.Module]) -> None:
    """A prompt prefilled in three chunks (one of them batched with another slot's decode token)
    leaves the same state and logits as one-shot prefill."""
    ours, _ = pair
    prompt = _prompt(150, seed=3)
    one_states = _states(ours)
    one = ours(ForwardBatch.build([(1, prompt, 0)], "cpu"), one_states)[0]

    states = _states(ours)
    other = _prompt(9, seed=4)
    ours(ForwardBatch.build([(1, prompt[:64], 0), (2, other, 0)], "cpu"), states)
    ours(ForwardBatch.build([(2, [5], len(other)), (1, prompt[64:114], 64)], "cpu"), states)
    last = ours(ForwardBatch.build([(1, prompt[114:], 114)], "cpu"), states)[0]
    torch.testing.assert_close(last, one, atol=ATOL, rtol=0)
    for a, b in zip(states, one_states, strict=True):
        if isinstance(a, RecurrentState) and isinstance(b, RecurrentState):
            torch.testing.assert_close(a.recurrent[1], b.recurrent[1], atol=ATOL, rtol=0)
            torch.testing.assert_close(a.conv[1], b.conv[1], atol=ATOL, rtol=0)
        elif isinstance(a, PagedKV) and isinstance(b, PagedKV):
            probe = ForwardBatch.build([(1, [0] * 150, 0)], "cpu")
            torch.testing.assert_close(read_kv(a, probe)[0], read_kv(b, probe)[0], atol=ATOL, rtol=0)


@torch.no_grad()
def test_mixed_step_equals_each_sequence_alone(pair: tuple[nn.Module, nn.Module]) -> None:
    """One step of three decode tokens and two prefill chunks of different lengths (attended as two
    groups) gives every sequence the logits, and leaves the state, it gets when run alone."""
    ours, _ = pair
    histories = {
        0: _prompt(20, seed=20),
        1: _prompt(7, seed=21),
        3: _prompt(33, seed=22),
        4: _prompt(12, seed=23),
    }
    work = [
        (0, [7], 20),
        (2, _prompt(45, seed=24), 0),
        (1, [9], 7),
        (4, _prompt(6, seed=25), 12),
        (3, [2], 33),
    ]
    mixed, alone = _states(ours), _states(ours)
    for states in (mixed, alone):
        ours(ForwardBatch.build([(s, p, 0) for s, p in histories.items()], "cpu"), states)
    got = ours(ForwardBatch.build(work, "cpu"), mixed)
    for i, seq in enumerate(work):
        want = ours(ForwardBatch.build([seq], "cpu"), alone)[0]
        torch.testing.assert_close(got[i], want, atol=ATOL, rtol=0)
    follow = [(s, [3], start + len(toks)) for s, toks, start in work]
    torch.testing.assert_close(
        ours(ForwardBatch.build(follow, "cpu"), mixed),
        ours(ForwardBatch.build(follow, "cpu"), alone),
        atol=ATOL,
        rtol=0,
    )


@torch.no_grad()
def test_reused_slot_starts_clean_and_saved_state_moves_between_slots(
    pair: tuple[nn.Module, nn.Module],
) -> None:
    ours, _ = pair
    prompt, follow = _prompt(30, seed=5), _prompt(1, seed=6)
    fresh = _states(ours)
    want_prefill = ours(ForwardBatch.build([(0, prompt, 0)], "cpu"), fresh)[0]
    want_next = ours(ForwardBatch.build([(0, follow, 30)], "cpu"), fresh)[0]

    states = _states(ours)
    ours(ForwardBatch.build([(3, _prompt(20, seed=7), 0)], "cpu"), states)  # leaves slot 3 dirty
    got = ours(ForwardBatch.build([(3, prompt, 0)], "cpu"), states)[0]  # no reset: position 0 starts clean
    torch.testing.assert_close(got, want_prefill, atol=ATOL, rtol=0)

    # Slot 5 resumes slot 3's sequence: recurrent state copied, KV blocks shared by reference.
    for state in states:
        state.load(5, [t.clone() for t in state.slot_views(3)])
    store = next(s.store for s in states if isinstance(s, PagedKV))
    store.block_table[5] = store.block_table[3]
    got_next = ours(ForwardBatch.build([(5, follow, 30)], "cpu"), states)[0]
    torch.testing.assert_close(got_next, want_next, atol=ATOL, rtol=0)


def test_layer_specs_follow_layer_types_and_size_the_states(pair: tuple[nn.Module, nn.Module]) -> None:
    ours, _ = pair
    specs = ours.layer_specs(4)
    kinds = ["linear_attention" if isinstance(s, RecurrentStateSpec) else "full_attention" for s in specs]
    assert kinds == KINDS
    states = _states(ours, num_slots=3, max_len=64)
    for spec, state in zip(specs, states, strict=True):
        if isinstance(spec, RecurrentStateSpec):
            assert isinstance(state, RecurrentState)
            assert state.recurrent.dtype == torch.float32
            assert state.nbytes == 3 * spec.bytes_per_slot
        else:
            assert isinstance(spec, AttentionSpec) and isinstance(state, PagedKV)
            assert state.layout.block_layer_bytes == state.layout.block_size * spec.bytes_per_token


@torch.no_grad()
def test_bf16_model_keeps_float32_recurrent_state() -> None:
    ours = build_model(
        {"model_type": "qwen3_5_moe_text", **COMMON, **ARCHS["qwen3_5_moe_text"][2]}, dtype=torch.bfloat16
    )
    ref32, _ = random_pair("qwen3_5_moe_text")
    ours.load_state_dict(ref32.state_dict())
    specs = ours.layer_specs(2)
    states = allocate_states(specs, 2, 64, "cpu", torch.bfloat16)
    prompt = _prompt(40, seed=8)
    logits = ours(ForwardBatch.build([(0, prompt, 0)], "cpu"), states)[0]
    want = ref32(ForwardBatch.build([(0, prompt, 0)], "cpu"), _states(ref32))[0]
    rec = [s for s in states if isinstance(s, RecurrentState)]
    assert rec and all(s.recurrent.dtype == torch.float32 and s.conv.dtype == torch.bfloat16 for s in rec)
    assert torch.isfinite(logits).all()
    assert torch.nn.functional.cosine_similarity(logits, want, dim=0) > 0.99


def test_config_parsing() -> None:
    text = {"model_type": "qwen3_5_moe_text", **COMMON, **ARCHS["qwen3_5_moe_text"][2]}
    nested = build_model({"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False})
    assert nested.config.layer_types == tuple(KINDS) and nested.config.rope.partial_rotary_factor == 0.25
    interval = {k: v for k, v in text.items() if k != "layer_types"}
    derived = build_model({**interval, "full_attention_interval": 2})
    assert derived.config.layer_types == tuple(KINDS)
    with pytest.raises(UnsupportedModel):
        build_model({**text, "hidden_act": "gelu"})
    with pytest.raises(ModelConfigError):
        build_model({**text, "layer_types": KINDS[:3]})
    with pytest.raises(ModelConfigError):
        build_model({**text, "linear_num_value_heads": 3})
