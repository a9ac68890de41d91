"""Building blocks shared by the architectures: RMSNorm, RoPE (default, linear, llama3; partial
rotary), SwiGLU MLP, and GQA attention over a `PagedKV`, all on the flat [T, hidden] token layout.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F
from ballast.models.base import ForwardBatch, ModelConfigError, UnsupportedModel
from ballast.models.layers import fp8, pointwise
from ballast.models.layers.packed import QuantizedPair, drop_dense
from torch import Tensor, nn

if TYPE_CHECKING:
    from ballast.models.layers.state import PagedKV

DEFAULT_ROPE_THETA = 10000.0


# oneDNN's JIT matmul picks its kernels by CPU features; MKL (torch's float32 BLAS) runs a generic
# non-AVX2 sgemm on AMD CPUs. On a 2-core AMD EPYC over the default model's weights oneDNN measured
# 1.3-1.7x faster for decode rows and 2-3x for prompt chunks up to 512 rows (the CPU's default
# chunk; past that, not measured, torch's BLAS runs). Same float32 FMA, only the summation order differs.
ONEDNN_MAX_ROWS = 512
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_linear_available() -> bool:
    """Whether `linear` can route small float32 CPU batches through oneDNN in this torch build."""
    return _ONEDNN


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear; small float32 batches on the CPU run through oneDNN on the same dense weight (no
    packed copy: the parameters stay the only copy of the weights, as the memory layer counts)."""
    if (
        _ONEDNN
        and x.dim() == 2
        and x.shape[0] <= ONEDNN_MAX_ROWS
        and x.device.type == "cpu"
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and x.is_contiguous()
        and weight.is_contiguous()
    ):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@contextmanager
def bf16_matmuls() -> Iterator[None]:
    """oneDNN's float32 matmuls with bfloat16 inputs and float32 sums and outputs, for the block:
    process-wide, not per thread (only the engine thread computes; the block holds one matmul)."""
    mode = torch.backends.mkldnn.matmul  # type: ignore[attr-defined]  # not in torch's stubs
    before = mode.fp32_precision
    mode.fp32_precision = "bf16"
    try:
        yield
    finally:
        mode.fp32_precision = before


class Linear(nn.Linear):
    """nn.Linear (same parameters, same names) through `linear`."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


def token_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An embedding table left uninitialised (loaders fill it): nn.Embedding's own init imports
    torch._dynamo (about 2 s of a load on a 2-core box, even on the meta device)."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


class RMSNorm(nn.Module):
    """Normalise in float32, scale in the input dtype (as the reference does, for bf16 parity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def add_norm(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """(x + delta, its norm). On the CPU the sum is written into x: the residual stream is a
        step's own tensor, which nothing reads after the add."""
        if x.is_cuda:
            return pointwise.add_rms_norm(x, delta, self.weight, self.eps)  # one kernel
        s = x.add_(delta)
        return s, self(s)

    def forward(self, x: Tensor) -> Tensor:
        if x.is_cuda or x.dtype != torch.float32 or self.weight.dtype != torch.float32:
            return pointwise.rms_norm(x, self.weight, self.eps)  # one kernel on CUDA
        # float32 on the CPU: the reference's maths bit for bit, in place (F.rms_norm's CPU
        # composite took 27 us a 576-wide row against 16 here, 61 times a decode step).
        r = torch.mean(x * x, -1, keepdim=True).add_(self.eps).rsqrt_()
        return torch.mul(x, r).mul_(self.weight)


@dataclass(frozen=True)
class RopeParams:
    rope_type: str = "default"  # default | linear | llama3
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> RopeParams:
        """From `rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling`."""
        params: dict[str, Any] = dict(hf.get("rope_scaling") or {})
        params.update(hf.get("rope_parameters") or {})
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        theta = float(params.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)))
        partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
        if rope_type == "default":
            return cls(theta=theta, partial_rotary_factor=partial)
        if rope_type == "linear":
            return cls("linear", theta, factor=float(params["factor"]), partial_rotary_factor=partial)
        if rope_type == "llama3":
            original = params.get("original_max_position_embeddings", hf.get("max_position_embeddings"))
            if original is None:
                raise ModelConfigError("llama3 rope scaling needs original_max_position_embeddings")
            return cls(
                "llama3",
                theta,
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position_embeddings=int(original),
                partial_rotary_factor=partial,
            )
        raise UnsupportedModel(
            f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)"
        )


