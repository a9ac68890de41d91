"""Resolve a model spec, ask the memory layer, and load weights and tokenizer.

Specs: `default` (the embedded SmolLM2 GGUF), `builtin:NAME` (seeded random init), a `.gguf` file,
or a Hugging Face directory; the spec's form alone picks the loader. The memory layer is asked
before any weight is read, and what lands on a GPU is held as a VRAM ledger lease, so the ledger
refuses the next big allocation before the driver would OOM.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from ballast.engine import threads
from ballast.engine.config import EngineConfig
from ballast.engine.runner.load_fit import (
    CPU_CODE_BYTES,
    LoadDoesNotFit,
    LoadEstimate,
    MiB,
    bytes_beside_weights,
    fitted,
)
from ballast.engine.runner.model_runner import weights_bytes
from ballast.engine.text.sampling_defaults import GenerationConfigError
from ballast.engine.text.tokenizer import Tokenizer, TokenizerError
from ballast.engine.workspace import VerifySize
from ballast.memory import heap
from ballast.memory.admission import admit_load_spike
from ballast.memory.errors import MemoryRefused
from ballast.memory.ledger import Lease
from ballast.memory.types import MemState, Verdict, VerdictKind
from ballast.memory.watch import MemWatch
from ballast.models.arch import builtin
from ballast.models.arch.llama import LlamaForCausalLM, q4_blocks
from ballast.models.arch.registry import convert_model, model_class
from ballast.models.base import ModelError
from ballast.models.blocks.cpu_linear import hold_prompt_bf16
from ballast.models.layers.packed import Q4Weight, Q8Weight
from ballast.models.layers.state import dtype_bytes
from ballast.models.weights.default_model import DefaultModelError, default_model_path
from ballast.models.weights.gguf_loader import (
    GGUFError,
    build_tokenizer,
    gguf_block_weights,
    gguf_config,
    gguf_tensors,
    hf_tensor_name,
    read_gguf,
)
from ballast.models.weights.gguf_reader import GGUFFile
from ballast.models.weights.hf_loader import inspect_hf_dir, load_hf_model
from torch import nn


class ModelSpecError(ValueError):
    """The model spec names nothing loadable."""


log = logging.getLogger(__name__)


class ModelLoadRefused(RuntimeError):
    """The memory layer refused the load; `verdict.reason` says what did not fit."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(f"model load refused by the memory layer: {verdict.reason}")
        self.verdict = verdict


# Everything a load can fail with for a reason the operator can fix (a bad spec or file, a model we
# do not implement, not enough memory, no network for the default model): report, don't trace.
LOAD_ERRORS: tuple[type[Exception], ...] = (
    ModelSpecError,
    ModelLoadRefused,
    ModelError,
    DefaultModelError,
    GGUFError,
    TokenizerError,
    MemoryRefused,
    GenerationConfigError,
)


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "builtin" | "gguf" | "hf"
    name: str  # what clients see as the model name
    path: Path | None = None  # None for builtin


def check_spec(spec: str) -> None:
    """Fail fast on a model that names nothing loadable; the default model is fetched at load."""
    if spec != "default":
        resolve(spec)


def resolve(spec: str) -> ModelSource:
    if spec == "default":
        path = default_model_path()
        return ModelSource("gguf", path.stem, path)
    if spec.startswith(builtin.PREFIX):
        builtin.builtin_config(spec)  # raises UnsupportedModel naming the built-in models
        return ModelSource("builtin", spec)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelSpecError(f"model {spec!r} not found (no such file or directory)")
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.stem, path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource("hf", path.name, path)
    raise ModelSpecError(
        f"model {spec!r} is not 'default', 'builtin:NAME', a .gguf file or a Hugging Face directory with "
        "config.json"
    )


@dataclass
class LoadedModel:
    source: ModelSource
    model: nn.Module
    hf_config: dict[str, Any]
    tokenizer: LazyTokenizer
    weights_bytes: int
    load_s: float
    leases: list[Lease]
    config: EngineConfig  # what it was loaded for: the asked configuration, or the one that fits


