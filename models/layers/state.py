"""Per-layer, per-slot state behind one small interface ("hybrid is a strategy, not a branch"):
attention layers get a `PagedKV` (blocks of one shared `KVStore`), linear-attention / SSM layers a
`RecurrentState` (fixed size per slot). The engine builds, resets and checkpoints them
(`slot_views` / `load`); the model reads and writes them inside `forward`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from ballast.memory.specs import AttentionSpec, LayerSpec, RecurrentStateSpec
from ballast.models.base import ForwardBatch, LayerState
from ballast.models.kv_store import SCALE_BYTES, SINK_BLOCK, KVStore, plan_layout
from ballast.models.layers.attention import PagedAttentionBackend
from ballast.models.layers.cpu_attention import TorchPagedAttention
from torch import Tensor


def attention_spec(num_kv_heads: int, head_dim: int, kv_dtype_bytes: int) -> AttentionSpec:
    """The spec of one attention layer's cache; 1-byte KV carries per token-head scales."""
    scale = SCALE_BYTES if kv_dtype_bytes == 1 else 0
    return AttentionSpec(
        num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=kv_dtype_bytes, scale_bytes=scale
    )


def paged_attention(
    main: KVStore, int8: KVStore | None = None, int8_slots: Tensor | None = None
) -> PagedAttentionBackend:
    """The attention backend for the stores' device (Triton on CUDA, torch on the CPU). `int8`
    (with `int8_slots`, which slots live there): the ladder's int8 store beside the main one."""
    if main.device.type == "cuda":
        from ballast.models.layers.triton_attention import TritonPagedAttention

        return TritonPagedAttention(main, int8, int8_slots)
    return TorchPagedAttention(main, int8, int8_slots)


class PagedKV(LayerState):
    """One attention layer's view of the KV stores, through the model's one attention backend."""

    def __init__(self, attention: PagedAttentionBackend | KVStore, layer: int) -> None:
        if not isinstance(attention, PagedAttentionBackend):
            attention = paged_attention(attention)  # a store of its own (tests)
        self.attention = attention
        self.store = self.attention.main
        self.layer = layer
        self.layout = self.store.layout
        self._prepares = self.attention.first_layer(layer)

    @property
    def nbytes(self) -> int:
        return sum(s.bytes_held for s in self.attention.stores) // self.layout.num_layers

    def reset(self, slots: Tensor) -> None:
        # Nothing to clear: a sequence only reads positions it wrote, through its own table.
        return None

    def slot_views(self, slot: int) -> tuple[Tensor, ...]:
        # KV is reached through the block table and shared by reference, never copied per slot.
        return ()

    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        if saved:
            raise ValueError("an attention layer's checkpoint holds no tensors (its blocks are shared)")

    def begin(self, batch: ForwardBatch) -> None:
        """A pass that runs this layer alone (a drafting layer's) prepares its batch here; in a
        model's forward the first attention layer does, in `write`."""
        if not self._prepares:
            self.attention.prepare(batch)

    def write(self, batch: ForwardBatch, k: Tensor, v: Tensor) -> None:
        """Store this step's k, v [T, n_kv_heads, head_dim] at every token's (slot, position); the
        engine grows the slot's table to cover it before the step."""
        if self._prepares:
            self.attention.prepare(batch)
        self.attention.write(self.layer, batch, torch.cat((k, v), dim=1))

    def attend(self, q: Tensor, batch: ForwardBatch) -> Tensor:
        """q [T, Hq, D] over its sequence's cache (this step's K/V written) -> [T, Hq * D]."""
        return self.attention.attend(self.layer, q, batch).view(q.shape[0], -1)


