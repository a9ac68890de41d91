"""The model interface shared by every architecture and the engine: a step's `StepBatch` (the
layers' `ForwardBatch`), `LayerState`, `CausalLM`. Host-side shapes (`max_len`, `max_ctx`, the
lists) are computed once per step here so the layers never sync with the device to learn a shape.
"""

from __future__ import annotations

import abc
import operator
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import Any, Protocol, overload

import torch
from ballast.memory.specs import LayerSpec
from torch import Tensor


class ModelError(Exception):
    """Base of the models layer's errors."""


class UnsupportedModel(ModelError):
    """The checkpoint's architecture (or one of its options) is not implemented here."""


class WeightLoadError(ModelError):
    """A checkpoint's tensors do not match the model (missing, unexpected, wrong shape, unreadable)."""


class ModelConfigError(ModelError):
    """A model config dict is missing a required field or holds an invalid value."""


# One step's work as rows, one per sequence: (slot, token ids, start position), for tests and
# model-only callers (the engine's builder makes the lists directly).
Row = tuple[int, Sequence[int], int]
Rows = Sequence[Row]


@dataclass(eq=False, repr=False)
class StepBatch(Sequence[Row]):
    """One step's sequences, from the plan to the kernels. Sequence b holds tokens
    [cu_lens[b], cu_lens[b+1]) of the flat arrays, at positions starts[b] .. starts[b] + lens[b] - 1
    of slot slots[b]; it attends to the slot's cached positions and causally within itself.
    The host half is set when built; the device half (the index tensors) by `place`, in one
    copy, only on paths that read it (a replayed graph stages the lists into its own buffers)."""

    slots_list: list[int]
    starts_list: list[int]
    lens_list: list[int]
    tokens: array[int]  # flat host token ids (what `fill_tokens` completes may hold a placeholder)
    max_len: int  # longest new-token run of any sequence
    max_ctx: int  # longest start + len: the cache positions any sequence may read
    # From sequence `tail_from` on (prefills come first) every sequence feeds one token, attended on
    # CUDA by the decode kernel rather than each padded to a prefill tile. 0: no such tail.
    tail_from: int = 0
    tail_max_ctx: int = 0  # the longest of tail_ctx
    all_logits: tuple[bool, ...] = ()  # per sequence: logits at every token (prompt logprobs)
    sampled: tuple[bool, ...] = ()  # per sequence: a token is drawn from its logits
    # Completes on the device, given the token ids and each one's slot, the ids the host does not
    # hold yet, once they are where the forward reads them (`place`, a graph's staging); None: none.
    fill_tokens: Callable[[Tensor, Tensor], None] | None = None
    # Some sequence keeps its KV in int8 blocks beside others in the model dtype (the ladder's int8
    # rung): attention writes and reads both stores, each sequence keeping its own store's result.
    uses_int8_kv: bool = False
    # Per sequence: a verify row (a decode and its drafts) whose recurrent layers keep the state
    # after each position, in the order of such rows, for the rollback (`LayerState.roll_back`).
    verify: tuple[bool, ...] = ()
    token_ids: Tensor = field(init=False)  # [T] int64
    positions: Tensor = field(init=False)  # [T] int64, absolute position in the slot's sequence
    slots: Tensor = field(init=False)  # [B] int64
    starts: Tensor = field(init=False)  # [B] int64, tokens already in the slot's cache
    lens: Tensor = field(init=False)  # [B] int64, new tokens this step
    cu_lens: Tensor = field(init=False)  # [B+1] int64
    # Rows of the flat layout whose logits the model returns: each sequence's last token, or all
    # of its tokens where asked (prompt logprobs), in sequence order.
    logit_index: Tensor = field(init=False)
    seq_of_token: Tensor = field(init=False)  # [T] int64, b of each token
    slot_of_token: Tensor = field(init=False)  # [T] int64, slots[seq_of_token]
    pad_index: Tensor = field(init=False)  # [T] index of each token in a padded [B, max_len] layout
    tail_slots: Tensor | None = field(init=False, default=None)  # [B - tail_from], slots[tail_from:]
    tail_ctx: Tensor | None = field(init=False, default=None)  # [B - tail_from], starts[tail_from:] + 1
    placed_on: torch.device | None = field(init=False, default=None)

    @property
    def num_seqs(self) -> int:
        return len(self.slots_list)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) if self.placed_on is None else int(self.token_ids.shape[0])

    @property
    def decode_only(self) -> bool:
        """Every sequence feeds exactly one token: the flat and padded layouts coincide."""
        return self.max_len == 1

    @property
    def device(self) -> torch.device:
        return self.token_ids.device

    def __len__(self) -> int:
        return len(self.slots_list)

    @overload
    def __getitem__(self, b: int) -> Row: ...
    @overload
    def __getitem__(self, b: slice) -> Sequence[Row]: ...
    def __getitem__(self, b: int | slice) -> Row | Sequence[Row]:
        return list(self)[b]

    def __iter__(self) -> Iterator[Row]:
        at = 0
        for slot, start, n in zip(self.slots_list, self.starts_list, self.lens_list, strict=True):
            yield slot, self.tokens[at : at + n], start
            at += n

    @classmethod
    def of(
        cls,
        seqs: Rows,
        max_ctx: int | None = None,
        all_logits: Sequence[bool] = (),
    ) -> StepBatch:
        """The host half of a batch of these rows. max_ctx: read this many cache positions instead
        of the least that serves, so shapes stay fixed from step to step (CUDA graphs)."""
        # array('q') fills from the ids in C: 5x a Python list for 32 prompts of 2k tokens
        tokens = array("q", chain.from_iterable(toks for _, toks, _ in seqs))
        return cls.of_lists(
            [int(s) for s, _, _ in seqs],
            [int(st) for _, _, st in seqs],
            [len(t) for _, t, _ in seqs],
            tokens,
            max_ctx,
            tuple(all_logits),
        )

    @classmethod
    def of_lists(
        cls,
        slots_list: list[int],
        starts_list: list[int],
        lens_list: list[int],
        tokens: array[int],
        max_ctx: int | None = None,
        all_logits: tuple[bool, ...] = (),
        sampled: tuple[bool, ...] = (),
        fill_tokens: Callable[[Tensor, Tensor], None] | None = None,
    ) -> StepBatch:
        """The host half from its lists (the engine's builder); checks what every layer relies on."""
        if not slots_list:
            raise ValueError("a StepBatch needs at least one sequence")
        if len(set(slots_list)) != len(slots_list):
            raise ValueError(f"a slot appears twice in one step: {slots_list}")
        if min(lens_list) <= 0:
            raise ValueError("every sequence needs at least one token")
        if min(starts_list) < 0:
            raise ValueError("sequence start positions must be >= 0")
        max_len = max(lens_list)
        # map(add) runs in C: this is on every decode step's host path, graphs or not
        need_ctx = max(map(operator.add, starts_list, lens_list))
        if max_ctx is not None and max_ctx < need_ctx:
            raise ValueError(f"max_ctx {max_ctx} is less than the {need_ctx} positions this step reads")
        tail_from = decode_tail(lens_list) if max_len > 1 else 0
        return cls(
            slots_list,
            starts_list,
            lens_list,
            tokens,
            max_len,
            max_ctx if max_ctx is not None else need_ctx,
            tail_from,
            max(starts_list[tail_from:]) + 1 if tail_from else 0,
            all_logits,
            sampled,
            fill_tokens,
        )

    @classmethod
    def build(
        cls,
        seqs: Rows,
        device: torch.device | str,
        max_ctx: int | None = None,
        all_logits: Sequence[bool] = (),
    ) -> StepBatch:
        """`of` and `place`: a batch the layers can read at once."""
        return cls.of(seqs, max_ctx, all_logits).place(torch.device(device))

    @classmethod
    def over(
        cls,
        tensors: dict[str, Tensor],
        slots_list: list[int],
        starts_list: list[int],
        lens_list: list[int],
        max_ctx: int,
        uses_int8_kv: bool = False,
    ) -> StepBatch:
        """A batch over index tensors already on the device (a graph's static inputs); its lists
        fix shapes and branch choices only."""
        batch = cls(slots_list, starts_list, lens_list, array("q"), max(lens_list), max_ctx)
        batch.uses_int8_kv = uses_int8_kv
        batch._set(tensors, tensors["token_ids"].device)
        return batch

    def place(self, device: torch.device) -> StepBatch:
        """Put the index tensors on `device`, in one copy, and fill the token ids the host does not
        hold (once: a placed batch is returned as is)."""
        if self.placed_on is not None:
            return self
        host = _index_tensors(self.slots_list, self.starts_list, self.lens_list)
        host["token_ids"] = torch.frombuffer(self.tokens, dtype=torch.int64)
        if self.tail_from:
            # Tensors of their own, which to_device_packed aligns (not views at an odd offset of slots).
            host["tail_slots"] = host["slots"][self.tail_from :]
            host["tail_ctx"] = host["starts"][self.tail_from :] + 1
        if any(self.all_logits):
            cu = host["cu_lens"].tolist()
            host["logit_index"] = torch.tensor(
                [
                    i
                    for b, every in enumerate(self.all_logits)
                    for i in range(cu[b] if every else cu[b + 1] - 1, cu[b + 1])
                ],
                dtype=torch.int64,
            )
        self._set(to_device_packed(host, device), device)
        if self.fill_tokens is not None:
            self.fill_tokens(self.token_ids, self.slot_of_token)
        return self

    def _set(self, tensors: dict[str, Tensor], device: torch.device) -> None:
        for name, t in tensors.items():
            setattr(self, name, t)
        self.placed_on = device

    def part(self, lo: int, hi: int) -> StepBatch:
        """The host half of sequences lo .. hi - 1 (a step split over two graphs)."""
        first = sum(self.lens_list[:lo])
        last = first + sum(self.lens_list[lo:hi])
        part = StepBatch.of_lists(
            self.slots_list[lo:hi],
            self.starts_list[lo:hi],
            self.lens_list[lo:hi],
            self.tokens[first:last],
            None,
            self.all_logits[lo:hi],
            self.sampled[lo:hi],
            self.fill_tokens,
        )
        part.uses_int8_kv = self.uses_int8_kv
        return part

    def subset(self, seq_index: Sequence[int]) -> tuple[StepBatch, Tensor]:
        """The batch of sequences seq_index only (in that order), and the index in this batch's
        flat layout of each of its tokens (attention pads decode tokens and chunks apart)."""
        if not seq_index:
            raise ValueError("a subset needs at least one sequence")
        slots_list = [self.slots_list[i] for i in seq_index]
        starts_list = [self.starts_list[i] for i in seq_index]
        lens_list = [self.lens_list[i] for i in seq_index]
        host = _index_tensors(slots_list, starts_list, lens_list)
        first = torch.tensor([0, *accumulate(self.lens_list)], dtype=torch.int64)[list(seq_index)]
        seq_of_token = host["seq_of_token"]
        host["token_index"] = (
            first[seq_of_token] + torch.arange(seq_of_token.shape[0]) - host["cu_lens"][seq_of_token]
        )
        moved = to_device_packed(host, self.device)
        token_index = moved.pop("token_index")
        moved["token_ids"] = self.token_ids.index_select(0, token_index)
        max_ctx = max(map(operator.add, starts_list, lens_list))
        sub = StepBatch.over(moved, slots_list, starts_list, lens_list, max_ctx, self.uses_int8_kv)
        return sub, token_index


