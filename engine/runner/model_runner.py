"""The model runner: one model, its per-layer slot states, the KV block pool and the sampler, on one
device.

Everything here runs on the engine thread. Per-slot states (recurrent layers, the sampler) are
allocated once after the profiling pass with fixed shapes; attention KV lives in the block pool,
which starts empty and grows and shrinks in segments while serving.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from ballast.engine.graphs.decode import Leftover
from ballast.engine.graphs.graph_runner import GraphRunner
from ballast.engine.kv.kv_pool import Acquire, KVManager, KVPool
from ballast.engine.runner.activations import activation_bytes
from ballast.engine.step.sampler import Sampler
from ballast.engine.workspace import VerifySize
from ballast.memory.specs import LayerSpec, kv_bytes_per_token, state_bytes_per_slot, verify_bytes
from ballast.memory.types import CostModel
from ballast.models.base import CausalLM, ForwardBatch, Rows, StepBatch, to_device
from ballast.models.layers.state import LayerState, allocate_states, build_states, dtype_bytes, kv_store_for
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

WARMUP_TOKENS = 8
# cuDNN attention (torch's first choice for bf16 with a mask on Hopper) builds a new plan for
# every new KV length, ~27 ms a call measured on an H200 with torch 2.11, and decode changes the
# length every step. Flash / memory-efficient kernels have no such setup.
ATTENTION_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the storages behind the model's parameters and buffers, each counted once: tied
    parameters share one storage, and parameters may be views into one flat allocation."""
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta":
            total += t.numel() * t.element_size()  # no storage yet; parameters() yields a tied one once
            continue
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def as_causal_lm(model: nn.Module) -> CausalLM:
    return cast(CausalLM, model)


def vocab_size(model: nn.Module) -> int:
    return int(as_causal_lm(model).config.vocab_size)


def warm_kernels(
    model: nn.Module, specs: Sequence[LayerSpec], tokens: int, device: torch.device, dtype: torch.dtype
) -> None:
    """Short forwards on a throwaway two-slot cache that make the kernels' variants a served step
    meets: Triton compiles a kernel once per kind of each integer argument (1, a multiple of 16,
    any other), and these steps give one sequence an even count and then two sequences an odd
    count, one of them a decode token beside a chunk, so first requests do not wait on the
    compiler (the first request to a 3B model on an H200 waited 3.4 s, the second 0.09 s)."""
    states = allocate_states(specs, 2, 2 * tokens + 1, device, dtype)
    with torch.inference_mode():
        model(ForwardBatch.build([(0, [0] * tokens, 0)], device), states)
        model(ForwardBatch.build([(0, [0] * max(1, tokens - 1), 0), (1, [0], tokens)], device), states)


@dataclass(frozen=True)
class Profile:
    """What the profiling prefill found."""

    chunk_tokens: int
    peak_activation_bytes: int
    measured: bool  # True: the device allocator's peak; False: the analytic bound


