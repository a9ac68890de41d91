"""The gated delta rule (Gated DeltaNet linear attention), for a step of many slots at once.

Per value head the layer keeps a matrix state S [k_dim, v_dim]. For each token, with q and k
L2-normalised and q scaled by k_dim^-1/2:

    S <- exp(g) * S                       (gated decay, g <= 0)
    S <- S + k (beta * (v - S^T k))^T     (delta rule: write only what S does not yet predict)
    o  = S^T q

Decode takes the recurrent form, prefill the chunked (WY / UT-transform) form, which makes
64-token chunks a few matmuls and scans only across chunks; on CUDA with `fla` and a half-precision
model both go to its kernels. The state and recurrence are float32 whatever the model dtype: the
state integrates over the whole sequence and bf16 would drift. `GatedDeltaNet` is the layer around
the rule; architectures subclass it for their input projections.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Protocol

import torch
import torch.nn.functional as F
from ballast.models.base import ForwardBatch, to_device_packed
from ballast.models.kernels import gated_delta_triton
from ballast.models.layers import pointwise
from ballast.models.layers.causal_conv import ConvWindows, causal_conv1d_varlen
from ballast.models.layers.core import FusedLinears, LayerStep, Rope
from ballast.models.layers.state import LayerState, RecurrentState
from torch import Tensor, nn


class LinearAttentionShape(Protocol):
    """What a gated DeltaNet layer reads of its architecture's config (Qwen3-Next's `HybridConfig`)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def linear_conv_kernel_dim(self) -> int: ...
    @property
    def linear_key_head_dim(self) -> int: ...
    @property
    def linear_value_head_dim(self) -> int: ...
    @property
    def linear_num_key_heads(self) -> int: ...
    @property
    def linear_num_value_heads(self) -> int: ...


CHUNK = 64


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, the normalisation fla applies in-kernel.
    As an RMS norm (x / sqrt(mean(x^2) + eps / D)) scaled by 1 / sqrt(D): one fused kernel."""
    dim = x.shape[-1]
    return F.rms_norm(x, (dim,), eps=eps / dim) * dim**-0.5


def _expand_heads(x: Tensor, num_v_heads: int, dim: int) -> Tensor:
    """Grouped value heads: q/k head h serves value heads [h*r, (h+1)*r)."""
    ratio = num_v_heads // x.shape[dim]
    return x if ratio == 1 else x.repeat_interleave(ratio, dim=dim)


def recurrent_gated_delta_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One token for each of B sequences: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state
    [B, Hv, Dk, Dv] -> (o [B, Hv, Dv] in v's dtype, new state float32)."""
    num_v_heads = v.shape[-2]
    q = _expand_heads(l2norm(q.float()), num_v_heads, 1) * q.shape[-1] ** -0.5
    k = _expand_heads(l2norm(k.float()), num_v_heads, 1)
    s = state.float() * g.float().exp()[..., None, None]
    predicted = (k.unsqueeze(-2) @ s).squeeze(-2)  # S^T k: [B, Hv, Dv]
    delta = (v.float() - predicted) * beta.float().unsqueeze(-1)
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    o = (q.unsqueeze(-2) @ s).squeeze(-2)
    return o.to(v.dtype), s