# The name the layers and attention have always read a step's batch by.
ForwardBatch = StepBatch


def decode_tail(lens_list: Sequence[int]) -> int:
    """Where a batch's tail of one-token sequences starts, after its last longer one; 0 where it
    has no such tail (no sequence longer than one token, or the last one is)."""
    last_chunk = max((b for b, n in enumerate(lens_list) if n > 1), default=-1)
    return last_chunk + 1 if 0 <= last_chunk < len(lens_list) - 1 else 0


def _index_tensors(slots_list: list[int], starts_list: list[int], lens_list: list[int]) -> dict[str, Tensor]:
    """The host-side index tensors of a batch with these sequences (all but token_ids)."""
    max_len = max(lens_list)
    lens = torch.tensor(lens_list, dtype=torch.int64)
    starts = torch.tensor(starts_list, dtype=torch.int64)
    slots = torch.tensor(slots_list, dtype=torch.int64)
    cu_lens = torch.zeros(len(lens_list) + 1, dtype=torch.int64)
    torch.cumsum(lens, 0, out=cu_lens[1:])
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens_list), dtype=torch.int64), lens)
    offset_in_seq = torch.arange(seq_of_token.shape[0], dtype=torch.int64) - cu_lens[seq_of_token]
    return {
        "positions": starts[seq_of_token] + offset_in_seq,
        "slots": slots,
        "starts": starts,
        "lens": lens,
        "cu_lens": cu_lens,
        "logit_index": cu_lens[1:] - 1,
        "seq_of_token": seq_of_token,
        "slot_of_token": slots[seq_of_token],
        "pad_index": seq_of_token * max_len + offset_in_seq,
    }


