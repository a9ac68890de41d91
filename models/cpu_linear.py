"""Half-width weights for the CPU's float32 path: each linear's weight held as float16 and run by
FBGEMM's fp16 GEMM (`quantized::linear_dynamic_fp16`), which widens the weights to float32 in
registers and multiplies float32 activations with float32 accumulation and float32 outputs.

Why: a CPU decode step reads every weight once, and on a small model that read is the step (the
default model in float32: 538 MB a token, ~24 of a ~29 ms step on this 2-core box at 1 thread).
float16 halves the bytes; unlike torch's weight-only int4/int8 kernels (bfloat16 activations in
and out) nothing but the weights is rounded, and float16 keeps 11 significant bits against
bfloat16's 8. Measured on the default model against its float32 weights
(bench/cpu_weight_tolerance.py): max |d logit| 0.036 over the parity prompts (int4: 0.98, int8
per output channel: 1.97), the same greedy choices, "Paris" kept; echo logprobs move up to 0.007
nats, past the 1e-3 the lm-eval test holds float32 to, so float32 stays the default and this is
`--cpu-weights fp16`.

FBGEMM takes prompt chunks too: it is float32 FMA at float32 speed there, like the dense path,
and no faster route keeps the tolerance. Widening the float16 weights per chunk into oneDNN's
float32 GEMM was never faster (1 thread, 2026-12-02: 3072x576 at 64 / 256 / 512 rows 1.02 / 4.06 /
8.08 ms against 1.37 / 4.55 / 8.80; 576x1536 at 512 4.20 against 4.44; unpacking FBGEMM's copy
instead: 13.5 ms at 512). int4's prompt rows run 2x faster only because they round activations
to bfloat16 (AVX512-BF16), which is what this form exists to avoid.

The packed weights are FBGEMM's own allocation (a torch script object, not a tensor), so they
are not among the model's parameters or buffers: `packed_bytes` counts them for the memory layer.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


def fp16_available() -> bool:
    """Whether this torch build has FBGEMM's fp16 GEMM (x86 builds; FBGEMM needs AVX2)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(
        torch.ops.quantized, "linear_prepack_fp16"
    )


class Fp16Linear(nn.Module):
    """y = x W^T + b with W held as float16 in FBGEMM's packed layout; x, b and y float32."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None) -> None:
        super().__init__()
        w = weight.detach().float().contiguous()
        self.out_features, self.in_features = int(w.shape[0]), int(w.shape[1])
        b = None if bias is None else bias.detach().float().contiguous()
        self.packed = torch.ops.quantized.linear_prepack_fp16(w, b)
        # FBGEMM holds N x K float16 values (its blocks pad a little more) and the float32 bias.
        self.nbytes = w.numel() * 2 + (0 if b is None else b.numel() * 4)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.dtype != torch.float32:
            raise TypeError(f"an fp16-weight linear takes float32 inputs, got {flat.dtype}")
        y = torch.ops.quantized.linear_dynamic_fp16(flat, self.packed)
        return y.view(*shape[:-1], self.out_features)


def packed_bytes(model: nn.Module) -> int:
    """Bytes the model's fp16 linears hold outside its parameters and buffers."""
    return sum(m.nbytes for m in model.modules() if isinstance(m, Fp16Linear))
