"""Tensor parallel on two GPUs (NCCL): TP=2 logits against TP=1 on a Qwen3-Next-shaped model in
bf16; the engine's TP=2 greedy tokens against TP=1 (float32); with decode graphs on every rank
(`tp_cuda_graphs`) the tokens of TP=2 eager and of TP=1, every rank replaying and each die leasing
its graphs; a worker killed mid-run fails the next step at once (the watchdog aborts the group)
and the engine reports itself unhealthy.

Run with NVLink SHARP off: NCCL_NVLS_ENABLE=0 pytest tests/gpu/test_tensor_parallel_cuda.py"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch
from ballast.bench.kv_capacity import qwen3_next_80b
from ballast.engine.config import EngineConfig
from ballast.engine.engine import Engine
from ballast.engine.parallel.sharded_runner import ShardedRunner
from ballast.engine.parallel.tp_graphs import GraphsReport
from ballast.memory.config import MemoryConfig
from ballast.memory.watch import MemWatch
from ballast.models.blocks.moe import grouped_mm_supported
from tp_harness import (
    assert_close_in_bf16,
    dequantized_logits,
    engine_greedy,
    reference_logits,
    sharded_logits,
    steps_for,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def qwen3_next_shaped() -> dict[str, Any]:
    """Qwen3-Next-80B-A3B's shapes (hidden 2048, 16 heads of 256 / 2 KV heads, DeltaNet 16/32 heads,
    top-10 experts of 512 intermediate, shared expert, vocab 151936), 8 layers and 16 experts."""
    full = qwen3_next_80b()
    return {
        **full,
        "num_hidden_layers": 8,
        "layer_types": full["layer_types"][:8],  # the 80B's 3:1 pattern, cut to 8 layers
        "num_experts": 16,
        "tie_word_embeddings": False,
        "seed": 0,
    }


def test_tp2_logits_match_tp1_in_bf16() -> None:
    hf = qwen3_next_shaped()
    steps = steps_for(hf["vocab_size"])
    want = reference_logits(hf, steps, torch.bfloat16, "cuda")
    exact = reference_logits(hf, steps, torch.float32, "cuda")
    [got] = sharded_logits([hf], steps, 2, torch.bfloat16, "cuda")
    assert_close_in_bf16(got, want, exact)


def greedy_tokens(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    return engine_greedy(engine, prompts, n)[0]


def engine(
    tp: int,
    watch: MemWatch | None = None,
    tp_graphs: bool = False,
    model: str = "builtin:tiny-qwen3-next",
    dtype: str = "float32",
) -> Engine:
    cfg = EngineConfig(
        model=model,
        device="cuda",
        dtype=dtype,
        max_model_len=512,
        max_num_seqs=4,
        tensor_parallel_size=tp,
        tp_cuda_graphs=tp_graphs,
        compile=False,  # a replay runs an eager step's very kernels (compiled ones run in graphs only)
    )
    return Engine.load(cfg, watch)


def test_the_engine_on_two_gpus_decodes_the_tokens_of_one() -> None:
    prompts = [[1, 400, 5000, 17, 23], [9, 8, 7], list(range(100, 300))]
    one = engine(1)
    try:
        want = greedy_tokens(one, prompts, 16)
    finally:
        one.shutdown()
    two = engine(2)
    try:
        assert greedy_tokens(two, prompts, 16) == want
        assert two.healthy
    finally:
        two.shutdown()


PROMPTS = [[1, 400, 5000, 17, 23], [9, 8, 7], list(range(100, 300))]
GRAPH_CASES = [
    ("builtin:tiny-llama", "float32"),  # float32: TP=2's tokens are TP=1's too
    ("builtin:tiny-qwen3-next", "bfloat16"),  # DeltaNet states and grouped-GEMM MoE in the graphs
]


@pytest.mark.parametrize(("model", "dtype"), GRAPH_CASES, ids=[f"{m[8:]}-{d}" for m, d in GRAPH_CASES])
def test_graphs_on_every_rank_decode_the_tokens_of_eager(model: str, dtype: str) -> None:
    """TP=2 with decode graphs: every rank captured the same graphs, every decode step was
    replayed on both ranks (rank 0's counter and the worker's), the greedy tokens are those of
    TP=2 eager (and, in float32, of TP=1 with graphs: in bf16 the all-reduce's other summation
    order may flip a near tie), and each die's ledger holds its graphs' lease until shutdown."""
    eager = engine(2, model=model, dtype=dtype)
    try:
        assert eager.runner.graph_runner.graphs is None  # tensor parallel without --tp-cuda-graphs
        want = greedy_tokens(eager, PROMPTS, 16)
    finally:
        eager.shutdown()
    if dtype == "float32":
        one = engine(1, model=model, dtype=dtype)
        try:
            assert one.runner.graph_runner.graphs is not None
            assert greedy_tokens(one, PROMPTS, 16) == want
        finally:
            one.shutdown()
    with MemWatch(MemoryConfig()) as watch:
        two = engine(2, watch, tp_graphs=True, model=model, dtype=dtype)
        try:
            runner = two.runner
            assert isinstance(runner, ShardedRunner)
            graphs = runner.graph_runner.graphs
            assert graphs is not None and graphs.captured == len(graphs.pairs) > 0
            [worker] = runner.worker_graphs()
            assert worker == GraphsReport(captured=graphs.captured, replays=0)
            assert greedy_tokens(two, PROMPTS, 16) == want
            [worker] = runner.worker_graphs()
            assert graphs.replays == worker.replays == 15  # every decode step, on both ranks
            for die in (0, 1):
                held = dict(watch.ledger.leases(die))
                assert held.get("cuda-graphs", 0) > 0, (die, held)
            assert two.healthy
        finally:
            two.shutdown()
        assert watch.ledger.held(0) == watch.ledger.held(1) == 0


def test_a_capture_failing_on_every_rank_leaves_every_rank_eager() -> None:
    """tiny-qwen3-next in float32: where grouped GEMM does not run in float32, the MoE fallback
    reads expert counts back to the host, which no capture can hold, so every rank fails its first
    bucket at the same op (collectives already recorded): all release their graphs, agree, and
    decode eagerly with the tokens of eager, no hang. Where it runs, the graphs are everywhere."""
    want = greedy_tokens_of(engine(2), PROMPTS)
    two = engine(2, tp_graphs=True)
    try:
        runner = two.runner
        assert isinstance(runner, ShardedRunner)
        [worker] = runner.worker_graphs()
        captured = 0 if runner.graph_runner.graphs is None else runner.graph_runner.graphs.captured
        assert worker.captured == captured
        if not grouped_mm_supported("cuda", torch.float32):
            assert captured == 0
        assert greedy_tokens(two, PROMPTS, 16) == want
        [worker] = runner.worker_graphs()
        graphs = runner.graph_runner.graphs
        assert worker.replays == (0 if graphs is None else graphs.replays)
        assert two.healthy
    finally:
        two.shutdown()


def greedy_tokens_of(e: Engine, prompts: list[list[int]]) -> list[list[int]]:
    try:
        return greedy_tokens(e, prompts, 16)
    finally:
        e.shutdown()


def test_a_killed_worker_fails_the_next_step_at_once() -> None:
    two = engine(2)
    try:
        greedy_tokens(two, [[1, 2, 3]], 2)
        [pid] = two.runner.workers.pids  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="ballast-tp1|tensor-parallel"):
            for _ in range(100):
                greedy_tokens(two, [[1, 2, 3]], 4)
        assert time.monotonic() - t0 < 30
        assert not two.healthy
    finally:
        two.shutdown()


def test_every_die_is_leased_on_its_own_ledger() -> None:
    """Rank 0 leases each worker's shard, slot states, activations and KV segments on the
    worker's GPU; admission watches the die whose ceiling binds first."""
    with MemWatch(MemoryConfig()) as watch:
        two = engine(2, watch)
        try:
            greedy_tokens(two, [list(range(1, 300))], 4)
            held = [watch.ledger.held(d) for d in (0, 1)]
            assert min(held) > 0 and abs(held[0] - held[1]) < 0.05 * max(held), held
            assert two.gpu_die in (0, 1) and two.dies == [0, 1]
            dies = {d.index: d for d in watch.poll_now().dies}
            assert dies[0].ledger_bytes > 0 and dies[1].ledger_bytes > 0
        finally:
            two.shutdown()
        assert watch.ledger.held(0) == watch.ledger.held(1) == 0