class LazyTokenizer:
    """Loads the tokenizer on first use: tests that drive a model with token ids never pay for it."""

    def __init__(self, factory: Callable[[], Tokenizer]) -> None:
        self._factory = factory
        self._lock = threading.Lock()
        self._value: Tokenizer | None = None

    def get(self) -> Tokenizer:
        with self._lock:
            if self._value is None:
                self._value = self._factory()
            return self._value


def lazy_tokenizer(hf_dir: Path | None) -> LazyTokenizer:
    """A Hugging Face directory's tokenizer or, for None, the default model's (a built-in model
    borrows it: same vocabulary)."""
    if hf_dir is None:
        return LazyTokenizer(lambda: Tokenizer(build_tokenizer(read_gguf(default_model_path()).metadata)))
    path: Path = hf_dir
    return LazyTokenizer(lambda: Tokenizer.from_hf_dir(path))


def _built(tokenizer: LazyTokenizer, watch: MemWatch | None) -> int:
    """Resident bytes the tokenizer takes, measured as it is built now (a server builds it at start
    anyway: 14 MiB for the default model's 49k vocabulary); 0 without a memory layer (tests that
    drive a model with token ids never build it)."""
    if watch is None:
        return 0
    before = heap.resident_bytes()
    tokenizer.get()
    return max(0, heap.resident_bytes() - before)


def planned_weights_bytes(hf_config: dict[str, Any], dtype: torch.dtype) -> int:
    """Bytes a built-in model will hold, float8 weights and scales included (built on meta)."""
    with torch.device("meta"):
        model = model_class(hf_config).from_hf_config(hf_config).to(dtype)
    fp8_weights = builtin.fp8_weights(hf_config)
    if fp8_weights is not None:
        convert_model(model, *fp8_weights)
    # parameters() yields a tied parameter once, so tied embeddings are not counted twice.
    return sum(p.numel() * p.element_size() for p in model.parameters())


def admit_load(
    hf_config: Mapping[str, Any],
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    weights: int,
    watch: MemWatch | None,
    *,
    host_staging: int = 0,
    tokenizer: int = 0,
    verify: VerifySize | None = None,
) -> EngineConfig:
    """The configuration to load with: `config` when the weights, the slots' fixed states, one
    max-length sequence's KV and a prefill chunk's activations fit (on the host for a CPU engine,
    under the die's ledger ceiling for a GPU one), else with `--fit on` a smaller one that does
    (logged on one line). Raises ModelLoadRefused when nothing fits, or with `--fit off` when the
    asked one does not. host_staging: host memory the load passes through on its way to a GPU (a
    GGUF dequantized whole, safetensors read ahead), checked with the load spike. tokenizer: the
    resident bytes the tokenizer took as it was built (`_built`)."""
    if watch is None:
        return config  # tests and tools without a memory layer
    mem_config = watch.config
    # A CUDA load's host staging is checked as the host's load spike below, not against the die.
    staging = host_staging if device.type == "cpu" else 0

    def estimate(cfg: EngineConfig) -> LoadEstimate:
        beside = bytes_beside_weights(hf_config, cfg, dtype, device.type, verify)
        host = device.type == "cpu"  # a GPU's estimate is of the die: the host's bytes are not in it
        code = CPU_CODE_BYTES if host else 0
        return LoadEstimate(weights, *beside, staging, tokenizer if host else 0, code)

    asked = estimate(config)
    state: MemState = watch.poll_now()

    if device.type == "cuda":
        # The host only stages the load: the spike and the staging, whatever the configuration.
        spike = admit_load_spike(mem_config.load_spike_bytes, state, host_weights_bytes=host_staging)
        if not spike.admitted:
            raise ModelLoadRefused(spike)
        free, total = torch.cuda.mem_get_info(device)
        budget = watch.ledger.register_die(die_index(device), total, free)
    else:
        # On the host the weights are what loading holds (a GGUF is mapped, not read whole).
        budget = state.host_budget_bytes
    log.info("load estimate: %s; %.1f MiB free for it", asked.describe(), budget / MiB)
    if config.fit == "off":
        if asked.total > budget:
            raise ModelLoadRefused(
                Verdict(VerdictKind.REJECT, 0, f"needs {asked.describe()}, {budget / MiB:,.1f} MiB free")
            )
        return config
    try:
        cfg, note = fitted(config, estimate, budget)
    except LoadDoesNotFit as exc:
        raise ModelLoadRefused(Verdict(VerdictKind.REJECT, 0, str(exc))) from None
    if note:
        log.warning("%s", note)
    return cfg


