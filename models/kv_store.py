"""Where attention KV lives: fixed-size blocks, for every attention layer of a model, in segments
that come and go, and a block table per slot (which block is whose, the engine's allocator decides).

Block size 32: a multiple of 16, so the CUDA kernels' tiles are whole blocks; a sequence wastes
under 32 positions, and an 8k-token sequence's table is 256 entries.

Segments let the pool grow and give memory back while serving. CPU: one MAP_NORESERVE mapping
reserves every block the limits allow, [layer, block, pos, 2 * kv_heads, head_dim]; a segment's
pages are committed when written and returned with madvise(MADV_DONTNEED). CUDA: one allocation
per segment [block, layer, pos, ...], found by kernels through the device table `kv_ptrs`, so
captured graphs stay valid as segments come and go. K heads come before V heads; int8 blocks
carry a float32 scale per (position, head) row.
"""

from __future__ import annotations

import contextlib
import math
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import Tensor

BLOCK_SIZE = 32
# Block 0 of every store is never handed to a sequence: a table row of zeros (a slot with no blocks
# in this store) points there, so a step may write and read every slot in every store with fixed
# shapes (and in captured graphs) and what lands in the sink is never read as anyone's KV.
SINK_BLOCK = 0
_PAGE = mmap.PAGESIZE
_INT8_MAX = 127.0
SCALE_BYTES = 4


@dataclass(frozen=True)
class StoreOp:
    """One change a `KVStore` made, recorded so another rank's store of its layout can `replay` it."""

    change: Callable[..., None]  # the KVStore method that made it (add_segment, set_table, ...)
    args: tuple[Any, ...]
    store: int = 0  # which of the model's stores made it (its `journal_index`)

    @property
    def kind(self) -> str:
        return self.change.__name__


