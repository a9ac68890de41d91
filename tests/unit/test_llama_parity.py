"""Our Llama family against transformers' reference, on tiny random configs, CPU float32.

Bound met: max-abs logit difference < 1e-4 (observed ~1e-7) for prefill, batched decode, chunked
and mixed steps; the same weights are loaded into both through identical parameter names."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from ballast.models.arch.registry import build_model
from ballast.models.base import ForwardBatch
from ballast.models.layers.core import (
    ONEDNN_MAX_ROWS,
    RopeParams,
    RotaryEmbedding,
    linear,
    rope_inv_freq,
)
from ballast.models.layers.pointwise import apply_rope
from ballast.models.layers.state import LayerState, allocate_states
from torch import nn

TOL = 1e-4
VOCAB = 128
_BASE: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(_BASE, attention_bias=True)),
    "llama-tied-mha": ("LlamaConfig", dict(_BASE, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope": (
        "LlamaConfig",
        dict(
            _BASE,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "linear-rope": ("LlamaConfig", dict(_BASE, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2": ("Qwen2Config", dict(_BASE)),
    "qwen3": ("Qwen3Config", dict(_BASE, head_dim=32, tie_word_embeddings=True)),
    "mistral-no-window": ("MistralConfig", dict(_BASE, sliding_window=None)),
}


def make_pair(name: str, seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """(transformers model, ours) holding the same random weights."""
    cfg_cls, kwargs = CONFIGS[name]
    torch.manual_seed(seed)
    hf_cfg = getattr(transformers, cfg_cls)(**kwargs)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    ours = build_model(hf_cfg.to_dict())
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def new_states(
    model: nn.Module, num_slots: int = 4, max_len: int = 64, quantized: bool = False
) -> list[LayerState]:
    return allocate_states(
        model.layer_specs(4), num_slots, max_len, "cpu", torch.float32, quantized_kv=quantized
    )


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_last_logits(hf: nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0, -1]


@pytest.mark.parametrize("name", list(CONFIGS))
@torch.no_grad()
def test_prefill_logits_match_transformers(name: str) -> None:
    hf, ours = make_pair(name)
    assert set(hf.state_dict()) == set(ours.state_dict())
    ids = [prompt(23, 1), prompt(9, 2)]
    logits = ours(ForwardBatch.build([(3, ids[0], 0), (1, ids[1], 0)], "cpu"), new_states(ours))
    assert logits.shape == (2, VOCAB)
    for row, seq in zip(logits, ids, strict=True):
        assert (row - hf_last_logits(hf, seq)).abs().max().item() < TOL


def test_rope_inv_freq_matches_transformers() -> None:
    for name in ("llama3-rope", "linear-rope", "llama"):
        hf, ours = make_pair(name)
        params = RopeParams.from_hf(hf.config.to_dict())
        ref = hf.model.rotary_emb.inv_freq
        assert torch.allclose(rope_inv_freq(params, ours.config.head_dim), ref, rtol=1e-6, atol=0)
    # The llama3 variant really rescales some frequencies (so the parity above tests something).
    p = RopeParams.from_hf(CONFIGS["llama3-rope"][1])
    assert p.rope_type == "llama3"
    assert not torch.allclose(rope_inv_freq(p, 16), rope_inv_freq(RopeParams(theta=p.theta), 16))


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@torch.no_grad()
def test_batched_greedy_decode_matches_each_prompt_alone(name: str) -> None:
    hf, ours = make_pair(name)
    lengths, new_tokens = [3, 11, 6, 17], 8
    prompts = [prompt(n, 10 + i) for i, n in enumerate(lengths)]
    slots = [2, 0, 3, 1]
    states = new_states(ours)
    logits = ours(ForwardBatch.build([(s, p, 0) for s, p in zip(slots, prompts, strict=True)], "cpu"), states)
    ours_tokens: list[list[int]] = [[t] for t in logits.argmax(-1).tolist()]
    ours_logits = [[row] for row in logits]
    for step in range(new_tokens - 1):
        seqs = [
            (s, [toks[-1]], len(p) + step) for s, p, toks in zip(slots, prompts, ours_tokens, strict=True)
        ]
        logits = ours(ForwardBatch.build(seqs, "cpu"), states)
        for i, (row, tok) in enumerate(zip(logits, logits.argmax(-1).tolist(), strict=True)):
            ours_tokens[i].append(tok)
            ours_logits[i].append(row)
    for i, p in enumerate(prompts):
        ref = hf.generate(
            torch.tensor([p]),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        assert ref.sequences[0, len(p) :].tolist() == ours_tokens[i]
        diff = max((a - b[0]).abs().max().item() for a, b in zip(ours_logits[i], ref.logits, strict=True))
        assert diff < TOL


@torch.no_grad()
def test_chunked_prefill_equals_one_shot() -> None:
    hf, ours = make_pair("llama")
    ids = prompt(30, 5)
    one_shot = ours(ForwardBatch.build([(0, ids, 0)], "cpu"), new_states(ours))[0]
    states = new_states(ours)
    bounds = [0, 7, 8, 19, 30]  # chunks of 7, 1, 11, 11 tokens
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        chunk_logits = ours(ForwardBatch.build([(2, ids[lo:hi], lo)], "cpu"), states)[0]
        assert (chunk_logits - hf_last_logits(hf, ids[:hi])).abs().max().item() < TOL
    assert (chunk_logits - one_shot).abs().max().item() < TOL


@torch.no_grad()
def test_mixed_step_prefill_chunk_with_decodes() -> None:
    """One slot prefills a chunk while two others decode, in one forward."""
    hf, ours = make_pair("qwen2")
    states = new_states(ours)
    a, b, c = prompt(12, 20), prompt(5, 21), prompt(20, 22)
    first = ours(ForwardBatch.build([(0, a, 0), (1, b, 0), (2, c[:8], 0)], "cpu"), states)
    ta, tb = first[0].argmax().item(), first[1].argmax().item()
    mixed = ours(ForwardBatch.build([(0, [ta], len(a)), (2, c[8:], 8), (1, [tb], len(b))], "cpu"), states)
    assert (mixed[0] - hf_last_logits(hf, a + [ta])).abs().max().item() < TOL
    assert (mixed[1] - hf_last_logits(hf, c)).abs().max().item() < TOL
    assert (mixed[2] - hf_last_logits(hf, b + [tb])).abs().max().item() < TOL


@torch.no_grad()
def test_new_sequence_in_a_used_slot_ignores_stale_cache() -> None:
    hf, ours = make_pair("llama")
    states = new_states(ours)
    ours(ForwardBatch.build([(1, prompt(40, 30), 0)], "cpu"), states)
    short = prompt(6, 31)
    logits = ours(ForwardBatch.build([(1, short, 0)], "cpu"), states)[0]
    assert (logits - hf_last_logits(hf, short)).abs().max().item() < TOL


@torch.no_grad()
def test_int8_kv_stays_close_to_full_precision() -> None:
    _, ours = make_pair("llama")
    ids = [prompt(25, 40), prompt(10, 41)]
    seqs = [(0, ids[0], 0), (1, ids[1], 0)]
    full = ours(ForwardBatch.build(seqs, "cpu"), new_states(ours))
    q_states = new_states(ours, quantized=True)
    quant = ours(ForwardBatch.build(seqs, "cpu"), q_states)
    # Prefill attends to K/V that went through int8: per token-head absmax scaling keeps the
    # error near 1/254 of each row's range; loose bound relative to the logits' spread.
    assert (quant - full).abs().max().item() < 0.02 * full.std().item()
    assert not torch.equal(quant, full)  # the quantized path really ran
    step = ours(ForwardBatch.build([(0, [1], 25), (1, [2], 10)], "cpu"), q_states)
    ref = ours(ForwardBatch.build([(0, ids[0] + [1], 0), (1, ids[1] + [2], 0)], "cpu"), new_states(ours))
    assert (step - ref).abs().max().item() < 0.02 * ref.std().item()


@torch.no_grad()
def test_bf16_close_to_transformers_bf16() -> None:
    hf, ours = make_pair("llama")
    hf, ours = hf.to(torch.bfloat16), ours.to(torch.bfloat16)
    ids = prompt(20, 50)
    states = allocate_states(ours.layer_specs(2), 2, 32, "cpu", torch.bfloat16)
    logits = ours(ForwardBatch.build([(0, ids, 0)], "cpu"), states)[0]
    ref = hf_last_logits(hf, ids).float()
    assert logits.dtype == torch.float32
    assert (logits - ref).abs().max().item() < 0.05 * ref.abs().max().item()


@torch.no_grad()
def test_fused_projections_survive_loading_and_refuse_when_parameters_change() -> None:
    hf, ours = make_pair("qwen2")  # q/k/v biases fuse too
    attn = ours.model.layers[0].self_attn
    assert attn.qkv.fused
    assert attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()  # loading kept the views
    ids = prompt(15, 60)
    fused = ours(ForwardBatch.build([(0, ids, 0)], "cpu"), new_states(ours))[0]
    # An assign-load re-creates the parameters: the old fused weight must not be used.
    sd = {k: v.clone() * (1.5 if k.endswith("q_proj.weight") else 1.0) for k, v in hf.state_dict().items()}
    ours.load_state_dict(sd, assign=True)
    hf.load_state_dict(sd)
    assert not attn.qkv.fused
    refused = ours(ForwardBatch.build([(0, ids, 0)], "cpu"), new_states(ours))[0]
    assert attn.qkv.fused
    assert (refused - hf_last_logits(hf, ids)).abs().max().item() < TOL
    assert (refused - fused).abs().max().item() > TOL


@torch.no_grad()
def test_fixed_max_ctx_gives_the_same_logits() -> None:
    """The engine may pin max_ctx to the cache length so shapes stay fixed (CUDA graphs)."""
    _, ours = make_pair("llama")
    states = new_states(ours)
    a, b = prompt(9, 70), prompt(4, 71)
    ours(ForwardBatch.build([(0, a, 0), (1, b, 0)], "cpu"), states)
    seqs = [(0, [3], 9), (1, [4], 4)]
    tight = ours(ForwardBatch.build(seqs, "cpu"), states)
    padded = ours(ForwardBatch.build(seqs, "cpu", max_ctx=64), states)
    assert (tight - padded).abs().max().item() < TOL
    with pytest.raises(ValueError):
        ForwardBatch.build(seqs, "cpu", max_ctx=5)
    # One decode token alone needs no mask, unless max_ctx reaches past its position.
    alone = ours(ForwardBatch.build([(0, [5], 10)], "cpu"), states)
    alone_padded = ours(ForwardBatch.build([(0, [5], 10)], "cpu", max_ctx=64), states)
    assert (alone - alone_padded).abs().max().item() < TOL


def test_partial_rotary_turns_only_the_leading_dims() -> None:
    """Partial rotary (used by the hybrid models): the first rotary_dim dims rotate exactly as a
    full rope of that size would; the rest pass through."""
    x = torch.randn(5, 3, 16)
    positions = torch.tensor([0, 1, 7, 30, 2])
    cos, sin = RotaryEmbedding(RopeParams(theta=1e4, partial_rotary_factor=0.25), 16)(
        positions, torch.float32
    )
    assert cos.shape == (5, 4)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 4:], x[..., 4:])
    full_cos, full_sin = RotaryEmbedding(RopeParams(theta=1e4), 4)(positions, torch.float32)
    assert torch.allclose(full_cos, cos)  # rotary dim 4 of head 16 == a 4-dim head's rope
    assert torch.allclose(out[..., :4], apply_rope(x[..., :4].contiguous(), full_cos, full_sin))
    assert not torch.allclose(out[..., :4], x[..., :4])


@pytest.mark.parametrize("rows", [1, 8, ONEDNN_MAX_ROWS, ONEDNN_MAX_ROWS + 1, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear_whichever_gemm_runs(rows: int, bias: bool) -> None:
    """Decode-sized float32 inputs go through oneDNN, larger ones through torch's BLAS; both are
    float32 over the same weight, so they agree to float32 rounding (summation order only)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g)
    w = torch.randn(1536, 576, generator=g)
    b = torch.randn(1536, generator=g) if bias else None
    ref = torch.nn.functional.linear(x.double(), w.double(), b.double() if b is not None else None)
    with torch.inference_mode():
        out = linear(x, w, b)
    assert out.dtype == torch.float32 and out.shape == (rows, 1536)
    # |x.w| sums 576 products of N(0,1) values (~24 in size): float32 keeps ~1e-5 of that.
    assert (out.double() - ref).abs().max().item() < 1e-3
    assert (out - torch.nn.functional.linear(x, w, b)).abs().max().item() < 1e-3


def test_linear_keeps_autograd_when_gradients_are_on() -> None:
    w = torch.randn(16, 8, requires_grad=True)
    out = linear(torch.randn(2, 8), w)
    out.sum().backward()
    assert w.grad is not None and w.grad.shape == (16, 8)