def rope_inv_freq(params: RopeParams, head_dim: int) -> Tensor:
    """Inverse frequencies [rotary_dim / 2], float32, for the rope variant in params."""
    dim = int(head_dim * params.partial_rotary_factor)
    # Explicitly on the CPU: models are constructed under `torch.device("meta")`.
    steps = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (params.theta ** (steps / dim))
    if params.rope_type == "linear":
        return inv_freq / params.factor
    if params.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
        # interpolated smoothly, so the model sees familiar frequencies at short range.
        old = params.original_max_position_embeddings
        low_wavelen = old / params.low_freq_factor
        high_wavelen = old / params.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / params.factor, inv_freq)
        smooth = (old / wavelen - params.low_freq_factor) / (params.high_freq_factor - params.low_freq_factor)
        smoothed = (1 - smooth) * scaled / params.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin [T, rotary_dim] for the batch's positions, once per forward. inv_freq is a plain
    attribute, not a buffer: models are built on the meta device and a buffer would stay there."""

    def __init__(self, params: RopeParams, head_dim: int) -> None:
        super().__init__()
        self._inv_freq = rope_inv_freq(params, head_dim)
        self._on_device: dict[torch.device, Tensor] = {}

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        inv = self._on_device.get(positions.device)
        if inv is None:
            inv = self._inv_freq.to(positions.device)
            self._on_device[positions.device] = inv
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _empty_cat(tensors: Sequence[Tensor], device: torch.device | str | None = None) -> Tensor:
    """The shape torch.cat would give, uninitialised, on `device` (default: the tensors')."""
    first = tensors[0]
    return first.new_empty((sum(t.shape[0] for t in tensors), *first.shape[1:]), device=device)


class FusedLinears:
    """Linears that read the same input, run as one matmul. Once fused the parameters (HF names)
    are views into one weight, so copy_ into them fills it; anything that re-creates them (`.to()`,
    `load_state_dict(assign=True)`) breaks the views, and the next call notices (data pointers) and
    fuses again, so a stale weight is never used. FP8 linears fuse their scales too where every
    part is whole blocks, else run one by one. Not a Module: it owns no parameters."""

    def __init__(self, *linears: nn.Linear, transposed: bool = False) -> None:
        self.linears = linears
        # Output as the transpose of W . x^T: for a narrow width not a multiple of 8 (a router's
        # experts + 1 gate) cuBLAS writes rows unvectorised; W . x^T's rows are T wide instead.
        self.transposed = transposed
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        self.scale_inv: Tensor | None = None
        self.block: tuple[int, int] | None = None
        self.separate = False
        self._names: list[str] = []  # the tensors fused, of each linear
        self._ptrs: list[int] = []

    def fuse(self, keep_values: bool = True, device: torch.device | str | None = None) -> None:
        """keep_values=False (parameters not yet loaded) skips copying what they hold; with
        `device` the fused tensors are made there (linears still on the meta device get their
        storage as views of them, and never one of their own)."""
        biases = [lin.bias for lin in self.linears]
        if any(b is None for b in biases) and any(b is not None for b in biases):
            raise ValueError("cannot fuse linears where only some have a bias")
        kinds = {isinstance(lin, fp8.Fp8Linear) for lin in self.linears}
        block = self.block = getattr(self.linears[0], "block", None)
        if len(kinds) > 1 or (block and any(lin.out_features % block[0] for lin in self.linears)):
            self.separate = True
            return
        join = torch.cat if keep_values else functools.partial(_empty_cat, device=device)
        names = self._names = [
            "weight",
            *(["bias"] if biases[0] is not None else []),
            *(["weight_scale_inv"] if block else []),
        ]
        # Outside inference mode: parameters made of inference tensors could not be loaded into later.
        with torch.inference_mode(False), torch.no_grad():
            for name in names:
                whole = join([getattr(lin, name) for lin in self.linears])
                offset = 0
                for lin in self.linears:
                    n = lin.out_features // (block[0] if name == "weight_scale_inv" and block else 1)
                    setattr(lin, name, nn.Parameter(whole[offset : offset + n], requires_grad=False))
                    offset += n
                setattr(self, "scale_inv" if name == "weight_scale_inv" else name, whole)
        self._ptrs = self._current_ptrs()

    @property
    def fused(self) -> bool:
        return self.weight is not None and self._current_ptrs() == self._ptrs

    def _current_ptrs(self) -> list[int]:
        return [getattr(lin, n).data_ptr() for lin in self.linears for n in self._names]

    def outputs(self, x: Tensor) -> list[Tensor]:
        """Each linear's output: views of the one matmul's, or (separate) their own."""
        if self.separate:
            return [lin(x) for lin in self.linears]
        return list(self(x).split([lin.out_features for lin in self.linears], dim=-1))

    def __call__(self, x: Tensor) -> Tensor:
        if self.separate:
            return torch.cat([lin(x) for lin in self.linears], dim=-1)
        if not self.fused:
            self.fuse()
        assert self.weight is not None  # fuse() set it
        if self.scale_inv is not None and self.block is not None:
            return fp8.fp8_linear(x, self.weight, self.scale_inv, self.block, self.bias)
        if self.transposed and self.bias is None and x.dim() == 2:
            return torch.mm(self.weight, x.t()).t()
        return linear(x, self.weight, self.bias)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), HF names gate_proj / up_proj / down_proj."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.intermediate = intermediate
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)
        self.quantized: QuantizedPair | None = None

    def quantize(self, pair: QuantizedPair) -> None:
        """Run gate/up and down through `pair` (the CPU's block linears); the dense weights go."""
        self.quantized = pair
        self.gate_up = FusedLinears(self.gate_proj, self.up_proj)
        drop_dense(self.gate_proj, self.up_proj, self.down_proj)

    def forward(self, x: Tensor) -> Tensor:
        q = self.quantized
        first, second = (self.gate_up, self.down_proj) if q is None else (q.first, q.second)
        return second(pointwise.silu_mul(first(x), self.intermediate))


