"""Qwen3-Next's multi-token-prediction layer (models/arch/mtp.py) and drafting from it
(engine/spec/mtp.py), CPU, float32, on tiny-qwen3-next.

transformers (5.x) does not implement the MTP layer: it loads the decoder and drops `mtp.*`. The
reference here is a float32 transcription of the published formula, written apart from our
modules: at position i, fc([norm_e(embed(x[i+1])), norm_h(h[i])]) -> one full-attention decoder
layer (gated attention, partial rotary, the MoE with its sigmoid-gated shared expert) -> norm;
the target's lm_head gives the token at i + 2; further drafts feed the layer's own output as h.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.graphs.decode import DecodeGraphs, GraphCaptureError, GraphSet, Leftover
from ballast.engine.graphs.verify import VerifyGraphs
from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan
from ballast.engine.runner.loading import ModelSpecError
from ballast.engine.workspace import VerifySize
from ballast.models.arch.builtin import build_builtin, builtin_config
from ballast.models.arch.qwen3_next import Qwen3NextForCausalLM
from ballast.models.base import ForwardBatch, StepBatch
from ballast.models.layers.state import allocate_states
from ballast.models.weights.hf_loader import inspect_hf_dir, load_hf_model
from ballast.scheduler.config import SchedulerConfig
from ballast.scheduler.request import GenerationRequest
from ballast.scheduler.scheduler import Scheduler
from engine_steps import prefilled_runner
from safetensors.torch import save_file
from torch import Tensor

from ballast.settings import ConfigError

MODEL = "builtin:tiny-qwen3-next"
CPU = torch.device("cpu")
K = 3
MTP = json.dumps({"method": "mtp", "num_speculative_tokens": K})
GREEDY = SamplingParams(temperature=0.0)


def _rms(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """Qwen3-Next's RMSNorm: the weight is stored around 0 and scales by (1 + w)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def _rope(x: Tensor, positions: Tensor, rotary: int, theta: float) -> Tensor:
    """Partial rotary (HF's rotate-half) on the first `rotary` channels of each head."""
    inv = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = positions.double()[:, None] * inv[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()
    r, rest = x[..., :rotary], x[..., rotary:]
    half = rotary // 2
    rotated = torch.cat([-r[..., half:], r[..., :half]], -1)
    return torch.cat([r * cos[:, None] + rotated * sin[:, None], rest], -1)


def reference_mtp(model: Qwen3NextForCausalLM, next_tokens: list[int], hidden: Tensor) -> Tensor:
    """The MTP layer's normed output at positions 0 .. T-1 of one sequence (causal over them)."""
    c, p = model.config, {n: t.detach().float() for n, t in model.mtp.named_parameters()}  # type: ignore[union-attr]
    eps, t, d = c.rms_norm_eps, len(next_tokens), c.head_dim
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    e = model.model.embed_tokens.weight.detach().float()[torch.tensor(next_tokens)]
    x = torch.cat(
        [_rms(e, p["pre_fc_norm_embedding.weight"], eps), _rms(hidden, p["pre_fc_norm_hidden.weight"], eps)],
        -1,
    )
    x = x @ p["fc.weight"].T
    a = "layers.0.self_attn."
    y = _rms(x, p["layers.0.input_layernorm.weight"], eps)
    qg = (y @ p[a + "q_proj.weight"].T).view(t, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:]
    k = (y @ p[a + "k_proj.weight"].T).view(t, kv_heads, d)
    v = (y @ p[a + "v_proj.weight"].T).view(t, kv_heads, d)
    pos = torch.arange(t)
    rotary = int(d * c.rope.partial_rotary_factor)
    q = _rope(_rms(q, p[a + "q_norm.weight"], eps), pos, rotary, c.rope.theta)
    k = _rope(_rms(k, p[a + "k_norm.weight"], eps), pos, rotary, c.rope.theta)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v) * torch.sigmoid(gate)
    x = x + out.reshape(t, heads * d) @ p[a + "o_proj.weight"].T
    y = _rms(x, p["layers.0.post_attention_layernorm.weight"], eps)
    m = "layers.0.mlp."
    probs = (y @ p[m + "gate.weight"].T).softmax(-1)
    weights, chosen = probs.topk(c.num_experts_per_tok, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)  # norm_topk_prob
    moe = torch.zeros_like(y)
    for row in range(t):
        for w, ex in zip(weights[row], chosen[row], strict=True):
            gate_proj, up = (p[m + "experts.gate_up_proj"][ex] @ y[row]).chunk(2)
            moe[row] += w * (p[m + "experts.down_proj"][ex] @ (F.silu(gate_proj) * up))
    s = m + "shared_expert."
    shared = (F.silu(y @ p[s + "gate_proj.weight"].T) * (y @ p[s + "up_proj.weight"].T)) @ p[
        s + "down_proj.weight"
    ].T
    x = x + moe + torch.sigmoid(y @ p[m + "shared_expert_gate.weight"].T) * shared
    return _rms(x, p["norm.weight"], eps)