class RecurrentState(LayerState):
    """A linear-attention / SSM layer's fixed-size state: conv window [num_slots, *conv_shape] in the
    model dtype and recurrent state [num_slots, *state_shape] in float32 (as the reference keeps it:
    the recurrence accumulates over the whole sequence and bf16 would drift).

    Beside them, sized at load for verify steps of up to `verify_rows` drafting sequences of up to
    `drafts` drafts each (engine.spec): per verify row, the state after each of its first `drafts`
    positions (`kept_states`, the step writes them) and its conv inputs, the K-1 saved before the
    step then its first `drafts` tokens' (`kept_inputs`), since the conv state after position j is
    the last K-1 inputs up to j. `roll_back` takes a slot back to one of them."""

    def __init__(
        self,
        num_slots: int,
        conv_shape: tuple[int, ...],
        state_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device | str,
        state_dtype: torch.dtype = torch.float32,
        verify_rows: int = 0,
        drafts: int = 0,
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"RecurrentState needs num_slots > 0, got {num_slots}")
        self.conv = torch.zeros((num_slots, *conv_shape), dtype=dtype, device=device)
        self.recurrent = torch.zeros((num_slots, *state_shape), dtype=state_dtype, device=device)
        rows = verify_rows if drafts else 0
        self.kept_states = torch.zeros((rows, drafts, *state_shape), dtype=state_dtype, device=device)
        inputs = (*conv_shape[:-1], conv_shape[-1] + drafts)
        self.kept_inputs = torch.zeros((rows, *inputs), dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes + self.kept_states.nbytes + self.kept_inputs.nbytes

    def reset(self, slots: Tensor) -> None:
        # Unlike KV, this state is read whole at every step, so a new sequence must start from zero.
        self.conv.index_fill_(0, slots, 0)
        self.recurrent.index_fill_(0, slots, 0)

    def slot_views(self, slot: int) -> tuple[Tensor, ...]:
        # The same size after any number of tokens: a checkpoint copies it whole.
        return self.conv[slot], self.recurrent[slot]

    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        if len(saved) != 2:
            raise ValueError(f"expected (conv, recurrent), got {len(saved)} tensors")
        # Asynchronous from pinned host memory on CUDA: the caller orders the buffer's later
        # users after this copy on the device (no host sync in a step).
        self.conv[slot].copy_(saved[0], non_blocking=True)
        self.recurrent[slot].copy_(saved[1], non_blocking=True)

    def keep_inputs(self, slots: Tensor, x: Tensor) -> None:
        """A verify step, before its conv: verify row i keeps slot slots[i]'s saved inputs and x[i]
        [n, C], its first n tokens' conv inputs."""
        rows, n = x.shape[0], x.shape[1]
        if rows > self.kept_states.shape[0] or n > self.kept_states.shape[1]:
            raise ValueError(
                f"a verify step of {rows} rows of up to {n} drafts; the workspace holds "
                f"{self.kept_states.shape[0]} of {self.kept_states.shape[1]}"
            )
        hist = self.conv.shape[-1]
        self.kept_inputs[:rows, ..., :hist] = self.conv.index_select(0, slots)
        self.kept_inputs[:rows, ..., hist : hist + n] = x.transpose(1, 2)

    def roll_back(self, slot: int, row: int, position: int) -> None:
        hist = self.conv.shape[-1]
        self.recurrent[slot].copy_(self.kept_states[row, position])
        self.conv[slot].copy_(self.kept_inputs[row, ..., position + 1 : position + 1 + hist])


def build_states(
    specs: Sequence[LayerSpec],
    num_slots: int,
    store: PagedAttentionBackend | KVStore | None,
    device: torch.device | str,
    dtype: torch.dtype,
    verify: tuple[int, int] = (0, 0),
) -> list[LayerState]:
    """One state per decoder layer by its spec: a `PagedKV` over one backend, or a `RecurrentState`
    (with a verify workspace of verify = (rows, drafts), `RecurrentState`'s doc)."""
    states: list[LayerState] = []
    attn = 0
    for spec in specs:
        if isinstance(spec, AttentionSpec):
            if store is None:
                raise ValueError("attention layers need a KV store")
            if not isinstance(store, PagedAttentionBackend):
                store = paged_attention(store)  # one backend for every layer
            states.append(PagedKV(store, attn))
            attn += 1
        elif isinstance(spec, RecurrentStateSpec):
            state_dtype = torch.float32 if spec.state_dtype_bytes == 4 else dtype
            states.append(
                RecurrentState(
                    num_slots, spec.conv_shape, spec.state_shape, dtype, device, state_dtype, *verify
                )
            )
        else:
            raise TypeError(f"no state kind for spec {spec!r}")
    return states


def kv_store_for(
    specs: Sequence[LayerSpec],
    table_rows: int,
    max_len: int,
    device: torch.device | str,
    dtype: torch.dtype,
    quantized_kv: bool = False,
    segment_bytes: int = 0,
) -> KVStore | None:
    """An empty KV store shaped for the attention layers of `specs` (None if there are none).
    Every attention layer must have the same KV heads and head dim."""
    attn = [s for s in specs if isinstance(s, AttentionSpec)]
    if not attn:
        return None
    shapes = {(s.num_kv_heads, s.head_dim) for s in attn}
    if len(shapes) != 1:
        raise ValueError(f"attention layers of different KV shapes {sorted(shapes)} are not supported")
    heads, head_dim = shapes.pop()
    dev = torch.device(device)
    layout = plan_layout(
        len(attn), heads, head_dim, dtype, quantized_kv, table_rows, max_len, dev, segment_bytes=segment_bytes
    )
    return KVStore(layout, dev)


def allocate_states(
    specs: Sequence[LayerSpec],
    num_slots: int,
    max_len: int,
    device: torch.device | str,
    dtype: torch.dtype,
    quantized_kv: bool = False,
) -> list[LayerState]:
    """States for num_slots sequences of up to max_len tokens, every slot's blocks assigned up front
    (block 0 is the sink): for tests, benchmarks and profiling, which run without the allocator."""
    store = kv_store_for(specs, num_slots, max_len, device, dtype, quantized_kv)
    if store is not None:
        lay = store.layout
        for seg in range(lay.max_segments):
            store.add_segment(seg)
        per_slot = lay.max_blocks_per_seq
        for slot in range(num_slots):
            first = SINK_BLOCK + 1 + slot * per_slot
            store.set_table(slot, 0, list(range(first, first + per_slot)))
    return build_states(specs, num_slots, store, device, dtype)


_DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a model dtype (for `layer_specs(kv_dtype_bytes)`)."""
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"unsupported model dtype {dtype}")
    return _DTYPE_BYTES[dtype]