def test_tp2_with_expert_parallel_matches_tp1() -> None:
    """`--expert-parallel`: each GPU holds 8 of the 16 experts whole and runs only the pairs routed
    to them (grouped GEMM in bf16, the grouped FP8 kernel on a float8 checkpoint); the logits are
    TP=1's within bf16 tolerance, and the engine decodes TP=1's greedy tokens."""
    import tempfile
    from pathlib import Path

    from ballast.models.layers.fp8 import kernels_available
    from ballast.models.weights.hf_loader import load_hf_dir
    from tp_harness import run_steps, write_checkpoint

    hf = qwen3_next_shaped()
    steps = steps_for(hf["vocab_size"])
    with tempfile.TemporaryDirectory() as tmp:
        fp8 = write_checkpoint(hf, Path(tmp) / "fp8", True, (128, 128))
        models = [{**hf, "expert_parallel": True}]
        if kernels_available(torch.device("cuda", 0)):
            models.append({**fp8, "keep_fp8": True, "expert_parallel": True})
        got = sharded_logits(models, steps, 2, torch.bfloat16, "cuda")
        wants = [reference_logits(hf, steps, torch.bfloat16, "cuda")]
        exacts = [reference_logits(hf, steps, torch.float32, "cuda")]
        if len(models) == 2:
            one = load_hf_dir(fp8["checkpoint_dir"], torch.bfloat16, "cuda:0", keep_fp8=True)
            wants.append(run_steps(one, steps, torch.bfloat16, torch.device("cuda", 0)))
            del one
            exacts.append(dequantized_logits(fp8["checkpoint_dir"], steps))
    for g, w, e in zip(got, wants, exacts, strict=True):
        assert_close_in_bf16(g, w, e)
    prompts = [[1, 400, 5000, 17, 23], [9, 8, 7], list(range(100, 300))]
    base = EngineConfig(
        model="builtin:tiny-qwen3-next", device="cuda", dtype="float32", max_model_len=512, max_num_seqs=4
    )
    one_gpu = Engine.load(base)
    try:
        want = greedy_tokens(one_gpu, prompts, 16)
    finally:
        one_gpu.shutdown()
    two = Engine.load(EngineConfig(**{**base.__dict__, "tensor_parallel_size": 2, "expert_parallel": True}))
    try:
        assert greedy_tokens(two, prompts, 16) == want
        assert two.healthy
    finally:
        two.shutdown()
