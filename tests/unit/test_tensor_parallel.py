"""Tensor parallel on the CPU (gloo): two ranks, each with its shard, give the logits of one
device, for a tiny model of every architecture, over prefills and decodes of several slots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.kv.kv_pool import KVPool
from ballast.engine.runner.loading import ModelSpecError
from ballast.models.arch.builtin import builtin_config
from ballast.models.arch.parallel import ShardPlan, apply_cut, shard_hf_config
from ballast.models.arch.registry import MODEL_CLASSES
from ballast.models.base import UnsupportedModel
from ballast.models.kv_store import KVStore, plan_layout
from tp_harness import engine_greedy, reference_logits, sharded_logits, steps_for, write_checkpoint

VOCAB = 1001  # odd: the vocabulary's last shard is padded


def _tiny(name: str, **over: Any) -> dict[str, Any]:
    return {**builtin_config(name), "vocab_size": VOCAB, **over}


MODELS = {
    "llama": _tiny("tiny-llama"),
    "qwen3 (q/k norms, untied head)": _tiny("tiny-qwen3", tie_word_embeddings=False),
    "llama, 1 KV head replicated on both ranks": _tiny("tiny-llama", num_key_value_heads=1, seed=3),
    "qwen3_next": _tiny("tiny-qwen3-next"),
    "qwen3_5_moe": _tiny("tiny-qwen3.5-moe"),
}


def test_every_registered_architecture_is_covered() -> None:
    types = {m["model_type"] for m in MODELS.values()}
    families = {MODEL_CLASSES[t] for t in types}
    assert families == set(MODEL_CLASSES.values())


def test_two_ranks_give_the_logits_of_one_device() -> None:
    steps = steps_for(VOCAB)
    sharded = sharded_logits(list(MODELS.values()), steps, 2, torch.float32, "cpu")
    for (name, hf), got in zip(MODELS.items(), sharded, strict=True):
        want = reference_logits(hf, steps, torch.float32, "cpu")
        assert len(got) == len(want) == len(steps)
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert g.shape == w.shape == (len(steps[i]), VOCAB), name
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"{name}, step {i}")


def test_ranks_read_their_slices_of_a_safetensors_checkpoint(tmp_path: Path) -> None:
    """From an HF directory each rank reads only its slices (per-expert tensors and fused ones),
    and the logits are still those of the whole model."""
    models = {
        "qwen3_next, one tensor per expert": write_checkpoint(MODELS["qwen3_next"], tmp_path / "next", True),
        "qwen3_5_moe, fused experts": write_checkpoint(MODELS["qwen3_5_moe"], tmp_path / "q35", False),
        "llama, tied head": write_checkpoint(MODELS["llama"], tmp_path / "llama", False),
    }
    steps = steps_for(VOCAB)[:3]
    sharded = sharded_logits(list(models.values()), steps, 2, torch.float32, "cpu")
    for (name, hf), got in zip(models.items(), sharded, strict=True):
        want = reference_logits(hf, steps, torch.float32, "cpu")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4, msg=f"{name}, step {i}")


def test_shards_tile_each_tensor_exactly() -> None:
    """The two ranks' cuts of every sharded tensor are disjoint and cover it (replicated ones are
    whole on both), so no weight is lost or counted twice."""
    hf = _tiny("tiny-qwen3-next")
    shape = (2 * 32, 64)  # in_proj_qkv-like rows of the conv: q, k, v segments
    full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
    conv = "model.layers.0.linear_attn.conv1d.weight"
    rows = []
    for rank in range(2):
        cut = ShardPlan(hf, rank, 2).cut(conv, (2 * 2 * 16 + 4 * 16, 1, 4))
        rows.append(cut.ranges)
    flat = sorted(r for ranges in rows for r in ranges)
    assert flat == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 96), (96, 128)]
    # rank 0 keeps the first half of q, of k and of v
    assert rows[0] == ((0, 16), (32, 48), (64, 96))
    part = apply_cut(
        ShardPlan(hf, 1, 2).cut("model.layers.0.self_attn.o_proj.weight", shape), lambda i: full[i], shape
    )
    assert torch.equal(part, full[:, 32:])


def test_a_size_that_does_not_divide_the_heads_is_refused() -> None:
    with pytest.raises(UnsupportedModel, match="num_attention_heads"):
        shard_hf_config(_tiny("tiny-llama"), 3)


def test_a_store_replaying_the_journal_ends_identical() -> None:
    """What a worker does with rank 0's KV changes: segments, tables and block copies (attach's
    copy of a partial block, compaction) replayed on a store of the same layout leave it equal to
    the original, so every rank reads its heads' KV through the same block tables."""
    layout = plan_layout(2, 2, 8, torch.float32, False, 4, 256, torch.device("cpu"), segment_bytes=4 * 4096)
    ours, theirs = KVStore(layout, "cpu"), KVStore(layout, "cpu")
    ours.journal = []
    pool = KVPool(ours)
    gen = torch.Generator().manual_seed(0)
    for slot, n in ((0, 100), (1, 40), (2, 200)):
        assert pool.ensure(slot, n)
    for op in ours.journal:
        theirs.replay(op)
    ours.journal.clear()
    # the same forward writes the same KV on every rank (here: the same random rows)
    for t_ours, t_theirs in zip(ours.host.tensors(), theirs.host.tensors(), strict=True):  # type: ignore[union-attr]
        fill = torch.randn(t_ours.shape, generator=gen)
        t_ours.copy_(fill)
        t_theirs.copy_(fill)
    held = pool.hold(0, 70)  # a prefix-cache hold, then a new slot starting on it (partial block copied)
    assert pool.attach(3, held, 70)
    pool.release(0)
    pool.release(2)
    pool.compact()
    pool.shrink()
    assert {op.kind for op in ours.journal} >= {"copy_block", "set_table", "clear_table", "release_segments"}
    for op in ours.journal:
        theirs.replay(op)
    assert theirs.live_segments == ours.live_segments
    assert torch.equal(theirs.block_table, ours.block_table)
    for slot in (1, 3):
        for block in pool.table(slot):
            for a, b in zip(ours.block_views(block), theirs.block_views(block), strict=True):
                assert torch.equal(a, b)


