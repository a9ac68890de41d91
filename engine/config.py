"""The engine's configuration and its prefix cache's: frozen dataclasses, validated when built.
Values found at load time are returned by the engine, never written back here.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch
from ballast.engine.injected_faults import FaultSpec, parse_faults
from ballast.models.blocks import cpu_linear
from ballast.models.kernels import cpu_kernel
from ballast.models.layers import fp8

from ballast.settings import ConfigError, check, setting

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
KV_QUANT_MODES = ("none", "int8")
DEFAULT_PREFILL_CHUNK = 2048
CPU_BUSY_PREFILL_CHUNK = 512
CPU_WEIGHT_MODES = ("auto", "blocks", "dense")
# The largest prefill CUDA graph (`engine/prefill_graphs`): longer chunks are bound by their matrix
# products, not their launches.
PREFILL_GRAPH_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(
        default="default",
        metadata=setting(
            "BALLAST_MODEL", "model to serve: default, builtin:NAME, a .gguf file or a Hugging Face directory"
        ),
    )
    tokenizer: str | None = field(
        default=None,
        metadata=setting(
            "BALLAST_TOKENIZER",
            "a Hugging Face directory (tokenizer.json, tokenizer_config.json) whose tokenizer to use "
            "instead of the model's",
        ),
    )
    dtype: str = field(
        default="auto",
        metadata=setting(
            "BALLAST_DTYPE",
            "weights and activations dtype (auto = bfloat16 on CUDA, float32 on CPU)",
            choices=("auto", *DTYPES),
        ),
    )
    device: str = field(default="auto", metadata=setting("BALLAST_DEVICE", "auto, cpu, cuda or cuda:N"))
    max_num_seqs: int = field(
        default=8,
        metadata=setting("BALLAST_MAX_NUM_SEQS", "concurrent sequences (slots allocated at load)", 1, 4096),
    )
    max_model_len: int = field(
        default=2048,
        metadata=setting("BALLAST_MAX_MODEL_LEN", "prompt + generated tokens per sequence", 2, 1 << 20),
    )
    prefill_chunk_tokens: int = field(
        default=0,
        metadata=setting(
            "BALLAST_PREFILL_CHUNK_TOKENS",
            "largest prefill one step carries (profiled at load); 0 = 2048 (CPU: 512 beside decodes)",
            0,
            1 << 16,
        ),
    )
    fit: str = field(
        default="on",
        metadata=setting(
            "BALLAST_FIT",
            "on: where the asked slots, context and prefill chunk do not fit memory, start with fewer "
            "(logged, and in /v1/models' max_model_len); off: refuse to start instead",
            choices=("on", "off"),
        ),
    )
    kv_quant: str = field(
        default="none",
        metadata=setting(
            "BALLAST_KV_QUANT",
            "KV cache format: none keeps the model dtype, int8 adds per token-head scales",
            choices=KV_QUANT_MODES,
        ),
    )
    fp8_weights: str = field(
        default="auto",
        metadata=setting(
            "BALLAST_FP8_WEIGHTS",
            "FP8 checkpoints: keep holds float8 weights and runs FP8 GEMMs (half of bf16's bytes), "
            "dequantize converts them to --dtype at load; auto keeps them where the FP8 kernels run "
            "(CUDA 8.9+, Triton)",
            choices=("auto", "keep", "dequantize"),
        ),
    )
    kv_segment_bytes: int = field(
        default=0,
        metadata=setting(
            "BALLAST_KV_SEGMENT_BYTES",
            "KV pool growth step in bytes (whole blocks; 0 = 64 MiB on CPU, 256 MiB on CUDA)",
            0,
            1 << 40,
        ),
    )
    cpu_weights: str = field(
        default="auto",
        metadata=setting(
            "BALLAST_CPU_WEIGHTS",
            "CPU linears of a GGUF: blocks multiplies its Q4_0/Q4_1/Q8_0 weights as stored, in float32 "
            "(models/kernels/cpu_blocks.c, built for this CPU at first use; logits within ~1e-4 of dense), "
            "dense "
            "dequantizes every weight to --dtype; auto = blocks for a float32 CPU engine on one device "
            "where the kernel builds, else dense",
            choices=CPU_WEIGHT_MODES,
        ),
    )
    cpu_prefill: str = field(
        # float32 by default: bfloat16 prompts moved the default model's logprobs (docs/BENCHMARKS.md).
        default="float32",
        metadata=setting(
            "BALLAST_CPU_PREFILL",
            "arithmetic of a CPU engine's prompt chunks (steps of more than 64 rows): bfloat16 rounds "
            "their linears' and attention's inputs to bfloat16 (float32 sums; AMX / AVX512-BF16 through "
            "oneDNN, a long prompt's prefill about 2x faster, logits within the tolerance "
            "docs/BENCHMARKS.md gives); decode steps stay float32",
            choices=("float32", "bfloat16"),
        ),
    )
    cpu_threads: int = field(
        default=0,
        metadata=setting(
            "BALLAST_CPU_THREADS",
            "intra-op threads of a CPU engine; 0 = the CPUs it may use (affinity, cgroup quota) less one "
            "for the event loop, at least one (block decode steps: all, while no other process holds one)",
            0,
            4096,
        ),
    )
    seed: int = field(
        default=0,
        metadata=setting(
            "BALLAST_SEED", "seed of random-init weights and the shared sampler", 0, (1 << 63) - 1
        ),
    )
    cuda_graphs: bool = field(
        default=True,
        metadata=setting(
            "BALLAST_CUDA_GRAPHS",
            "replay decode steps as CUDA graphs (CUDA only; falls back to eager if capture fails)",
        ),
    )
    prefill_graphs: bool = field(
        default=True,
        metadata=setting(
            "BALLAST_PREFILL_GRAPHS",
            "with --cuda-graphs on one GPU: replay the prefill of a lone prompt (up to 2,048 tokens, or "
            "the prefill chunk if smaller) as a CUDA graph padded to a multiple of 128 tokens, for models "
            "whose rows meet only in attention (dense attention-only models); off: prefill runs eagerly",
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=setting(
            "BALLAST_TENSOR_PARALLEL_SIZE",
            "split the model over this many devices (one worker process each; torch.distributed: NCCL on "
            "CUDA, gloo on the CPU); 1 runs it on one device",
            1,
            8,
        ),
    )
    tp_cuda_graphs: bool = field(
        default=True,
        metadata=setting(
            "BALLAST_TP_CUDA_GRAPHS",
            "with --tensor-parallel-size > 1 and --cuda-graphs: every rank captures the same decode "
            "graphs (NCCL collectives inside) and replays them in step with rank 0; off: tensor-parallel "
            "decode runs eagerly (~10x slower at batch 1). A rank failing its capture turns it off for all",
        ),
    )
    expert_parallel: bool = field(
        default=False,
        metadata=setting(
            "BALLAST_EXPERT_PARALLEL",
            "under tensor parallel, give each device whole MoE experts (E / N of them) instead of a 1/N "
            "slice of every expert; needs --tensor-parallel-size > 1 dividing the experts",
        ),
    )
    compile: bool = field(
        default=True,
        metadata=setting(
            "BALLAST_COMPILE",
            "fuse each norm, rope and gated activation into one kernel with torch.compile inside the decode "
            "CUDA graphs (eager steps and the CPU run the eager code; so does all if compiling fails)",
        ),
    )

    faults: str | None = field(
        default=None,
        metadata=setting(
            "BALLAST_FAULTS",
            "fault injection for testing, off unless set: a JSON list such as "
            '[{"kind": "hang", "after_steps": 20, "seconds": 600}] (kinds hang, oom, device_error, slow; '
            "fields after_steps, count (-1 = forever), when (prefill, decode, any), seconds)",
        ),
    )

    def __post_init__(self) -> None:
        check(self)
        parse_faults(self.faults)  # a bad value is a start-up error, never ignored
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigError(f"--device (BALLAST_DEVICE)={self.device!r}: accepted auto, cpu, cuda, cuda:N")
        if self.expert_parallel and self.tensor_parallel_size < 2:
            raise ConfigError(
                "--expert-parallel (BALLAST_EXPERT_PARALLEL) splits the experts over the ranks of "
                "--tensor-parallel-size, which is 1: set it to 2 or more, or leave expert parallel off"
            )

    @property
    def fault_specs(self) -> tuple[FaultSpec, ...]:
        return parse_faults(self.faults)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def decode_graphs(self, device: torch.device) -> bool:
        """Whether decode steps on `device` are captured as CUDA graphs: on one GPU with
        --cuda-graphs, under tensor parallel only with --tp-cuda-graphs too. Every rank asks this,
        so all of them allocate the graphs' scratch slot or none does."""
        if not self.cuda_graphs or device.type != "cuda":
            return False
        return self.tensor_parallel_size == 1 or self.tp_cuda_graphs

    def prefill_graph_tokens(self, device: torch.device) -> int:
        """The largest prefill graph to capture (0: none): one GPU with --cuda-graphs and
        --prefill-graphs, up to the prefill chunk."""
        if not (self.prefill_graphs and self.decode_graphs(device)) or self.tensor_parallel_size > 1:
            return 0
        return min(PREFILL_GRAPH_TOKENS, self.resolved_prefill_chunk(device))

    def keeps_fp8(self, device: torch.device) -> bool:
        """Whether an FP8 checkpoint's weights stay float8 on device."""
        if self.fp8_weights == "auto":
            return fp8.kernels_available(device)
        return self.fp8_weights == "keep"

    def resolved_prefill_chunk(self, device: torch.device) -> int:
        """--prefill-chunk-tokens, or where 0 2,048 (never past max_model_len): the most prompt tokens
        a step carries, and what the load profiles. On a GPU fewer, bigger steps carry a burst of
        prompts sooner (128 streams of 1k-token prompts on a 3B model: TTFT p99 4.1 s at 2,048
        tokens a step, 10.4 s at 512)."""
        return self.prefill_chunk_tokens or min(DEFAULT_PREFILL_CHUNK, self.max_model_len)

    def resolved_busy_prefill_chunk(self, device: torch.device) -> int:
        """The most prompt tokens a step carries beside decodes. On the CPU a step is compute-bound,
        so a chunk stalls every running stream's next token for as long as it takes: 512 there
        unless --prefill-chunk-tokens is set. A prompt with nothing decoding beside it takes the
        whole chunk (a lone 2,000-token prompt, default model, int4 weights (since removed) with
        bfloat16 prompts, one thread: first token 2.2-3.6 s in 2,048-token steps against 2.6-4.4 s
        in 512-token ones)."""
        whole = self.resolved_prefill_chunk(device)
        return (
            whole if self.prefill_chunk_tokens or device.type != "cpu" else min(CPU_BUSY_PREFILL_CHUNK, whole)
        )

    def cpu_blocks(self, device: torch.device) -> bool:
        """Whether a GGUF's Q4/Q8 linears are multiplied as stored (models/layers/cpu_blocks.py): auto
        and blocks where the kernel builds; --cpu-weights blocks where it cannot is an error."""
        if self.cpu_weights not in ("auto", "blocks"):
            return False
        possible = self._one_float32_cpu(device) and cpu_kernel.available()
        if self.cpu_weights == "blocks" and not possible:
            raise ConfigError(
                "--cpu-weights (BALLAST_CPU_WEIGHTS)=blocks needs a float32 engine on the CPU, one device, "
                "a C compiler ($CC or cc) and a CPU with AVX2 and FMA; use dense here"
            )
        return possible

    def _one_float32_cpu(self, device: torch.device) -> bool:
        """A float32 engine on the CPU, on one device: where a GGUF's linears may stay packed."""
        return (
            device.type == "cpu"
            and self.resolved_dtype(device) == torch.float32
            and self.tensor_parallel_size == 1
        )

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def cpu_prompt_bf16(self, device: torch.device) -> bool:
        """Whether prompt chunks run in bfloat16 (models/blocks/cpu_linear.py): --cpu-prefill bfloat16,
        which needs a float32 CPU engine and a CPU with bfloat16 arithmetic; an error otherwise,
        not a silent float32 prefill."""
        if self.cpu_prefill != "bfloat16":
            return False
        if not (self._one_float32_cpu(device) and cpu_linear.bf16_available()):
            raise ConfigError(
                "--cpu-prefill (BALLAST_CPU_PREFILL)=bfloat16 needs a float32 engine on the CPU, one "
                "device, and a CPU with bfloat16 arithmetic (AVX512-BF16 or AMX)"
            )
        return True