def die_index(device: torch.device) -> int:
    """The GPU index of a CUDA device (the current one where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def load(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    watch: MemWatch | None = None,
    mtp: bool = False,
    verify: VerifySize | None = None,
) -> LoadedModel:
    """Load the model config.model names onto device in dtype, after the memory layer agrees.
    mtp: with its multi-token-prediction layers, to draft from (an error where it has none);
    verify: the verify workspace start-up allocates beside the slot states (`VerifySize`)."""
    admit = functools.partial(admit_load, verify=verify)
    source = resolve(config.model)
    tok_dir = None if config.tokenizer is None else Path(config.tokenizer)
    if tok_dir is not None and not tok_dir.is_dir():
        raise ModelSpecError(f"--tokenizer {tok_dir} is not a directory")
    t0 = time.perf_counter()
    asked_tok = None if tok_dir is None else lazy_tokenizer(tok_dir)
    if source.kind == "builtin":
        hf_config = builtin.builtin_config(source.name, mtp)
        weights = planned_weights_bytes(hf_config, dtype)
        # the default model's tokenizer (a built-in test model borrows it) may be fetched: not built
        tok_bytes = _built(asked_tok, watch) if asked_tok is not None else 0
        config = admit(hf_config, config, device, dtype, weights, watch, tokenizer=tok_bytes)
        model = builtin.build_builtin(source.name, dtype=dtype, device=device, mtp=mtp)
        tokenizer = asked_tok or lazy_tokenizer(None)
    elif source.kind == "gguf":
        assert source.path is not None
        gf = read_gguf(source.path)
        hf_config = gguf_config(gf)
        meta = gf.metadata
        tokenizer = asked_tok or LazyTokenizer(lambda: Tokenizer(build_tokenizer(meta)))
        tok_bytes = _built(tokenizer, watch)  # first: the heap holds nothing freed yet
        packed = _held_weights(gf, hf_config) if config.cpu_blocks(device) else {}
        # the embedding table stays dense (lookups), even where the tied head reads its blocks
        skip = {n for n in packed if n != "model.embed_tokens.weight"}
        dense = sum(math.prod(t.shape) for t in gf.tensors.values()) * dtype_bytes(dtype)
        held_blocks = sum(_record_bytes(w) for w in packed.values())
        # The GGUF is dequantized whole in host memory before it moves to a GPU; on the CPU the load
        # passes through the file's mapped pages and the blocks as read, before their records.
        file_bytes = sum(t.nbytes for t in gf.tensors.values())
        staging = dense if device.type == "cuda" else file_bytes + held_blocks
        weights = _held_bytes(gf, skip, dtype) + held_blocks
        config = admit(
            hf_config, config, device, dtype, weights, watch, host_staging=staging, tokenizer=tok_bytes
        )
        model = _from_tensors(hf_config, gguf_tensors(gf, hf_config, dtype, skip=skip), device)
        if packed:
            decode = threads.decode_threads(threads.read_cpu_share(), config.cpu_threads)
            cast(LlamaForCausalLM, model).hold_blocks(packed, decode)
        if config.cpu_prompt_bf16(device):
            hold_prompt_bf16(model)
    else:
        assert source.path is not None
        ckpt = inspect_hf_dir(source.path, mtp)
        hf_config = ckpt.config
        keep_fp8 = config.keeps_fp8(device)
        weights = ckpt.weights_bytes(dtype, keep_fp8)
        tokenizer = asked_tok or lazy_tokenizer(source.path)
        tok_bytes = _built(tokenizer, watch)
        config = admit(
            hf_config, config, device, dtype, weights, watch,
            host_staging=ckpt.transient_bytes(), tokenizer=tok_bytes,
        )  # fmt: skip
        model = load_hf_model(ckpt, dtype=dtype, device=device, keep_fp8=keep_fp8)
    if mtp and getattr(model, "mtp", None) is None:
        raise ModelSpecError(
            f"--speculative-config method 'mtp' needs a model with a multi-token-prediction layer "
            f"(config num_nextn_predict_layers > 0 and its mtp.* tensors); {config.model} has none "
            "(use method 'ngram')"
        )
    leases: list[Lease] = []
    held = weights_bytes(model)
    if watch is not None and device.type == "cuda":
        leases.append(watch.ledger.lease(die_index(device), held, f"weights:{source.name}"))
    return LoadedModel(
        source, model.eval(), dict(hf_config), tokenizer, held, time.perf_counter() - t0, leases, config
    )


def _record_bytes(weight: Q4Weight | Q8Weight) -> int:
    """Bytes a block linear holds for a weight: its integers and float32 scales (a Q4_1 block's 20
    bytes in the file are 24 held)."""
    fields = (
        (weight.qs, weight.scale, weight.minimum)
        if isinstance(weight, Q4Weight)
        else (weight.q, weight.scale)
    )
    return sum(t.numel() * t.element_size() for t in fields)


def _held_bytes(gf: GGUFFile, packed: set[str], dtype: torch.dtype) -> int:
    """Bytes of the GGUF's tensors the model holds dense (every one not in `packed`)."""
    return sum(
        math.prod(t.shape) * dtype_bytes(dtype)
        for n, t in gf.tensors.items()
        if hf_tensor_name(n) not in packed
    )