@pytest.fixture(scope="module")
def model() -> Qwen3NextForCausalLM:
    """tiny-qwen3-next with its MTP layer, the centred norms moved off 0 so they count."""
    m = build_builtin(MODEL, mtp=True)
    assert isinstance(m, Qwen3NextForCausalLM) and m.mtp is not None
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in m.mtp.named_parameters():
            if name.endswith("norm.weight") or "norm_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return m


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 3000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def test_the_mtp_layer_matches_the_published_formula_whole_and_in_chunks(model: Qwen3NextForCausalLM) -> None:
    tokens, hidden = _ids(12, 1), torch.randn(12, 64, generator=torch.Generator().manual_seed(2))
    want = reference_mtp(model, tokens, hidden)
    states = allocate_states(model.layer_specs(4), 3, 64, "cpu", torch.float32)
    whole = model.mtp_forward(ForwardBatch.build([(2, tokens, 0)], "cpu"), hidden, states)
    torch.testing.assert_close(whole, want, atol=2e-5, rtol=0)
    # the same positions in two passes of another slot: the second attends to the first's KV
    first = model.mtp_forward(ForwardBatch.build([(0, tokens[:7], 0)], "cpu"), hidden[:7], states)
    second = model.mtp_forward(ForwardBatch.build([(0, tokens[7:], 7)], "cpu"), hidden[7:], states)
    torch.testing.assert_close(torch.cat([first, second]), want, atol=2e-5, rtol=0)
    # its KV is a layer of the slot's blocks, after the decoder's: the pool counts it
    specs = model.layer_specs(4)
    assert len(specs) == model.config.num_hidden_layers + 1 and specs[-1] == specs[3]


@torch.inference_mode()
def _greedy_drafts(model: Qwen3NextForCausalLM, sequence: list[int], k: int) -> list[int]:
    """Reference drafts after `sequence` (its last token just emitted): the target's hidden states
    over all but the last token (one forward, fresh states), the MTP layer by the formula, its
    greedy token, then k - 1 more, each fed back with the layer's own output."""
    states = allocate_states(model.layer_specs(4), 1, 128, "cpu", torch.float32)
    model(ForwardBatch.build([(0, sequence[:-1], 0)], "cpu"), states)
    assert model.last_hidden is not None
    hidden, nexts, drafts = model.last_hidden.float(), list(sequence[1:]), []
    for _ in range(k):
        out = reference_mtp(model, nexts, hidden)
        drafts.append(int(model.lm_head(out[-1]).argmax()))
        nexts, hidden = [*nexts, drafts[-1]], torch.cat([hidden, out[-1:]])
    return drafts


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    eng = Engine.load(
        EngineConfig(model=MODEL, device="cpu", max_num_seqs=4, max_model_len=128, prefill_chunk_tokens=16),
        mtp_drafts=K,
        verify=VerifySize(4, K),
    )
    yield eng
    eng.shutdown()


def test_the_engines_drafts_are_the_formulas_after_chunked_prefill_decodes_and_verify(engine: Engine) -> None:
    """A 21-token prompt in chunks of 9 and 12 (the MTP pass of the first waits for the second's
    first token), decodes, and a verify step: each step's proposal is the reference's drafts."""
    model = engine.runner.model
    assert isinstance(model, Qwen3NextForCausalLM)
    prompt, slot = _ids(21, 5), 2

    def step(plan: StepPlan) -> tuple[list[int], tuple[int, ...]]:
        res = engine.submit(plan).result(timeout=60)
        (proposal,) = [(pos, d) for s, pos, d in res.proposals if s == slot] or [(-1, ())]
        return [o.token_id for o in res.outputs if o.slot == slot], proposal[1] if proposal[0] >= 0 else ()

    out, none = step(StepPlan(prefills=(PrefillChunk(slot, tuple(prompt[:9]), 0, False),), release=(slot,)))
    assert out == [] and none == ()
    out, drafts = step(
        StepPlan(prefills=(PrefillChunk(slot, tuple(prompt[9:]), 9, True),), sampling={slot: GREEDY})
    )
    seq = prompt + out
    assert list(drafts) == _greedy_drafts(model, seq, K)
    for _ in range(2):
        out, drafts = step(
            StepPlan(decodes=(DecodeToken(slot, seq[-1], len(seq) - 1),), sampling={slot: GREEDY})
        )
        seq += out
        assert list(drafts) == _greedy_drafts(model, seq, K)
    # verify steps: the MTP drafts themselves (random weights: mostly rejected), then the target's
    # own next two tokens and a wrong one, so two are kept and the pass covers three positions
    out, drafts = step(
        StepPlan(decodes=(DecodeToken(slot, seq[-1], len(seq) - 1, drafts),), sampling={slot: GREEDY})
    )
    seq += out
    assert list(drafts) == _greedy_drafts(model, seq, K)
    own = _target_greedy(model, seq, 2)
    wrong = (own[-1] + 1,)
    out, drafts = step(
        StepPlan(decodes=(DecodeToken(slot, seq[-1], len(seq) - 1, (*own, *wrong)),), sampling={slot: GREEDY})
    )
    assert out[:2] == own and len(out) == 3
    seq += out
    assert list(drafts) == _greedy_drafts(model, seq, K)


