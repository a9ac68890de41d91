"""The live bytes of one prefill chunk, as the attention path that will run holds them (issue 47):
the load estimate and the CPU's profile read it before (or instead of) a measured prefill.

No path here materializes [heads, tokens, context] float32 scores: the CPU attends in place with
torch's flash kernel (models/layers/cpu_attention.py), int8 blocks are gathered and attended by
SDPA, whose CPU kernel is the flash one too (with a mask it holds the mask as float: measured 72
MiB for a 2,048 x 8,192 mask, against 576 MiB of scores), and CUDA runs Triton's paged kernel.

Per path, the largest set of tensors alive at once (bench/load_fit.py sets the total against the
measured peak):
- cpu (KV in the model dtype, in place): per token, q/k/v and their rotated copy, the folded
  queries, the cached prefix's output and its reordered copy, the chunk's own K/V repeated to all
  query heads, the causal part's queries and output, the merge (stacked outputs, their weighted
  copy, the sum) and the output; one sequence's K/V for one layer (gathered where its table is in
  pieces, or copied to bfloat16 for a bfloat16 prompt); the flash kernel's per-thread tiles.
  glibc keeps freed chunks in its heap (its mmap threshold climbs to 32 MiB after the first large
  free), so a chunk's resident peak is CPU_HEAP_FACTOR times its live tensors: at 2,048 tokens
  on the default model 122-144 MiB resident against 63-67 MiB live (with the mmap threshold
  pinned at 64 KiB, each freed tensor returned at once).
- cpu-gathered (int8 blocks): the gathered K/V, the padded queries and output, the mask as bool
  and as float.
- device (CUDA): q/k/v, their rotated copy and the output (the caching allocator returns what a
  layer frees to the next: no heap factor); the GPU profile measures the prefill after load.
Every path adds the residual stream (the stream, the normed input, the pending MLP output), the
MLP (gate/up, their product, the projection back, a dequantized weight slice on the CPU) where it
is larger than attention, and the float32 logits of the chunk's last token.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# Resident bytes of a CPU prefill chunk over its live tensors (glibc's heap keeps what is freed):
CPU_HEAP_FACTOR = 2.3  # the top of the measured 1.8-2.3 (122-144 MiB for 63-67 live): never under
# torch's CPU flash kernel: query rows and keys per tile (aten's cpu_flash_attention).
_Q_TILE, _KV_TILE = 256, 512
# models/layers/cpu_blocks.py: output rows a block linear dequantizes at once for a prompt chunk.
_SLICE_ROWS = 4096


def prefill_path(device_type: str, kv_quant: bool) -> str:
    """The attention path a prefill chunk takes: "device", "cpu" or "cpu-gathered"."""
    if device_type != "cpu":
        return "device"
    return "cpu-gathered" if kv_quant else "cpu"


def activation_bytes(
    hf_config: Mapping[str, Any], tokens: int, context: int, act_bytes: int, path: str = "cpu"
) -> int:
    """Bytes one prefill chunk of `tokens` tokens that attends to `context` positions holds at its
    peak on `path` (`prefill_path`)."""
    h = int(hf_config.get("hidden_size", 0))
    hq = int(hf_config.get("num_attention_heads", 0) or 1)
    hkv = int(hf_config.get("num_key_value_heads", 0) or hq)
    d = int(hf_config.get("head_dim", 0) or (h // hq))
    inter = int(hf_config.get("intermediate_size", 0) or 0)
    moe = int(hf_config.get("moe_intermediate_size", 0) or 0) * int(
        hf_config.get("num_experts_per_tok", 0) or 0
    )
    inter = max(inter, moe + int(hf_config.get("shared_expert_intermediate_size", 0) or 0))
    logits = int(hf_config.get("vocab_size", 0)) * 4
    residual = 3 * tokens * h * act_bytes
    mlp = tokens * (3 * inter + h) * act_bytes
    qkv = tokens * (2 * hq + 3 * hkv) * d * act_bytes  # q/k/v and the rotated q/k
    if path == "device":
        return residual + max(qkv + tokens * (hq * d + h) * act_bytes, mlp) + logits
    one_layer_kv = context * 2 * hkv * d * act_bytes
    if path == "cpu":
        # folded q 1, prefix out and its copy 2, repeated own K/V 2, causal q and out 2, merge 5, out 1
        attention = qkv + tokens * (13 * hq + 2 * hkv) * d * act_bytes
        tiles = torch.get_num_threads() * _Q_TILE * (_KV_TILE + d + 2) * 4
        mlp += min(_SLICE_ROWS, 2 * inter) * h * 4
        live = residual + max(attention, mlp)
        return int(CPU_HEAP_FACTOR * live) + one_layer_kv + tiles + logits
    # cpu-gathered: padded q and output, gathered K/V, the mask as bool and float
    attention = qkv + tokens * 2 * hq * d * act_bytes + one_layer_kv + tokens * context * 5
    mlp += min(_SLICE_ROWS, 2 * inter) * h * 4
    return int(CPU_HEAP_FACTOR * (residual + max(attention, mlp))) + logits