def profile_prefill(
    model: nn.Module,
    hf_config: Mapping[str, Any],
    chunk_tokens: int,
    max_model_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Profile:
    """Peak activation bytes of one prefill of `chunk_tokens` tokens placed at the end of a
    max_model_len context (so attention reads the longest cache any real chunk can read).

    On CUDA: run that prefill on a throwaway one-slot cache and take the allocator's peak. On CPU
    no allocator reports a peak (tracemalloc does not see torch's allocations), so the figure is
    `activations.activation_bytes`, and a short warm-up prefill checks the model runs."""
    start = max(0, max_model_len - chunk_tokens)
    specs = as_causal_lm(model).layer_specs(dtype_bytes(dtype))
    # First forwards allocate one-time buffers (the cuBLAS workspace, ~32 MiB) that are not
    # activations, and take first-call costs (kernel selection) out of the first request.
    warm_kernels(model, specs, min(chunk_tokens, WARMUP_TOKENS), device, dtype)
    if device.type == "cuda":
        states = allocate_states(specs, 1, start + chunk_tokens, device, dtype)
        batch = ForwardBatch.build([(0, [0] * chunk_tokens, start)], device)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        reserved = torch.cuda.memory_reserved(device)
        with torch.inference_mode():
            model(batch, states)
        torch.cuda.synchronize(device)
        # What the allocator reserved for the prefill, where it is more than the tensors' peak
        # (rounding, fragmentation): the caching allocator keeps it, so that is what is taken.
        peak = max(
            torch.cuda.max_memory_allocated(device) - base,
            torch.cuda.max_memory_reserved(device) - reserved,
        )
        return Profile(chunk_tokens, int(peak), measured=True)
    # On CPU the figure is analytic: the short warm-up proved the model runs, and a full chunk
    # would add seconds to every load for nothing measured. The larger of the two CPU paths: the
    # ladder may start sequences in int8 blocks (the gathered path) under pressure.
    act_bytes = torch.empty((), dtype=dtype).element_size()
    peak = max(
        activation_bytes(hf_config, chunk_tokens, start + chunk_tokens, act_bytes, path)
        for path in ("cpu", "cpu-gathered")
    )
    return Profile(chunk_tokens, peak, measured=False)


def build_cost_model(
    model: nn.Module, dtype: torch.dtype, profile: Profile, weights: int, kv_block_tokens: int = 1
) -> CostModel:
    lm = as_causal_lm(model)
    specs: list[LayerSpec] = lm.layer_specs(dtype_bytes(dtype))
    quantized: list[LayerSpec] = lm.layer_specs(1)
    return CostModel(
        kv_bytes_per_token=kv_bytes_per_token(specs),
        state_bytes_per_slot=state_bytes_per_slot(specs),
        activation_bytes_per_prefill_token=-(-profile.peak_activation_bytes // profile.chunk_tokens),
        weights_bytes=weights,
        quantized_kv_bytes_per_token=kv_bytes_per_token(quantized),
        prefill_chunk_tokens=profile.chunk_tokens,
        kv_block_tokens=kv_block_tokens,
        state_preallocated=True,
        extra={
            "profile_chunk_tokens": profile.chunk_tokens,
            "profile_peak_bytes": profile.peak_activation_bytes,
        },
    )


def planned_state_bytes(
    model: nn.Module,
    dtype: torch.dtype,
    num_slots: int,
    scratch_slot: bool = False,
    verify: VerifySize | None = None,
) -> int:
    """Bytes `ModelRunner` allocates at load for these settings (per-slot recurrent states, their
    verify workspace and the sampler's buffers), from the layer specs alone, so the VRAM ledger can
    be asked before anything is allocated. KV blocks are not in it: the pool leases them segment
    by segment."""
    lm = as_causal_lm(model)
    specs = lm.layer_specs(dtype_bytes(dtype))
    kept = verify_bytes(specs, verify.rows, verify.drafts) if verify is not None else 0
    return (
        (num_slots + int(scratch_slot)) * state_bytes_per_slot(specs)
        + kept
        + Sampler.planned_bytes(num_slots, int(lm.config.vocab_size))
    )


class ModelRunner:
    """Owns the model's slot states, the KV block pool, the sampler and the graph runner; runs one
    forward over many slots. With scratch_slot the states carry one slot more than num_slots, for
    graph padding (it holds one block for good: padding rows write there)."""

    # The changes other ranks must replay before each forward (a sharded runner's list; one device
    # has none): the prefix cache appends its slot-state copies to it.
    journal: list[Any] | None = None

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        dtype: torch.dtype,
        num_slots: int,
        max_model_len: int,
        quantized_kv: bool,
        seed: int,
        scratch_slot: bool = False,
        acquire: Acquire | None = None,
        segment_bytes: int = 0,
        verify: VerifySize | None = None,
    ) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.quantized_kv = quantized_kv
        lm = as_causal_lm(model)
        specs = lm.layer_specs(1 if quantized_kv else dtype_bytes(dtype))
        self._state_slots = num_slots + int(scratch_slot)
        # The main store in the configured format (--kv-quant); an int8 one beside it (address
        # space only until a sequence needs it) for sequences the ladder starts in int8 at WATCH
        # and worse.
        shape = (specs, self._state_slots, max_model_len, device, dtype)
        main = kv_store_for(*shape, quantized_kv, segment_bytes)
        self.kv_manager: KVManager | None = None
        if main is not None:
            int8 = None if quantized_kv else kv_store_for(*shape, True, segment_bytes)
            self.kv_manager = KVManager(
                KVPool(main, acquire), KVPool(int8, acquire) if int8 is not None else None
            )
        # The main pool, and the int8 one beside it (None: no attention layers / none beside it).
        self.kv = self.kv_manager.main if self.kv_manager is not None else None
        self.kv_int8 = self.kv_manager.int8 if self.kv_manager is not None else None
        attention = self.kv_manager.attention() if self.kv_manager is not None else None
        # verify: the recurrent states' workspace for verify steps of this size (`VerifySize`)
        self.verify = verify or VerifySize()
        kept = (self.verify.rows, self.verify.drafts)
        self.states: list[LayerState] = build_states(specs, self._state_slots, attention, device, dtype, kept)
        vocab = int(lm.config.vocab_size)
        self.sampler = Sampler(num_slots, vocab, device, seed)
        self.graph_runner = GraphRunner(
            device,
            num_slots,
            max_model_len,
            scratch_slot,
            self._run,
            self._scratch_block,
            prefill_safe=main is not None and as_causal_lm(model).prefill_graphs_safe,
            kv_per_weight=kv_bytes_per_token(specs) / max(1, weights_bytes(model)) if scratch_slot else 0.0,
            verify=(self.verify, any(s.slot_views(0) for s in self.states)),  # recurrent: rows keep states
            leftover=Leftover.of(model),  # the hidden states an MTP drafter reads
        )

    @property
    def fixed_bytes(self) -> int:
        """Bytes held for the slots whatever runs: per-slot states and the sampler's buffers."""
        return sum(s.nbytes for s in self.states if s.slot_views(0)) + self.sampler.state_bytes

    @property
    def sound(self) -> bool:
        """Whether this runner can still run a step (a tensor-parallel one needs its workers)."""
        return True

    def close(self) -> None:
        """Let go of what outlives the engine thread (a tensor-parallel runner's workers)."""
        return None

    def abandon(self) -> None:
        """The engine thread is stuck in a step: end at once what would outlive this process
        without waiting for that thread (a tensor-parallel runner's workers)."""
        return None

    @property
    def pools(self) -> list[KVPool]:
        return self.kv_manager.pools if self.kv_manager is not None else []

    @property
    def state_bytes(self) -> int:
        """Bytes held for slots now: the fixed part and the KV pools' live segments."""
        return self.fixed_bytes + sum(p.bytes_held for p in self.pools)

    def reset(self, slots: Sequence[int]) -> None:
        """New sequences start in these slots (their KV blocks were released before)."""
        if not slots:
            return
        index = to_device(list(slots), torch.long, self.device)
        for state in self.states:
            state.reset(index)
        self.sampler.reset(slots)

    def _scratch_block(self, positions: int) -> bool:
        """Give the graphs' scratch slot KV blocks for its first `positions` (padding rows write there)."""
        return self.kv is None or self.kv.ensure(self.num_slots, positions)

    def forward(self, seqs: StepBatch | Rows, all_logits: Sequence[bool] = ()) -> Tensor:
        """Logits at each sequence's last token (at every token of the sequences all_logits marks),
        in sequence order; writes the slots' states. A decode step replays a graph where one was
        captured for its shape (the logits are then a view valid until the next step), a lone
        prompt chunk a prefill graph, and a prompt chunk beside decodes both where that pays.
        seqs: the step's batch (its own all_logits), or rows (tests and benches)."""
        batch = seqs if isinstance(seqs, StepBatch) else StepBatch.of(seqs, all_logits=all_logits)
        kv = self.kv_manager
        if kv is not None:
            bs = kv.main.layout.block_size
            bare = [
                slot
                for slot, start, n in zip(batch.slots_list, batch.starts_list, batch.lens_list, strict=True)
                if kv.held(slot) * bs < start + n
            ]
            if bare:  # writing there would land in another sequence's blocks
                raise ValueError(
                    f"slots {bare} have no KV blocks for this step's positions (KVPool.ensure first)"
                )
        return self.graph_runner.forward(batch, self.mark_kv(batch), self._eager)

    def mark_kv(self, batch: StepBatch) -> bool:
        """Mark the batch with whether a sequence of it lives in the int8 KV store (the KV
        manager's answer, what attention and the graphs' variant follow); returns it."""
        kv = self.kv_manager
        batch.uses_int8_kv = kv is not None and kv.holds_int8(batch.slots_list)
        return batch.uses_int8_kv

    def _eager(self, batch: StepBatch) -> Tensor:
        """A step run eagerly (under tensor parallel, every rank's)."""
        return self._run(batch)

    def _run(self, batch: ForwardBatch) -> Tensor:
        batch.place(self.device)  # a graph's static batch is placed already
        with torch.inference_mode(), sdpa_kernel(ATTENTION_BACKENDS):
            logits: Tensor = self.model(batch, self.states)
        return logits