def _held_weights(gf: GGUFFile, hf_config: dict[str, Any]) -> dict[str, Q4Weight | Q8Weight]:
    """The GGUF's weights the CPU keeps packed: whole 4-bit blocks of a Llama-family model, and
    its output head's Q8_0 / Q4 blocks."""
    if model_class(hf_config) is not LlamaForCausalLM:
        return {}
    packed = gguf_block_weights(gf, hf_config)
    names = {hf_tensor_name(n) for n in gf.tensors if n != "rope_freqs.weight"}
    q4 = {n for n, w in packed.items() if isinstance(w, Q4Weight)}  # a block is 4-bit whole
    keep = {w for _, _, weights in q4_blocks(q4, names) for w in weights}
    keep.add("model.embed_tokens.weight" if hf_config.get("tie_word_embeddings") else "lm_head.weight")
    return {n: w for n, w in packed.items() if n in keep}


def _from_tensors(
    hf_config: Mapping[str, Any], tensors: dict[str, torch.Tensor], device: torch.device
) -> nn.Module:
    """Build the model on the meta device and adopt the loaded tensors as its parameters."""
    with torch.device("meta"):
        model = model_class(hf_config).from_hf_config(hf_config)
    # Not strict: a checkpoint with tied embeddings has no lm_head tensor; tie_weights covers it.
    result = model.load_state_dict(tensors, strict=False, assign=True)
    if result.unexpected_keys:
        raise ModelSpecError(
            f"checkpoint has tensors the model does not: {', '.join(result.unexpected_keys[:8])}"
        )
    tie = getattr(model, "tie_weights", None)
    if tie is not None:
        tie()
    missing = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.device.type == "meta"]
    if missing:
        raise ModelSpecError(
            f"checkpoint lacks tensors for: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"
        )
    return model.to(device)