def test_the_engine_keeps_every_rank_on_the_same_blocks() -> None:
    """Through the engine: int8 KV in small segments (the pool grows segment by segment), then a
    release with shrink_kv (blocks compacted, segments given back) while the others decode on:
    two ranks decode the tokens one device decodes, so the workers followed every table change."""
    # 6, 8 and 5 blocks of 32: two segments of 16 blocks; releasing the middle one lets compaction
    # move the last prompt's blocks down (block copies the workers must make too)
    prompts = [list(range(3, 183)), list(range(1000, 1250)), list(range(500, 650))]

    def run(tp: int) -> tuple[list[list[int]], list[float]]:
        cfg = EngineConfig(
            model="builtin:tiny-qwen3-next",
            device="cpu",
            max_model_len=320,
            max_num_seqs=3,
            kv_quant="int8",
            kv_segment_bytes=1,  # one block per segment
            tensor_parallel_size=tp,
        )
        engine = Engine.load(cfg)
        try:
            out = engine_greedy(engine, prompts, 12, release_after=4)
            assert engine.healthy
            return out
        finally:
            engine.shutdown()

    (want, want_lp), (got, got_lp) = run(1), run(2)
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=1e-4)


def test_tensor_parallel_serves_with_the_tokenizer_it_is_given(tmp_path: Path) -> None:
    """`--tokenizer DIR` under tensor parallel (a built-in model on a host without network): the
    engine renders chats with that directory's template; a path that is no directory is refused
    before any worker starts."""
    from ballast.bench.checkpoint_dir import write_tokenizer

    write_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}"
    )
    cfg = EngineConfig(
        model="builtin:tiny-llama",
        device="cpu",
        max_model_len=64,
        max_num_seqs=1,
        tensor_parallel_size=2,
        tokenizer=str(tmp_path),
    )
    engine = Engine.load(cfg)
    try:
        assert engine.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "<<user: hi>>"
    finally:
        engine.shutdown()
    with pytest.raises(ModelSpecError, match="not a directory"):
        Engine.load(EngineConfig(**{**cfg.__dict__, "tokenizer": str(tmp_path / "absent")}))