def to_device(
    values: Sequence[int] | Sequence[float], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A 1-D tensor of `values` on `device`, queued on its stream. A pageable copy would wait for
    every kernel already queued (the previous step), so the host could not prepare a step while
    the GPU runs one; the caching host allocator keeps the pinned buffer alive until the copy ran."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def column(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a [len, 1] column on `device` (per-row sampling knobs), queued like `to_device`."""
    return to_device(values, dtype, device).unsqueeze(-1)


def to_device_packed(host: dict[str, Tensor], dev: torch.device) -> dict[str, Any]:
    """1-D int64 host tensors on `dev` in one copy (16-byte aligned views of one packed tensor)."""
    if dev.type == "cpu":
        return dict(host)
    # One host-to-device copy instead of ten, pinned and non-blocking as in `to_device`.
    packed, starts = pack_aligned(host.values(), pin=True)
    moved = packed.to(dev, non_blocking=True)
    return {name: moved[at : at + v.shape[0]] for (name, v), at in zip(host.items(), starts, strict=True)}


def pack_aligned(tensors: Iterable[Tensor], pin: bool = False) -> tuple[Tensor, list[int]]:
    """1-D int64 tensors laid end to end, each padded to an even length, and where each starts.
    Every view starts on a 16-byte boundary: Triton compiles a kernel once per pointer alignment,
    and unaligned views recompiled the paged prefill kernel while serving (seconds a step)."""
    parts: list[Tensor] = []
    starts: list[int] = []
    at = 0
    for t in tensors:
        starts.append(at)
        parts.append(t)
        if t.shape[0] % 2:
            parts.append(t.new_zeros(1))
        at += t.shape[0] + t.shape[0] % 2
    return torch.cat(parts, out=torch.empty(at, dtype=parts[0].dtype, pin_memory=pin)), starts


class LayerState(abc.ABC):
    """One decoder layer's state for every slot."""

    @abc.abstractmethod
    def reset(self, slots: Tensor) -> None:
        """Sequences start at position 0 in these slots."""

    @abc.abstractmethod
    def slot_views(self, slot: int) -> tuple[Tensor, ...]:
        """Views (no copy) of the slot's own state: what a checkpoint must copy to resume the slot
        later (empty where the state is shared by reference, as attention blocks are)."""

    @abc.abstractmethod
    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        """Put tensors shaped like `slot_views` (from any slot) into this slot."""

    def roll_back(self, slot: int, row: int, position: int) -> None:
        """After a verify step (`StepBatch.verify`): the slot's state becomes the one its verify row
        `row` had after `position`. None here: attention's rejected KV is cut by the block table."""
        return None

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes this state holds on its device."""


class CausalLM(Protocol):
    """What the engine needs of a model: an `nn.Module` under the HF checkpoint names."""

    config: Any  # the model's frozen config dataclass
    # Whether a prefill graph may pad a lone prompt chunk to its bucket: only where a step's rows
    # meet nowhere but in attention (padding rows could otherwise change a real row).
    prefill_graphs_safe: bool

    def layer_specs(self, kv_dtype_bytes: int) -> list[LayerSpec]:
        """One spec per decoder layer: what its per-slot state costs."""

    def forward(self, batch: ForwardBatch, states: Sequence[LayerState]) -> Tensor:
        """Logits [B, vocab] at each sequence's last token; writes this step's state into states."""
