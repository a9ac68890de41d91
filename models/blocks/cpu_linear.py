"""bfloat16 prompt chunks on the CPU (`--cpu-prefill bfloat16`, `hold_prompt_bf16`): steps of more than
PROMPT_BF16_MIN_ROWS rows round each linear's inputs and weights to bfloat16 with float32 sums and
outputs (oneDNN's bf16 "fpmath" mode over the float32 weights: no second copy), which AMX /
AVX512-BF16 multiply several times faster (3072x576 at 512 rows: 1.6 ms against 11.4). The q/k/v
output stays bfloat16, so attention runs in bfloat16 too (models/layers/cpu_attention.py follows its
queries' dtype). Decode steps and short prompts keep float32 bit for bit. Opt-in: it costs accuracy
(bench/cpu_weight_tolerance.py).
"""

from __future__ import annotations

from functools import cache

import torch
from ballast.models.layers.core import SlotAttention, SwiGLU, bf16_matmuls, linear
from ballast.models.layers.cpu_blocks import BlockLinear
from ballast.models.layers.packed import QuantizedPair
from torch import Tensor, nn

# Steps of more rows than this run their linears in bfloat16 under `hold_prompt_bf16`: prompt
# chunks, not decode batches of up to 64 sequences (which keep float32's exact sums).
PROMPT_BF16_MIN_ROWS = 64


@cache
def bf16_available() -> bool:
    """Whether a float32 matmul under `bf16_matmuls` really rounds to bfloat16 on this CPU: one with
    native bfloat16 arithmetic (AVX512-BF16 or AMX) whose oneDNN takes the mode. It is not enough to
    read the flags: a CPU with AVX512-BF16 and no AMX has run the product in float32 (CI, 2026-12),
    so one small product is tried and must differ from float32."""
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    if not (torch.backends.mkldnn.is_available() and native):
        return False
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(PROMPT_BF16_MIN_ROWS + 36, 96, generator=gen)
    w = torch.randn(96, 192, generator=gen)
    with bf16_matmuls():
        got = torch.mm(x, w)
    rounded = x.bfloat16().float() @ w.bfloat16().float()
    return float((got - rounded).abs().max()) < float((got - x @ w).abs().max())


class PromptLinear(nn.Module):
    """y = x W^T + b over a dense float32 W: rows past PROMPT_BF16_MIN_ROWS in bfloat16 (float32
    sums, and float32 out unless bf16_out), fewer rows as `layers.linear`, float32 exactly."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, bf16_out: bool = False) -> None:
        super().__init__()
        self.weight: Tensor
        self.bias: Tensor | None
        self.register_buffer("weight", weight.detach())  # the loaded tensor itself, no copy
        self.register_buffer("bias", None if bias is None else bias.detach())
        self.out_features = int(weight.shape[0])
        self.bf16_out = bf16_out

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.shape[0] <= PROMPT_BF16_MIN_ROWS and flat.dtype == self.weight.dtype:
            y = linear(flat, self.weight, self.bias)
        else:
            with bf16_matmuls():
                if self.bias is None:
                    y = torch.mm(flat.float(), self.weight.t())
                else:
                    y = torch.addmm(self.bias, flat.float(), self.weight.t())
            if self.bf16_out and flat.shape[0] > PROMPT_BF16_MIN_ROWS:
                y = y.to(torch.bfloat16)
        return y.view(*shape[:-1], self.out_features)


def hold_prompt_bf16(model: nn.Module) -> int:
    """Run every dense attention and MLP block's linears as PromptLinears (q/k/v with bfloat16
    outputs for prompt rows); block linears (models/layers/cpu_blocks.py) run their dequantized slices in
    bfloat16, q/k/v out bfloat16. The output head stays as it is (a prompt's logits are one row
    per sequence, and echo logprobs keep its arithmetic). Returns the blocks changed."""
    changed = 0
    for block in model.modules():
        if not isinstance(block, (SlotAttention, SwiGLU)):
            continue
        attention = isinstance(block, SlotAttention)
        pair = block.quantized
        if pair is None:
            fused, second = (block.qkv, block.o_proj) if attention else (block.gate_up, block.down_proj)
            fused.fuse()  # from the parameters as loaded (assign=True replaced the fused views)
            assert fused.weight is not None
            first = PromptLinear(fused.weight, fused.bias, bf16_out=attention)
            block.quantize(QuantizedPair(first, PromptLinear(second.weight, second.bias)))
        elif isinstance(pair.first, BlockLinear) and isinstance(pair.second, BlockLinear):
            pair.first.bf16_rows = pair.second.bf16_rows = PROMPT_BF16_MIN_ROWS
            pair.first.bf16_out = attention
        else:
            continue
        changed += 1
    return changed