def chunk_gated_delta(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """B sequences of (padded) length L, each from its own initial state: q, k [B, L, Hk, Dk];
    v [B, L, Hv, Dv]; g, beta [B, L, Hv] -> (o [B, L, Hv, Dv] in v's dtype, final state float32).
    Padding must carry g = 0 and beta = 0, so the state passes through it unchanged."""
    batch, length, _, k_dim = k.shape
    num_v_heads, v_dim = v.shape[-2:]
    pad = (-length) % chunk
    n_chunks = (length + pad) // chunk

    def to_chunks(x: Tensor) -> Tensor:
        # [B, L, H, ...] -> [B, H, N, C, ...] float32, zero-padded to whole chunks
        x = x.float().transpose(1, 2)
        x = F.pad(x, (0, pad)) if x.dim() == 3 else F.pad(x, (0, 0, 0, pad))
        return x.reshape(batch, num_v_heads, n_chunks, chunk, *x.shape[3:])

    qc = to_chunks(_expand_heads(l2norm(q.float()), num_v_heads, 2)) * k_dim**-0.5
    kc = to_chunks(_expand_heads(l2norm(k.float()), num_v_heads, 2))
    vc, gc, bc = to_chunks(v), to_chunks(g), to_chunks(beta)

    cum = gc.cumsum(dim=-1)  # log of the decay from the chunk start through each position
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = prod of exp(g) over (j, i] for j <= i, else 0
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()

    k_beta = kc * bc.unsqueeze(-1)
    # UT transform: (I + strict_lower(beta k k^T * decay))^-1 applied to the per-token writes
    system = ((k_beta @ kc.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([vc * bc.unsqueeze(-1), k_beta * cum.exp().unsqueeze(-1)], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :v_dim], solved[..., v_dim:]

    intra = (qc @ kc.transpose(-1, -2)) * decay
    q_decayed = qc * cum.exp().unsqueeze(-1)
    last = cum[..., -1:]
    k_to_end = kc * (last - cum).exp().unsqueeze(-1)
    chunk_decay = last.exp().unsqueeze(-1)  # [B, H, N, 1, 1]

    s = initial_state.float()
    out = torch.empty_like(u)
    for n in range(n_chunks):  # the scan across chunks; tokens inside a chunk are matmuls
        v_new = u[:, :, n] - w[:, :, n] @ s
        out[:, :, n] = q_decayed[:, :, n] @ s + intra[:, :, n] @ v_new
        s = s * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ v_new
    out = out.reshape(batch, num_v_heads, -1, v_dim)[:, :, :length].transpose(1, 2)
    return out.to(v.dtype), s


@dataclass(frozen=True)
class DeltaPlan:
    """How one step's sequences go through the rule: decode tokens the recurrent form together,
    prefill chunks the chunked form together. Built once a step, shared by every layer."""

    decode_seqs: Tensor  # [Bd] sequence indices with one new token
    decode_tokens: Tensor  # [Bd] their token indices in the flat batch
    prefill_seqs: Tensor  # [Bp] sequence indices with several new tokens
    prefill_tokens: Tensor  # [Tp] their token indices, sequence after sequence
    prefill_padded: Tensor  # [Tp] each such token's row in a [Bp * prefill_len] padded layout
    prefill_cu_lens: Tensor  # [Bp + 1] int64, for varlen kernels
    prefill_len: int  # longest prefill run (the padded length)
    all_decode: bool  # every sequence has one token: no regrouping needed
    all_prefill: bool = False  # every sequence has several: no regrouping needed either

    @classmethod
    def build(cls, lens_list: list[int], device: torch.device) -> DeltaPlan:
        if max(lens_list) == 1:  # a decode step: token i is sequence i; no host tensors to copy
            seqs = torch.arange(len(lens_list), device=device)
            none = seqs[:0]
            return cls(seqs, seqs, none, none, none, seqs.new_zeros(1), prefill_len=0, all_decode=True)
        lens = torch.tensor(lens_list, dtype=torch.int64)
        cu = torch.zeros(len(lens_list) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        single = lens == 1
        decode_seqs = single.nonzero().flatten()
        prefill_seqs = (~single).nonzero().flatten()
        p_lens = lens[prefill_seqs]
        p_len = int(p_lens.max()) if len(p_lens) else 0
        local = torch.repeat_interleave(torch.arange(len(p_lens)), p_lens)
        p_cu = torch.zeros(len(p_lens) + 1, dtype=torch.int64)
        torch.cumsum(p_lens, 0, out=p_cu[1:])
        offset = torch.arange(int(p_lens.sum())) - p_cu[local]
        host = {
            "decode_seqs": decode_seqs,
            "decode_tokens": cu[decode_seqs],
            "prefill_seqs": prefill_seqs,
            "prefill_tokens": cu[prefill_seqs][local] + offset,
            "prefill_padded": local * p_len + offset,
            "prefill_cu_lens": p_cu,
        }
        all_prefill = not len(decode_seqs)
        return cls(
            **to_device_packed(host, device), prefill_len=p_len, all_decode=False, all_prefill=all_prefill
        )


@lru_cache(maxsize=1)
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def gated_delta_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    plan: DeltaPlan,
    use_fla: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """The rule over a flat batch: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state
    [B, Hv, Dk, Dv] before this step -> (o [T, Hv, Dv], new state float32). use_fla None: fla
    where it applies."""
    if use_fla is None:  # fla's chunk kernel is CUDA-only and refuses float32 inputs
        use_fla = v.is_cuda and v.dtype in (torch.bfloat16, torch.float16) and fla_installed()
    decode = _fla_decode if use_fla else recurrent_gated_delta_step
    prefill = partial(_fla_prefill if use_fla else _padded_prefill, plan=plan)
    if plan.all_decode:  # the common decode step: sequences are already in order, one token each
        return decode(q, k, v, g, beta, state)
    if plan.all_prefill:  # prompt chunks alone: they too are in order already
        return prefill(q, k, v, g, beta, state)
    out = torch.empty_like(v)
    new_state = torch.empty(state.shape, dtype=torch.float32, device=state.device)
    for idx, seqs, form in (
        (plan.decode_tokens, plan.decode_seqs, decode),
        (plan.prefill_tokens, plan.prefill_seqs, prefill),
    ):
        if seqs.numel():
            out[idx], new_state[seqs] = form(q[idx], k[idx], v[idx], g[idx], beta[idx], state[seqs])
    return out, new_state


def _padded_prefill(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, plan: DeltaPlan
) -> tuple[Tensor, Tensor]:
    # Pad the prefill sequences to one length so they run as one batch; zero g/beta on the
    # padding leaves each state untouched there (see chunk_gated_delta).
    rows = state.shape[0] * plan.prefill_len

    def padded(x: Tensor) -> Tensor:
        buf = x.new_zeros((rows, *x.shape[1:]))
        buf[plan.prefill_padded] = x
        return buf.reshape(state.shape[0], plan.prefill_len, *x.shape[1:])

    o, s = chunk_gated_delta(padded(q), padded(k), padded(v), padded(g), padded(beta), state)
    return o.reshape(rows, *o.shape[2:])[plan.prefill_padded], s


def _fla_prefill(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, plan: DeltaPlan
) -> tuple[Tensor, Tensor]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    hv = v.shape[-2]
    # q/k heads expanded here: only some fla releases support grouped values in-kernel. q, k, v
    # may be views into the conv's output: fla's kernels read contiguous copies.
    o, s = chunk_gated_delta_rule(
        q=_expand_heads(q, hv, 1).contiguous().unsqueeze(0),
        k=_expand_heads(k, hv, 1).contiguous().unsqueeze(0),
        v=v.contiguous().unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.unsqueeze(0),
        initial_state=state.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=plan.prefill_cu_lens,
    )
    return o.squeeze(0).to(v.dtype), s.float()


def _fla_decode(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    hv = v.shape[-2]
    o, s = fused_recurrent_gated_delta_rule(
        q=_expand_heads(q, hv, 1).unsqueeze(1),
        k=_expand_heads(k, hv, 1).unsqueeze(1),
        v=v.unsqueeze(1),
        g=g.float().unsqueeze(1),
        beta=beta.unsqueeze(1),
        initial_state=state.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o.squeeze(1).to(v.dtype), s.float()


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the delta-rule output, then multiplied by silu(z) (one kernel on CUDA)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return pointwise.gated_rms_norm(x, gate, self.weight, self.eps)


@dataclass(frozen=True)
class HybridStep(LayerStep):
    """A hybrid model's `LayerStep`: also what its linear-attention layers share."""

    windows: ConvWindows | None  # every token's conv taps; None where the conv runs in place
    plan: DeltaPlan  # which sequences take the recurrent form and which the chunked one
    has_history: Tensor  # [B] bool: the slot already holds this sequence's earlier tokens
    any_fresh: bool  # some sequence starts at position 0 this step (host-side mirror)
    use_fla: bool | None  # None: fla kernels where they apply (CUDA, half precision, installed)
    # On CUDA (unless use_fla is False: the torch reference everywhere) the conv runs in place in
    # the state pool (`gated_delta_triton.conv_in_place`); in a decode step the rule does too
    # (`in_place`).
    conv_in_place: bool
    in_place: bool

    @classmethod
    def build(cls, batch: ForwardBatch, rope: Rope, conv_kernel: int, use_fla: bool | None) -> HybridStep:
        plan = DeltaPlan.build(batch.lens_list, batch.device)
        kernels = use_fla is not False and gated_delta_triton.available(batch.starts)
        b = batch
        windows = None if kernels else ConvWindows.build(b.cu_lens, b.lens, b.seq_of_token, conv_kernel)
        return cls(
            batch=batch,
            rope=rope,
            windows=windows,
            plan=plan,
            has_history=batch.starts > 0,
            any_fresh=min(batch.starts_list) == 0,
            use_fla=use_fla,
            conv_in_place=kernels,
            in_place=plan.all_decode and kernels,
        )


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet over a `RecurrentState`; subclasses supply the input projections (`in_proj`)."""

    in_proj: FusedLinears

    def __init__(self, cfg: LinearAttentionShape) -> None:
        super().__init__()
        self.k_heads, self.v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.k_dim, self.v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        kernel = cfg.linear_conv_kernel_dim
        self.key_width = self.k_heads * self.k_dim
        self.value_width = self.v_heads * self.v_dim
        self.conv_channels = 2 * self.key_width + self.value_width
        self.conv1d = nn.Conv1d(
            self.conv_channels,
            self.conv_channels,
            kernel,
            groups=self.conv_channels,
            padding=kernel - 1,
            bias=False,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_width, cfg.hidden_size, bias=False)

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x [T, H] -> (q|k|v [T, conv_channels], z [T, Hv, Dv], b [T, Hv], a [T, Hv])."""
        raise NotImplementedError

    def token_divisors(self) -> tuple[int, ...]:
        """Its chunked kernels (fla's and the padded path) count a prompt in CHUNK-token chunks."""
        return (CHUNK,)

    def forward(self, x: Tensor, step: HybridStep, state: LayerState) -> Tensor:
        if not isinstance(state, RecurrentState):
            raise TypeError(f"a linear-attention layer needs a RecurrentState, got {type(state).__name__}")
        t = x.shape[0]
        slots = step.batch.slots
        keep = step.has_history
        qkv, z, b, a = self.project(x)
        weight = self.conv1d.weight.squeeze(1)
        if step.conv_in_place:
            batch = step.batch
            mixed = gated_delta_triton.conv_in_place(
                qkv, state.conv, weight, slots, keep, batch.cu_lens, batch.seq_of_token
            )
        else:
            assert step.windows is not None
            # A sequence at position 0 starts from zero state whatever its slot held before.
            conv0 = state.conv.index_select(0, slots)
            if step.any_fresh:
                conv0 = torch.where(keep[:, None, None], conv0, 0)
            mixed, new_conv = causal_conv1d_varlen(qkv, conv0, weight, step.windows)
            state.conv.index_copy_(0, slots, new_conv)
        q, k, v = mixed.split([self.key_width, self.key_width, self.value_width], dim=-1)
        q = q.reshape(t, self.k_heads, self.k_dim)
        k = k.reshape(t, self.k_heads, self.k_dim)
        v = v.reshape(t, self.v_heads, self.v_dim)
        if step.in_place:  # the recurrent state is float32 by construction (the module doc)
            out = gated_delta_triton.decode_in_place(
                q, k, v, a, b, self.A_log, self.dt_bias, state.recurrent, slots, keep
            )
        else:
            rec0 = state.recurrent.index_select(0, slots)
            if step.any_fresh:
                rec0 = torch.where(keep[:, None, None, None], rec0, 0)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
            out, new_rec = gated_delta_varlen(q, k, v, g, b.sigmoid(), rec0, step.plan, step.use_fla)
            state.recurrent.index_copy_(0, slots, new_rec.to(state.recurrent.dtype))
        return self.out_proj(self.norm(out, z).reshape(t, self.value_width))
