"""A GGUF's Q4_0 / Q4_1 / Q8_0 linears multiplied as the file stores them, in float32, on the CPU
(`--cpu-weights blocks`, the default where it builds): the kernel is models/kernels/cpu_blocks.c.

A CPU decode step is its weight read: the default model in float32 reads 538 MB a token, its
block records 112 MB. A block's weights are `d * q + m`: the kernel makes each block those float32
values once (the dense path's, exactly) and multiplies them by the float32 inputs of up to
BLOCK_MAX_ROWS rows, the dense path's products in another order of additions (the default model's
logits within 1e-4 of transformers'); a row's outputs do not depend on the rows beside it. Steps
of more rows (prompt chunks) dequantize slices of the weight for the dense GEMM.
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Sequence
from typing import Any

import torch
from ballast.models.base import ForwardBatch
from ballast.models.kernels.cpu_kernel import Stack, library
from ballast.models.kv_store import KVStore
from ballast.models.layers.core import bf16_matmuls, linear
from ballast.models.layers.packed import GROUP, Q4Weight, Q8Weight
from torch import Tensor, nn

# Rows a step multiplies straight from the blocks; more (prompt chunks) go through float32 slices.
# At 8 rows the kernel and the dense GEMM on cached float32 weights meet (3072x576, 1 thread).
BLOCK_MAX_ROWS = 8
# Outputs dequantized at once for a prompt chunk: a 4,096 x 576 slice is 9 MB of float32.
_SLICE_ROWS = 4096


def _records(*fields: Tensor) -> Tensor:
    """[N, K / 32, bytes] uint8: each block's fields side by side, as the kernel's structs."""
    n, nb = fields[0].shape[:2]
    return torch.cat([f.contiguous().view(torch.uint8).reshape(n, nb, -1) for f in fields], dim=-1)


class BlockLinear(nn.Module):
    """y = x W^T for W held as the file's blocks: one or more Q4 weights stacked along N (q/k/v,
    or gate/up: one matmul), or one Q8_0 weight (the output head). x float32 (prompt rows may be
    bfloat16: they run through float32 slices)."""

    def __init__(self, weight: Sequence[Q4Weight] | Q8Weight) -> None:
        super().__init__()
        if isinstance(weight, Q8Weight):
            n, k = weight.q.shape
            self.q4 = False
            packed = _records(weight.scale, weight.q.view(n, k // GROUP, GROUP))
        else:
            n = sum(int(p.qs.shape[0]) for p in weight)
            k = int(weight[0].qs.shape[1]) * 2
            self.q4 = True
            qs = torch.cat([p.qs for p in weight]).view(n, k // GROUP, GROUP // 2)
            scale, minimum = (torch.cat([getattr(p, f) for p in weight]) for f in ("scale", "minimum"))
            packed = _records(scale, minimum, qs)
        self.blocks: Tensor
        self.register_buffer("blocks", packed.reshape(n, -1))
        self.out_features, self.in_features = n, k
        # --cpu-prefill bfloat16 (models/blocks/cpu_linear.py): steps of more rows than bf16_rows run their
        # GEMMs in bfloat16 (0: never), with bf16_out their output kept bfloat16 (the q/k/v
        # projection: attention follows it).
        self.bf16_rows = 0
        self.bf16_out = False

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.shape[0] > BLOCK_MAX_ROWS:  # a prompt's (bfloat16 after a bfloat16 attention)
            y = self._through_slices(flat.float())
        elif flat.dtype != torch.float32:
            raise TypeError(f"a block linear takes float32 decode rows, got {flat.dtype}")
        else:
            y = self._from_blocks(flat.contiguous())
        return y.view(*shape[:-1], self.out_features)

    def _from_blocks(self, x: Tensor) -> Tensor:
        lib = library()
        assert lib is not None  # the form is only chosen where it built
        rows, k, n, threads = x.shape[0], self.in_features, self.out_features, torch.get_num_threads()
        y = torch.empty(rows, n)
        multiply = lib.q4_matmul if self.q4 else lib.q8_matmul
        multiply(x.data_ptr(), rows, k, self.blocks.data_ptr(), n, y.data_ptr(), threads)
        return y

    def dequantize(self, start: int = 0, stop: int | None = None) -> Tensor:
        """Rows start .. stop of W as float32 (the values the dense path holds)."""
        lib = library()
        assert lib is not None
        stop = self.out_features if stop is None else stop
        w = torch.empty(stop - start, self.in_features)
        fn = lib.q4_dequantize if self.q4 else lib.q8_dequantize
        fn(
            self.blocks[start].data_ptr(),
            stop - start,
            self.in_features,
            w.data_ptr(),
            torch.get_num_threads(),
        )
        return w

    def _through_slices(self, x: Tensor) -> Tensor:
        """Many rows: each slice of outputs dequantized to float32, then the dense GEMM."""
        n = self.out_features
        bf16 = 0 < self.bf16_rows < x.shape[0]
        parts = []
        for start in range(0, n, _SLICE_ROWS):
            w = self.dequantize(start, min(n, start + _SLICE_ROWS))
            if bf16:
                with bf16_matmuls():
                    parts.append(torch.mm(x, w.t()))
            else:
                parts.append(linear(x, w))
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return y.to(torch.bfloat16) if bf16 and self.bf16_out else y


# A step that waited this share of its time for its extra threads (another process has their cores)
# runs the next CALM_S seconds on the engine's threads alone, doubling to CALM_MAX_S while held up.
HELD_UP_SHARE = 0.5
CALM_S, CALM_MAX_S = 1.0, 8.0


class DecodeThreads:
    """The one-call decode step's threads: the engine's intra-op count, up to `ceiling` (every CPU
    the process may use, engine/threads.py) while the extra ones keep up: a core another process
    holds costs a probe step now and then (one stream 64 -> 96 tok/s on 2 idle CPUs over HTTP)."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling, self._alone_until, self._calm = ceiling, 0.0, CALM_S

    def count(self, now: float) -> int:
        floor = torch.get_num_threads()
        return max(floor, self.ceiling) if now >= self._alone_until else floor

    def settle(self, threads: int, wall: float, held_up: float, now: float) -> None:
        """After a step of `wall` seconds on `threads`, `held_up` of them waiting for the others."""
        if threads > torch.get_num_threads() and held_up > HELD_UP_SHARE * wall:
            self._alone_until, self._calm = now + self._calm, min(2 * self._calm, CALM_MAX_S)
        elif threads > torch.get_num_threads():
            self._calm = CALM_S