class Rope(NamedTuple):
    """One step's rotary tables, [T, rotary_dim] each, for every layer."""

    cos: Tensor
    sin: Tensor

    def __call__(self, x: Tensor) -> Tensor:
        return pointwise.rope(x, self.cos, self.sin)


@dataclass(frozen=True)
class LayerStep:
    """What every layer of one forward shares, computed once per step."""

    batch: ForwardBatch
    rope: Rope  # the attention layers' rotary tables


class SlotAttention(nn.Module):
    """Grouped-query attention reading and writing a `PagedKV`. Names follow HF (`self_attn.*`)."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()  # heads are whole KV groups: the config checked it (`decoder.check_dims`)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden, bias=o_bias)
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        # Qwen3 normalises q and k per head before rope.
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.quantized: QuantizedPair | None = None

    def quantize(self, pair: QuantizedPair) -> None:
        """Run q/k/v and o through `pair` (the CPU's block linears); the dense weights go."""
        self.quantized = pair
        self.qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)
        drop_dense(self.q_proj, self.k_proj, self.v_proj, self.o_proj)

    def forward(self, x: Tensor, step: LayerStep, state: PagedKV) -> Tensor:
        hq, hkv, rope = self.num_heads, self.num_kv_heads, step.rope
        q_ = self.quantized
        project, out = (self.qkv, self.o_proj) if q_ is None else (q_.first, q_.second)
        qkv = project(x).view(x.shape[0], hq + 2 * hkv, self.head_dim)
        qk, v = qkv.split((hq + hkv, hkv), dim=1)  # views; one split op where slices are several
        if self.q_norm is not None and self.k_norm is not None:
            q, k = rope(self.q_norm(qkv[:, :hq])), rope(self.k_norm(qkv[:, hq : hq + hkv]))
        else:
            q, k = rope(qk).split((hq, hkv), dim=1)  # q and k heads turned in one go
        state.write(step.batch, k, v)
        return out(state.attend(q, step.batch))
