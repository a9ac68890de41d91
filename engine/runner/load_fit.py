"""What a load needs beside the weights, and the configuration that fits where the asked one does
not (`--fit on`, the default): fewer slots, a shorter context, a smaller prefill chunk, in the
order that costs serving least, down to one short sequence. Only when the weights and that one
short sequence cannot fit is the start refused, saying what would.

llama.cpp's `--fit` shortens the context alone; vLLM refuses and asks for a lower max_model_len,
which its users ask about again and again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from ballast.engine.config import EngineConfig
from ballast.engine.runner.activations import activation_bytes, prefill_path
from ballast.engine.step.sampler import Sampler
from ballast.engine.workspace import VerifySize, step_workspace
from ballast.memory.specs import AttentionSpec, state_bytes_per_slot, verify_bytes
from ballast.models.arch.registry import model_class
from ballast.models.kv_store import plan_layout
from ballast.models.layers.state import dtype_bytes

MiB = 1 << 20
# The least a fitted configuration keeps: below these a server is not worth starting.
MIN_CHUNK = 256
MIN_CONTEXT = 512
# torch's code a CPU load and its first forwards page in (file-backed, resident, in the cgroup's
# count): measured over the default model's load in /proc/self/smaps, libtorch_cpu.so 11.9 MiB,
# the tokenizers library 1.6, libtorch_python 1.4.
CPU_CODE_BYTES = 15 * MiB


@dataclass(frozen=True)
class LoadEstimate:
    """The load's terms, in bytes: each what the start really holds on the path that will run
    (measured against the peak at start in bench/load_fit.py), none a pad. The staging is gone
    before the first step (the load hands the freed heap back: memory/heap.py), so the peak is the
    weights, the tokenizer and the larger of the staging and what serving holds."""

    weights: int  # as held: a CPU block linear's integers and float32 scales
    fixed: int  # the slots' recurrent states and the sampler's buffers
    one_sequence: int  # KV of one max_model_len sequence, in the whole segments the pool commits
    activations: int  # one prefill chunk's peak (engine/runner/activations.py)
    staging: int  # host memory the load passes through (CPU: a GGUF's mapped pages, blocks as read)
    tokenizer: int = 0  # resident bytes the tokenizer took as the load built it (measured there)
    code: int = 0  # library code the load and the first steps page in (CPU_CODE_BYTES on a CPU)

    @property
    def total(self) -> int:
        serving = self.fixed + self.one_sequence + self.activations
        return self.weights + self.tokenizer + self.code + max(self.staging, serving)

    def describe(self) -> str:
        serving = (
            ("states+sampler", self.fixed),
            ("one sequence", self.one_sequence),
            ("activations", self.activations),
        )
        terms = " + ".join(f"{name} {n / MiB:,.1f}" for name, n in serving)
        return (
            f"weights {self.weights / MiB:,.1f} + tokenizer {self.tokenizer / MiB:,.1f}"
            f" + code {self.code / MiB:,.1f} + max(staging {self.staging / MiB:,.1f}, {terms})"
            f" = {self.total / MiB:,.1f} MiB"
        )


def bytes_beside_weights(
    hf_config: Mapping[str, Any],
    config: EngineConfig,
    dtype: torch.dtype,
    device_type: str = "cuda",
    verify: VerifySize | None = None,
) -> tuple[int, int, int]:
    """What a load needs besides the weights: (the slots' recurrent states, their verify workspace
    and sampler buffers, with on a GPU the step workspace start-up leases there (a full batch's
    sampling, a prompt-logprob chunk: 552 MiB for 128 slots of a 49k vocabulary, left out until
    s26), one max_model_len sequence's KV in the whole segments the pool commits for it, the
    prefill activations on the path that will run), in bytes."""
    with torch.device("meta"):
        specs = model_class(hf_config).from_hf_config(hf_config).layer_specs(dtype_bytes(dtype))
    slots = config.max_num_seqs + 1  # the decode graphs' scratch slot
    vocab = int(hf_config.get("vocab_size", 0))
    fixed = slots * state_bytes_per_slot(specs) + Sampler.planned_bytes(config.max_num_seqs, vocab)
    if verify is not None:
        fixed += verify_bytes(specs, verify.rows, verify.drafts)
    if device_type == "cuda":  # engine/startup.py leases it on every die before the first step
        workspace = step_workspace(config.max_num_seqs, vocab, dtype_bytes(dtype))
        fixed += workspace.sampler_bytes + workspace.prompt_logprobs_bytes
    device = torch.device(device_type)
    quantized = config.kv_quant == "int8"
    chunk = config.resolved_prefill_chunk(device)
    path = prefill_path(device_type, quantized)
    activations = activation_bytes(hf_config, chunk, config.max_model_len, dtype_bytes(dtype), path)
    attn = [x for x in specs if isinstance(x, AttentionSpec)]
    if not attn:
        return fixed, 0, activations
    lay = plan_layout(
        len(attn), attn[0].num_kv_heads, attn[0].head_dim, dtype, quantized, 1, config.max_model_len,
        device, segment_bytes=config.kv_segment_bytes,
    )  # fmt: skip
    segments = -(-(lay.max_blocks_per_seq + 1) // lay.seg_blocks)  # its blocks and the sink
    return fixed, segments * lay.segment_bytes, activations


Estimator = Callable[[EngineConfig], LoadEstimate]


def fitted(config: EngineConfig, estimate: Estimator, budget: int) -> tuple[EngineConfig, str]:
    """The asked config if its estimate fits `budget`, else the first smaller one that does and a
    note of what was capped and why ("" when nothing was). Raises LoadDoesNotFit when even the
    smallest (one slot, MIN_CONTEXT tokens, MIN_CHUNK a step) does not."""
    asked = estimate(config)
    if asked.total <= budget:
        return config, ""
    for candidate in _smaller(config):
        if estimate(candidate).total <= budget:
            return candidate, _note(config, candidate, asked, budget)
    floor = _floor(config)
    raise LoadDoesNotFit(estimate(floor), budget, floor)


def _smaller(config: EngineConfig) -> Iterator[EngineConfig]:
    """Candidates, each smaller than the last: the prefill chunk first (a smaller step costs a
    little prompt speed), then the context (requests longer than it are refused, as asked), then
    the slots (fewer streams at once)."""
    cfg = config
    chunk = _chunk(cfg)
    while chunk > MIN_CHUNK:
        chunk = max(MIN_CHUNK, chunk // 2)
        cfg = dataclasses.replace(cfg, prefill_chunk_tokens=chunk)
        yield cfg
    while cfg.max_model_len > MIN_CONTEXT:
        cfg = dataclasses.replace(cfg, max_model_len=max(MIN_CONTEXT, cfg.max_model_len // 2))
        yield cfg
    while cfg.max_num_seqs > 1:
        cfg = dataclasses.replace(cfg, max_num_seqs=cfg.max_num_seqs // 2)
        yield cfg


def _chunk(config: EngineConfig) -> int:
    return config.prefill_chunk_tokens or min(2048, config.max_model_len)


def _floor(config: EngineConfig) -> EngineConfig:
    return dataclasses.replace(
        config,
        prefill_chunk_tokens=min(MIN_CHUNK, config.max_model_len),
        max_model_len=min(MIN_CONTEXT, config.max_model_len),
        max_num_seqs=1,
    )


def _note(asked: EngineConfig, got: EngineConfig, estimate: LoadEstimate, budget: int) -> str:
    changes = [
        f"{name} {a} -> {g}"
        for name, a, g in (
            ("max_num_seqs", asked.max_num_seqs, got.max_num_seqs),
            ("max_model_len", asked.max_model_len, got.max_model_len),
            (
                "prefill_chunk_tokens",
                asked.prefill_chunk_tokens or min(2048, asked.max_model_len),
                got.prefill_chunk_tokens,
            ),
        )
        if a != g
    ]
    return (
        f"fitted to memory: {', '.join(changes)} (the asked configuration needs {estimate.describe()}, "
        f"{budget / MiB:,.1f} MiB free above the reserve; --fit off refuses instead)"
    )


class LoadDoesNotFit(RuntimeError):
    """Not even the weights and one short sequence fit: what they need, and what would fit."""

    def __init__(self, estimate: LoadEstimate, budget: int, floor: EngineConfig) -> None:
        short = estimate.total - budget
        super().__init__(
            f"the model does not fit even with one {floor.max_model_len}-token sequence: it needs "
            f"{estimate.describe()}, {budget / MiB:,.1f} MiB is free above the reserve; it would fit "
            f"with {short / MiB:,.1f} MiB more (a memory limit that much higher, or a host reserve that much "
            "smaller: BALLAST_HOST_RESERVE_MIN_BYTES, BALLAST_HOST_RESERVE_FRACTION)"
        )
        self.estimate = estimate