def test_a_step_of_more_streams_than_draft_writes_the_mtp_kv_and_proposes_nothing() -> None:
    """Drafting stops from max_streams decoding streams on (the engine's verify rows: here 1), so a
    step of two emitting slots runs only the MTP pass that writes the layer's KV: no heads, no
    drafts. Once one stream is left its drafts are the formula's over its whole sequence, which
    they are only if the steps that proposed nothing still wrote the layer's KV."""
    eng = Engine.load(
        EngineConfig(model=MODEL, device="cpu", max_num_seqs=4, max_model_len=128, prefill_chunk_tokens=16),
        mtp_drafts=K,
        verify=VerifySize(1, K),
    )
    try:
        model = eng.runner.model
        assert isinstance(model, Qwen3NextForCausalLM) and model.mtp is not None
        with torch.no_grad():  # attention that counts: the drafts follow the KV of every position
            for name, w in model.mtp.named_parameters():
                if "self_attn" in name and name.endswith("proj.weight"):
                    w.mul_(30.0)
        seqs = {0: _ids(10, 7), 1: _ids(12, 8)}
        both = {slot: GREEDY for slot in seqs}
        res = eng.submit(
            StepPlan(
                prefills=tuple(PrefillChunk(s, tuple(ids), 0, True) for s, ids in seqs.items()), sampling=both
            )
        ).result(timeout=60)
        for _ in range(3):
            assert res.proposals == () and {o.slot for o in res.outputs} == {0, 1}
            for o in res.outputs:
                seqs[o.slot].append(o.token_id)
            decodes = tuple(DecodeToken(s, ids[-1], len(ids) - 1) for s, ids in seqs.items())
            res = eng.submit(StepPlan(decodes=decodes, sampling=both)).result(timeout=60)
        for o in res.outputs:
            seqs[o.slot].append(o.token_id)
        seq = seqs[0]
        res = eng.submit(
            StepPlan(decodes=(DecodeToken(0, seq[-1], len(seq) - 1),), sampling={0: GREEDY})
        ).result(timeout=60)
        seq += [o.token_id for o in res.outputs]
        ((slot, pos, drafts),) = res.proposals
        assert (slot, pos) == (0, len(seq) - 1) and list(drafts) == _greedy_drafts(model, seq, K)
    finally:
        eng.shutdown()


@torch.inference_mode()
def _target_greedy(model: Qwen3NextForCausalLM, sequence: list[int], n: int) -> list[int]:
    """The target's next n greedy tokens after `sequence` (fresh states, no drafts)."""
    states = allocate_states(model.layer_specs(4), 1, 128, "cpu", torch.float32)
    logits = model(ForwardBatch.build([(0, sequence, 0)], "cpu"), states)
    out = [int(logits[-1].argmax())]
    while len(out) < n:
        pos = len(sequence) + len(out) - 1
        out.append(int(model(ForwardBatch.build([(0, [out[-1]], pos)], "cpu"), states)[-1].argmax()))
    return out


def _serve(engine: Engine, spec: str | None, reqs: list[GenerationRequest]) -> tuple[list[list[int]], object]:
    async def go() -> tuple[list[list[int]], object]:
        s = Scheduler(engine, SchedulerConfig(max_num_seqs=4, speculative_config=spec, stale_snapshot_s=0.0))
        # Random MTP weights draft nothing the target keeps, which the governor learns from the
        # first check: a governor that has seen drafts kept tries them on each new sequence.
        s._planner.drafts.acceptance = [1.0] * K
        await s.start()
        try:
            outs = await asyncio.gather(*(_ids_of(s, r) for r in reqs))
        finally:
            await s.stop()
        return list(outs), s._planner.drafts.stats

    return asyncio.run(go())


async def _ids_of(s: Scheduler, req: GenerationRequest) -> list[int]:
    from ballast.scheduler.request import TokenEvent

    return [t async for e in s.submit(req) if isinstance(e, TokenEvent) for t in e.token_ids]