@dataclass(frozen=True)
class KVLayout:
    """The shape of a model's KV store; fixed at load."""

    num_layers: int  # attention layers
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's: queries and dequantized K/V
    quantized: bool  # int8 blocks with float32 scales
    block_size: int
    seg_blocks: int
    max_segments: int
    table_rows: int  # slots, the graphs' scratch slot included
    max_blocks_per_seq: int

    def __post_init__(self) -> None:
        if min(getattr(self, f.name) for f in fields(self) if f.type == "int") < 1:  # every count
            raise ValueError(f"invalid KVLayout {self}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8 if self.quantized else self.dtype

    @property
    def row_width(self) -> int:
        """K and V heads of one position: rows of head_dim."""
        return 2 * self.num_kv_heads

    @property
    def block_layer_parts(self) -> list[int]:
        """Bytes of one block of one layer in each tensor: K/V data, and scales when int8."""
        rows = self.block_size * self.row_width
        return [rows * self.head_dim * self.storage_dtype.itemsize] + (
            [rows * SCALE_BYTES] if self.quantized else []
        )

    @property
    def block_layer_bytes(self) -> int:
        return sum(self.block_layer_parts)

    @property
    def block_bytes(self) -> int:
        """One block across every attention layer: what a sequence pays per block_size positions."""
        return self.num_layers * self.block_layer_bytes

    @property
    def segment_bytes(self) -> int:
        return self.seg_blocks * self.block_bytes

    @property
    def capacity_blocks(self) -> int:
        return self.seg_blocks * self.max_segments


def plan_layout(
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    quantized: bool,
    table_rows: int,
    max_model_len: int,
    device: torch.device,
    *,
    block_size: int = BLOCK_SIZE,
    segment_bytes: int = 0,
) -> KVLayout:
    """A layout whose segments hold about `segment_bytes` (default 64 MiB on CPU, 256 MiB on CUDA:
    growing is rare, a shrink gives back a useful share), with room for every slot at max_model_len."""
    probe = KVLayout(num_layers, num_kv_heads, head_dim, dtype, quantized, block_size, 1, 1, table_rows, 1)
    target = segment_bytes or ((256 if device.type == "cuda" else 64) << 20)
    seg_blocks = max(2, target // probe.block_bytes)  # at least one block besides the sink
    if device.type == "cpu":
        # madvise works on whole pages: every layer's share of a segment must be page aligned.
        unit = math.lcm(*(_PAGE // math.gcd(n, _PAGE) for n in probe.block_layer_parts))
        seg_blocks = -(-seg_blocks // unit) * unit
    per_seq = -(-max_model_len // block_size)
    max_segments = max(1, -(-(per_seq * table_rows + 1) // seg_blocks))  # + the sink
    return replace(probe, seg_blocks=seg_blocks, max_segments=max_segments, max_blocks_per_seq=per_seq)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric int8 with one float32 scale per row of the last dim (per position-head)."""
    scale = x.detach().abs().amax(dim=-1).float().clamp_min(1e-8) / _INT8_MAX
    q = torch.round(x.float() / scale[..., None]).clamp_(-_INT8_MAX, _INT8_MAX).to(torch.int8)
    return q, scale


class _HostMemory:
    """CPU storage: [layer, capacity block, pos, row, head_dim] over one reserved mapping."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        cap = layout.capacity_blocks
        shape = (layout.num_layers, cap, layout.block_size, layout.row_width)
        self._maps: list[mmap.mmap] = []
        self.kv = self._reserve((*shape, layout.head_dim), layout.storage_dtype)
        self.scale = self._reserve(shape, torch.float32) if layout.quantized else None

    def _reserve(self, shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
        m = mmap.mmap(-1, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._maps.append(m)
        return torch.frombuffer(m, dtype=dtype).view(shape)

    def tensors(self) -> list[Tensor]:
        return [self.kv] if self.scale is None else [self.kv, self.scale]

    def add_segment(self, seg: int) -> None:
        """Write a new segment's pages now: under MAP_NORESERVE unwritten pages are no memory, so
        the host's figures would show the grant only once filled (granting it again meanwhile)."""
        lo, hi = seg * self.layout.seg_blocks, (seg + 1) * self.layout.seg_blocks
        for t in self.tensors():
            t[:, lo:hi].zero_()

    def release_segments(self, segs: Sequence[int]) -> None:
        """Give the segments' pages back to the OS (they read as zeros if touched again)."""
        lay = self.layout
        for seg in segs:
            for m, t in zip(self._maps, self.tensors(), strict=True):
                layer_bytes = t[0].numel() * t.element_size()
                seg_bytes = lay.seg_blocks * t[0, 0].numel() * t.element_size()
                for layer in range(lay.num_layers):
                    m.madvise(mmap.MADV_DONTNEED, layer * layer_bytes + seg * seg_bytes, seg_bytes)

    def block(self, block: int) -> list[Tensor]:
        return [t[:, block] for t in self.tensors()]

    def close(self) -> None:
        self.kv = self.scale = None  # type: ignore[assignment]
        for m in self._maps:
            with contextlib.suppress(BufferError):  # a view is still alive: the mapping goes with it
                m.close()
        self._maps.clear()


class _DeviceMemory:
    """CUDA storage: one allocation per live segment, found through base-address tables."""

    def __init__(self, layout: KVLayout, device: torch.device) -> None:
        self.layout = layout
        self.device = device
        self.kv_ptrs = torch.zeros(layout.max_segments, dtype=torch.int64, device=device)
        self.scale_ptrs = torch.zeros(layout.max_segments, dtype=torch.int64, device=device)
        self.segments: dict[int, tuple[Tensor, Tensor | None]] = {}

    def add_segment(self, seg: int) -> None:
        lay = self.layout
        shape = (lay.seg_blocks, lay.num_layers, lay.block_size, lay.row_width)
        kv = torch.empty((*shape, lay.head_dim), dtype=lay.storage_dtype, device=self.device)
        scale = torch.empty(shape, dtype=torch.float32, device=self.device) if lay.quantized else None
        self.segments[seg] = (kv, scale)
        self.kv_ptrs[seg] = kv.data_ptr()
        self.scale_ptrs[seg] = scale.data_ptr() if scale is not None else kv.data_ptr()

    def release_segments(self, segs: Sequence[int]) -> None:
        for seg in segs:
            self.kv_ptrs[seg] = 0
            self.scale_ptrs[seg] = 0
            del self.segments[seg]
        if segs:
            torch.cuda.empty_cache()  # back to the driver, where other processes can have it

    def block(self, block: int) -> list[Tensor]:
        """Views of one block (every layer) in each tensor of its segment."""
        seg, local = divmod(block, self.layout.seg_blocks)
        kv, scale = self.segments[seg]
        return [kv[local]] if scale is None else [kv[local], scale[local]]

    def close(self) -> None:
        self.segments.clear()


class KVStore:
    """The memory of every attention layer's KV blocks and the slots' block tables."""

    def __init__(self, layout: KVLayout, device: torch.device | str) -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.block_table = torch.zeros(
            (layout.table_rows, layout.max_blocks_per_seq), dtype=torch.int32, device=self.device
        )
        # The memory's kind is chosen once; `host` / `cuda` name it for the backend that reads it.
        self.cuda = _DeviceMemory(layout, self.device) if self.device.type == "cuda" else None
        self.host = None if self.cuda is not None else _HostMemory(layout)
        self._memory: _HostMemory | _DeviceMemory = self.cuda or self.host  # type: ignore[assignment]
        self.live_segments: set[int] = set()
        # Set (to a list) where other ranks mirror this store: every change is appended as a
        # StoreOp tagged with journal_index (stores may share one journal, kept in order).
        self.journal: list[Any] | None = None
        self.journal_index = 0

    def _record(self, change: Callable[..., None], *args: Any) -> None:
        if self.journal is not None:
            self.journal.append(StoreOp(change, args, self.journal_index))

    def replay(self, op: StoreOp) -> None:
        """Make the change another store recorded (same layout, same block ids)."""
        op.change(self, *op.args)

    @property
    def bytes_held(self) -> int:
        return len(self.live_segments) * self.layout.segment_bytes

    def add_segment(self, seg: int) -> None:
        self._record(KVStore.add_segment, seg)
        self._memory.add_segment(seg)
        self.live_segments.add(seg)

    def release_segments(self, segs: Sequence[int]) -> None:
        self._record(KVStore.release_segments, tuple(segs))
        self.live_segments.difference_update(segs)
        self._memory.release_segments(segs)

    def clear_table(self, slot: int) -> None:
        """The slot holds no block here: its row points at the sink block (see `SINK_BLOCK`)."""
        self._record(KVStore.clear_table, slot)
        self.block_table[slot].zero_()

    def set_table(self, slot: int, start: int, blocks: Sequence[int]) -> None:
        """Table entries start.. of the slot's row become `blocks` (one small host-to-device copy)."""
        self._record(KVStore.set_table, slot, start, tuple(blocks))
        if blocks:
            # Pinned and non-blocking on CUDA: a pageable copy would wait for the step on the GPU.
            on_gpu = self.block_table.is_cuda
            host = torch.tensor(blocks, dtype=torch.int32, pin_memory=on_gpu)
            self.block_table[slot, start : start + len(blocks)].copy_(host, non_blocking=on_gpu)

    def block_views(self, block: int) -> list[Tensor]:
        """Views of one block across every layer (K/V, and int8 scales): what parking copies."""
        return self._memory.block(block)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy a whole block (every layer), e.g. copy on write of a shared partial block."""
        self._record(KVStore.copy_block, src, dst)
        for d, s in zip(self._memory.block(dst), self._memory.block(src), strict=True):
            d.copy_(s)

    def close(self) -> None:
        self._memory.close()
        self.live_segments.clear()
