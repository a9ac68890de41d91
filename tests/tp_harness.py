"""Tensor-parallel logits vs one device, for the CPU tests (gloo) and the GPU test (NCCL).

`reference_logits` runs the whole model; `sharded_logits` runs rank 0 here and ranks 1..N-1 in
spawned processes, every rank its own shard (cut from the same random weights) and its own slot
states, over the same steps. Both return the logits of every step.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ballast.engine.parallel.tp_worker import init_group
from ballast.models.arch.builtin import init_random
from ballast.models.arch.parallel import ShardPlan, build_shard
from ballast.models.arch.registry import build_model
from ballast.models.base import ForwardBatch
from ballast.models.layers.fp8 import quantize_blocks
from ballast.models.layers.state import allocate_states, dtype_bytes
from ballast.models.weights.hf_loader import inspect_hf_dir
from ballast.models.weights.shard_loading import load_full_into_shard, load_hf_shard
from safetensors.torch import save_file
from torch import Tensor, nn

Step = list[tuple[int, list[int], int]]


def steps_for(vocab: int, seed: int = 0) -> list[Step]:
    """Prefill three slots of different lengths (one split in two chunks), then decode them at
    their different positions, with a prefill joining between decodes."""
    gen = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=gen).tolist()

    steps: list[Step] = [[(0, toks(7), 0), (1, toks(70), 0)], [(2, toks(3), 0), (1, toks(5), 70)]]
    pos = {0: 7, 1: 75, 2: 3}
    for i in range(4):
        step: Step = [(s, toks(1), pos[s]) for s in (0, 1, 2)]
        if i == 1:
            step.append((3, toks(9), 0))
            pos[3] = 9
        elif i > 1:
            step.append((3, toks(1), pos[3]))
            pos[3] += 1
        for s in (0, 1, 2):
            pos[s] += 1
        steps.append(step)
    return steps


def write_checkpoint(
    hf: dict[str, Any], path: Path, per_expert: bool, fp8_block: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The full random model of hf as an HF directory (config.json + safetensors); per_expert
    stores each expert's projections separately, as many published checkpoints do; fp8_block:
    an FP8 checkpoint (every decoder projection float8 with block scales, as the releases are).
    Returns hf with `checkpoint_dir` set, for `sharded_logits`."""
    state = {k: v.contiguous() for k, v in full_model(hf, torch.float32, "cpu").state_dict().items()}
    if hf.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    if per_expert:
        for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
            prefix = name.removesuffix("gate_up_proj")
            gate_up, down = state.pop(name), state.pop(prefix + "down_proj")
            half = gate_up.shape[1] // 2
            for e in range(gate_up.shape[0]):
                state[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :half].contiguous()
                state[f"{prefix}{e}.up_proj.weight"] = gate_up[e, half:].contiguous()
                state[f"{prefix}{e}.down_proj.weight"] = down[e].contiguous()
    if fp8_block is not None:
        hf = {**hf, "quantization_config": {"quant_method": "fp8", "weight_block_size": list(fp8_block)}}
        for name in [n for n in state if ".layers." in n and n.endswith("proj.weight")]:
            state[name], state[name + "_scale_inv"] = quantize_blocks(state[name], fp8_block)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    save_file({n: state[n] for n in names[: len(names) // 2]}, str(path / "model-00001.safetensors"))
    save_file({n: state[n] for n in names[len(names) // 2 :]}, str(path / "model-00002.safetensors"))
    (path / "config.json").write_text(json.dumps(hf))
    return {**hf, "checkpoint_dir": str(path)}


def full_model(hf: dict[str, Any], dtype: torch.dtype, device: str) -> nn.Module:
    model = build_model(hf, dtype=torch.float32, device="cpu")
    init_random(model, int(hf.get("seed", 0)))
    return model.to(device=device, dtype=dtype)


def run_steps(
    model: nn.Module, steps: Sequence[Step], dtype: torch.dtype, device: torch.device
) -> list[Tensor]:
    specs = model.layer_specs(dtype_bytes(dtype))  # type: ignore[operator]
    states = allocate_states(specs, 4, 256, device, dtype)
    out = []
    with torch.inference_mode():
        for step in steps:
            out.append(model(ForwardBatch.build(step, device), states).float().cpu())
    return out


def reference_logits(
    hf: dict[str, Any], steps: Sequence[Step], dtype: torch.dtype, device: str
) -> list[Tensor]:
    return run_steps(full_model(hf, dtype, device), steps, dtype, torch.device(device))


def dequantized_logits(checkpoint_dir: str, steps: Sequence[Step], device: str = "cuda:0") -> list[Tensor]:
    """The float32 logits of an FP8 checkpoint dequantized at load (the truth its bf16 runs round)."""
    from ballast.models.weights.hf_loader import load_hf_dir

    model = load_hf_dir(checkpoint_dir, torch.float32, device)
    try:
        return run_steps(model, steps, torch.float32, torch.device(device))
    finally:
        del model


def _rank(
    rank: int,
    world: int,
    address: str,
    models: Sequence[dict[str, Any]],
    steps: Sequence[Step],
    dtype: torch.dtype,
    device: str,
) -> list[list[Tensor]]:
    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    tp = init_group(rank, world, address, dev)
    out = []
    try:
        for hf in models:  # one process group for all of them: spawning is the slow part
            ep = bool(hf.get("expert_parallel"))  # whole experts per rank
            plan = ShardPlan(hf, rank, world, expert_parallel=ep)
            if "checkpoint_dir" in hf:  # read this rank's slices of the safetensors files
                ckpt = inspect_hf_dir(hf["checkpoint_dir"])
                keep = (ckpt.fp8_params().__contains__, ckpt.fp8_block) if hf.get("keep_fp8") else None
                shard = build_shard(hf, tp, dtype, dev, keep, expert_parallel=ep)
                load_hf_shard(shard, ckpt, plan)
            else:
                shard = build_shard(hf, tp, dtype, dev, expert_parallel=ep)
                full = build_model(hf, dtype=torch.float32, device="cpu")
                init_random(full, int(hf.get("seed", 0)))
                load_full_into_shard(shard, full.state_dict(), plan)
                del full
            out.append(run_steps(shard, steps, dtype, dev))
            del shard
        return out
    finally:
        dist.destroy_process_group()


def _worker(*args: Any) -> None:
    _rank(*args)


def sharded_logits(
    models: Sequence[dict[str, Any]], steps: Sequence[Step], world: int, dtype: torch.dtype, device: str
) -> list[list[Tensor]]:
    """Per model (HF config dicts with a `seed`), the logits of every step, from world ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, world, address, models, steps, dtype, device))
        for r in range(1, world)
    ]
    for p in procs:
        p.start()
    try:
        return _rank(0, world, address, models, steps, dtype, device)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.terminate()


def engine_greedy(
    engine: Any, prompts: Sequence[Sequence[int]], n: int, release_after: int = 0
) -> tuple[list[list[int]], list[float]]:
    """Greedy tokens of every prompt through engine StepPlans: one prefill step, then decodes of
    all of them together. release_after > 0: after that many decodes the second prompt's slot is
    released with `shrink_kv` (the pool compacts and gives segments back), the others go on.
    Returns the tokens per prompt and the logprob of every token sampled, in order."""
    from ballast.engine.plan import DecodeToken, PrefillChunk, SamplingParams, StepPlan

    greedy = SamplingParams(temperature=0.0, logprobs=0)
    live = list(range(len(prompts)))
    sampling = {s: greedy for s in live}
    prefills = tuple(PrefillChunk(s, tuple(p), 0, True) for s, p in enumerate(prompts))
    result = engine.submit(StepPlan(prefills=prefills, sampling=sampling)).result()
    out = {o.slot: [o.token_id] for o in result.outputs}
    logprobs = [float(o.logprob or 0.0) for o in result.outputs]
    for step in range(n - 1):
        release: tuple[int, ...] = ()
        if release_after and step == release_after and len(live) > 1:
            release, live = (live[1],), [s for s in live if s != live[1]]
        decodes = tuple(DecodeToken(s, out[s][-1], len(prompts[s]) + step) for s in live)
        plan = StepPlan(
            decodes=decodes,
            sampling={s: greedy for s in live},
            release=release,
            shrink_kv=bool(release),
        )
        for o in engine.submit(plan).result().outputs:
            out[o.slot].append(o.token_id)
            logprobs.append(float(o.logprob or 0.0))
    engine.submit(StepPlan(release=tuple(live))).result()
    return [out[s] for s in range(len(prompts))], logprobs


def assert_close_in_bf16(got: list[Tensor], want: list[Tensor], exact: list[Tensor]) -> None:
    """TP=2 logits in bf16 (`got`) against TP=1 in bf16 (`want`), step by step: TP=2 is no further
    from the float32 logits (`exact`) than TP=1's own bf16 rounding puts TP=1, within 1.5x.

    Why not |TP2 - TP1| against a fixed bound: with random weights bf16 alone moves the logits by
    4-12% of their norm (measured on the CPU, 4 layers of the Qwen3-Next shape), so a fixed 5% of
    the largest logit fails on rounding; the ratio sat at 0.97-1.09. A sharding bug (a missing
    all-reduce, a slice from the wrong rank) moves the logits by their own size: a ratio of ~10."""
    for i, (g, w, e) in enumerate(zip(got, want, exact, strict=True)):
        assert g.shape == w.shape == e.shape
        g, w, e = g.float(), w.float(), e.float()
        ours, theirs = float((g - e).norm()), float((w - e).norm())
        assert ours <= 1.5 * theirs + 1e-6 * float(e.norm()), (
            f"step {i}: |TP2 - float32| {ours:.4g} against |TP1 - float32| {theirs:.4g} (bf16 alone)"
        )


def assert_tp_serves_like_one_device(
    checkpoint_dir: str, check: Callable[[Any, int], None], tp: int = 2, **config: Any
) -> None:
    """An FP8 checkpoint served with its float8 weights kept, on one device and on `tp` ranks
    (more EngineConfig fields in `config`, applied to the split side): the same greedy tokens and
    logprobs. check(engine, tp) runs on each loaded engine before it serves."""
    import torch
    from ballast.engine.config import EngineConfig
    from ballast.engine.engine import Engine

    prompts = [list(range(3, 40)), list(range(500, 520))]

    def run(ranks: int) -> tuple[list[list[int]], list[float]]:
        extra = config if ranks > 1 else {}
        cfg = EngineConfig(
            model=checkpoint_dir,
            device="cpu",
            max_model_len=128,
            max_num_seqs=2,
            fp8_weights="keep",
            tensor_parallel_size=ranks,
            **extra,
        )
        engine = Engine.load(cfg)
        try:
            check(engine, ranks)
            return engine_greedy(engine, prompts, 8)
        finally:
            engine.shutdown()

    (want, want_lp), (got, got_lp) = run(1), run(tp)
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), atol=1e-4, rtol=1e-4)