def test_greedy_output_with_mtp_drafts_equals_without(engine: Engine) -> None:
    reqs = [GenerationRequest(f"r{i}", tuple(_ids(20 + 7 * i, i)), GREEDY, max_tokens=24) for i in range(3)]
    off, _ = _serve(engine, None, reqs)
    on, stats = _serve(engine, MTP, reqs)
    assert on == off and all(len(o) == 24 for o in on)
    assert stats.steps_drafting > 0 and stats.drafted > 0  # type: ignore[attr-defined]
    # random weights: no draft is kept, and a sequence whose drafts were checked drafts no more
    assert stats.accepted == 0 and stats.drafted <= 3 * K  # type: ignore[attr-defined]


def test_mtp_on_a_model_without_an_mtp_layer_is_a_clear_error() -> None:
    cfg = EngineConfig(model="builtin:tiny-llama", device="cpu", max_num_seqs=2, max_model_len=64)
    with pytest.raises(ModelSpecError, match="multi-token-prediction layer"):
        Engine.load(cfg, mtp_drafts=K)
    plain = Engine.load(cfg)
    try:
        with pytest.raises(ConfigError, match="without one"):
            Scheduler(plain, SchedulerConfig(max_num_seqs=2, speculative_config=MTP))
    finally:
        plain.shutdown()


def test_a_checkpoints_mtp_tensors_load_only_for_drafting(
    tmp_path: Path, model: Qwen3NextForCausalLM
) -> None:
    config = {**builtin_config(MODEL, mtp=True)}
    config.pop("seed")
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    with_mtp = load_hf_model(inspect_hf_dir(tmp_path, mtp=True))
    for name, p in model.state_dict().items():
        assert torch.equal(with_mtp.state_dict()[name], p), name
    plain = inspect_hf_dir(tmp_path)
    assert not any(k.startswith("mtp.") for k in plain.tensors)
    assert load_hf_model(plain).mtp is None


def _captured_on_cpu(
    graphs: GraphSet[Any], key: Any, run: Callable[[StepBatch], Tensor], batch: StepBatch
) -> None:
    """What a capture does, less CUDA: the forward over the static batch leaves its logits and
    hidden states (in a graph's pool, rewritten by each replay), the set keeps them. The graph
    stands for a replay of these same inputs, which would write the same values there again."""
    assert graphs.leftover is not None
    graphs.leftover.take()
    graphs._logits = run(batch)
    graphs._graphs[key] = SimpleNamespace(replay=lambda: None)  # type: ignore[assignment]
    graphs._keep(key)


@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_a_replay_hands_back_the_eager_steps_hidden_states_row_for_row(
    model: Qwen3NextForCausalLM, kind: str
) -> None:
    """Three sequences in a graph of 4 (a padding row in the scratch slot): as decode tokens, or as
    verify rows of K drafts. What the replay hands back as `last_hidden` (what the MTP drafter
    reads) is the plain eager step's, every token's row in the step's order, and the logits too."""
    slots, ctx, size = 3, 64, VerifySize(4, K)
    prompts = {0: _ids(9, 11), 1: _ids(12, 15), 2: _ids(7, 12)}
    length = 1 if kind == "decode" else K + 1
    rows = [(s, _ids(length, 13 + s), len(prompts[s])) for s in (2, 0, 1)]

    padded, plain = (prefilled_runner(model, prompts, slots, ctx, size) for _ in range(2))
    leftover = padded.graph_runner._leftover
    assert leftover is not None and Leftover.of(torch.nn.Linear(1, 1)) is None

    def step() -> StepBatch:
        batch = StepBatch.of(rows, all_logits=(True,) * 3 if kind == "verify" else ())
        batch.verify = (True,) * 3 if kind == "verify" else ()
        return batch

    if kind == "decode":
        decode = DecodeGraphs(CPU, slots, 4, ctx, leftover=leftover)
        key = (4, ctx, False)
        decode._stage(step(), 4)
        _captured_on_cpu(decode, key, padded._run, decode._static_batch(4, ctx))
        got = decode.launch(decode.stage(step()), 3)
    else:
        verify = VerifyGraphs(CPU, slots, size.rows, size.drafts, ctx, True, leftover)
        verify._stage(step(), length)
        _captured_on_cpu(verify, (4, length), padded._run, verify._static_batch(4, length))
        got = verify.replay(step())
    hidden = model.last_hidden
    want = plain._run(step())
    assert hidden is not None and model.last_hidden is not None and hidden is not model.last_hidden
    assert hidden.shape == model.last_hidden.shape == (3 * length, model.config.hidden_size)
    torch.testing.assert_close(hidden, model.last_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.last_hidden = None  # a forward that leaves none: nothing for a capture to keep
    with pytest.raises(GraphCaptureError, match="hidden states"):
        (decode if kind == "decode" else verify)._keep(key if kind == "decode" else (4, length))