def _layer_tensors(layer: Any) -> tuple[Tensor, ...]:
    """A layer's q/k/v, o, gate/up and down blocks and its two norms' weights, as the kernel reads them."""
    a, m = layer.self_attn.quantized, layer.mlp.quantized
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (a.first.blocks, a.second.blocks, m.first.blocks, m.second.blocks, *(n.weight for n in norms))


class BlockDecoder:
    """A decode step through a Llama stack whose every linear (and head) is blocks in one kernel
    call (llama_decode, models/kernels/cpu_blocks.c), not ~150 small torch ops a layer around the matmuls
    (half of a one-row step of the default model): steps of decode tokens (and verify rows, whose
    every token is scored) up to BLOCK_MAX_ROWS tokens, over a float32 CPU store; the model runs
    others through its layers."""

    def __init__(self, layers: Sequence[Any], head: BlockLinear, norm: Tensor, *shape: int | float) -> None:
        """shape: heads, kv_heads, head_dim, RMSNorm's eps, and the most threads (DecodeThreads)."""
        heads, kv_heads, head_dim, eps, threads = shape
        self.threads = DecodeThreads(int(threads))
        # what the kernel reads by address, held here: the head, the final norm, each layer's tensors
        self._tensors = [head.blocks, norm] + [t for layer in layers for t in _layer_tensors(layer)]
        self._weights = torch.tensor([t.data_ptr() for t in self._tensors[2:]], dtype=torch.int64)
        down = layers[0].mlp.down_proj
        sizes = (len(layers), down.out_features, heads, kv_heads, head_dim, down.in_features, 0, eps)
        tables = (self._weights.data_ptr(), 0, 0, 0, 0, head.blocks.data_ptr(), head.out_features, head.q4)
        self._stack = Stack(*sizes, head_dim**-0.5, *tables, norm.data_ptr())

    def serves(self, batch: ForwardBatch, stores: Sequence[KVStore]) -> bool:
        """Whether the step `batch`, over `stores` (its attention backend's `step_stores`), is one."""
        host = stores[0].host if len(stores) == 1 else None
        # The kernel writes every token's K/V before any attends, and returns every token's logits:
        # a sequence's several tokens (a speculative verify row, logits at each) run in it too.
        every = batch.all_logits or (False,) * batch.num_seqs
        rows = batch.decode_only or all(n == 1 or e for n, e in zip(batch.lens_list, every, strict=True))
        short = rows and batch.num_tokens <= BLOCK_MAX_ROWS
        return short and host is not None and host.kv.dtype == torch.float32

    def __call__(self, h: Tensor, batch: ForwardBatch, cos: Tensor, sin: Tensor, store: KVStore) -> Tensor:
        """Float32 logits [T, vocab] of h [T, hidden] float32, the embedded tokens (overwritten);
        this step's K/V are written to `store`."""
        lib, s, host = library(), self._stack, store.host
        assert lib is not None and host is not None and all(t.is_contiguous() for t in (h, cos, sin))
        s.kv, s.kv_layer, s.block_size = host.kv.data_ptr(), host.kv[0].numel(), store.layout.block_size
        s.table, s.table_width = store.block_table.data_ptr(), store.block_table.shape[1]
        stack, rows = ctypes.addressof(s), h.shape[0]
        work = torch.empty(lib.llama_decode_work(stack, rows, batch.max_ctx))
        logits = torch.empty(rows, s.vocab)
        tensors = (h, cos, sin, batch.slot_of_token, batch.positions, work, logits)
        threads = self.threads.count(start := time.monotonic())
        lib.llama_decode(stack, rows, *(t.data_ptr() for t in tensors), threads)
        self.threads.settle(threads, (now := time.monotonic()) - start, lib.blocks_held_up(), now)
        return logits