# Checkpoints closer than this are never worth a split prefill chunk (each split costs a step).
MIN_INTERVAL = 512
_INTERVAL_QUANTUM = 256


@dataclass(frozen=True)
class PrefixCacheConfig:
    """The prefix cache's settings (flags and BALLAST_* variables through `ballast.server.config`)."""

    fraction: float = field(
        default=0.05,
        metadata=setting(
            "BALLAST_PREFIX_CACHE_FRACTION",
            "prefix cache byte budget as a fraction of effective host memory; 0 turns prefix reuse off",
            0.0,
            0.5,
        ),
    )
    max_bytes: int = field(
        default=0,
        metadata=setting(
            "BALLAST_PREFIX_CACHE_BYTES",
            "fixed cap on the prefix cache's bytes on top of the fraction; 0 = the fraction alone",
            0,
            1 << 50,
        ),
    )
    checkpoint_interval: int = field(
        default=0,
        metadata=setting(
            "BALLAST_CHECKPOINT_INTERVAL",
            "prompt tokens between checkpoints; 0 = from the model's costs",
            0,
            1 << 20,
        ),
    )

    def __post_init__(self) -> None:
        check(self)

    @property
    def enabled(self) -> bool:
        return self.fraction > 0


def auto_interval(state_bytes_per_slot: int, kv_bytes_per_token: int) -> int:
    """Tokens between checkpoints: at least state/kv tokens apart, so the recurrent copies cost no
    more than the KV they let a later prompt skip (interval checkpoints at most double the cache's
    bytes), and never below MIN_INTERVAL."""
    if kv_bytes_per_token <= 0:  # no attention layers: nothing to weigh the state against
        return MIN_INTERVAL
    tokens = math.ceil(state_bytes_per_slot / kv_bytes_per_token)
    return max(MIN_INTERVAL, _INTERVAL_QUANTUM * math.ceil(tokens / _INTERVAL_QUANTUM))
