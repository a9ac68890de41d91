"""The gated delta rule (Gated DeltaNet linear attention), for a step of many slots at once.

Per value head the layer keeps a matrix state S [k_dim, v_dim]. For each token, with q and k
L2-normalised and q scaled by k_dim^-1/2:

    S <- exp(g) * S                       (gated decay, g <= 0)
    S <- S + k (beta * (v - S^T k))^T     (delta rule: write only what S does not yet predict)
    o  = S^T q

Decode takes the recurrent form, prefill the chunked (WY / UT-transform) form, which makes
64-token chunks a few matmuls and scans only across chunks (`delta_rule`); on CUDA with `fla` and a
half-precision model prefill goes to its kernels, decode to ours (`gated_delta_triton`). A verify
row (a decode and its drafts, `StepBatch.verify`) takes the recurrent form token by token and keeps
the state after each position in the slot state's verify workspace, for the rollback. The state
and recurrence are float32 whatever the model dtype: the state integrates over the whole sequence
and bf16 would drift. `GatedDeltaNet` is the layer around the rule; architectures subclass it for
their input projections.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from typing import Protocol

import torch
import torch.nn.functional as F
from ballast.models.base import ForwardBatch, to_device_packed
from ballast.models.blocks.delta_rule import (
    CHUNK,
    chunk_gated_delta,
    fla_decode,
    fla_installed,
    fla_prefill,
    recurrent_gated_delta_rows,
    recurrent_gated_delta_step,
)
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


@dataclass(frozen=True)
class DeltaPlan:
    """How one step's sequences go through the rule: decode tokens the recurrent form together,
    verify rows the recurrent form token by token (padded to one length, like prefill chunks),
    prefill chunks the chunked form together. Built once a step, shared by every layer."""

    decode_seqs: Tensor  # [Bd] sequence indices with one new token
    decode_tokens: Tensor  # [Bd] their token indices in the flat batch
    prefill_seqs: Tensor  # [Bp] sequence indices with several new tokens
    prefill_tokens: Tensor  # [Tp] their token indices, sequence after sequence
    prefill_padded: Tensor  # [Tp] each such token's row in a [Bp * prefill_len] padded layout
    prefill_cu_lens: Tensor  # [Bp + 1] int64, for varlen kernels
    prefill_len: int  # longest prefill run (the padded length)
    all_decode: bool  # every sequence has one token: no regrouping needed
    all_prefill: bool = False  # every sequence is a prefill chunk: no regrouping needed either
    verify_seqs: Tensor | None = None  # [Bv] the verify rows (StepBatch.verify), in batch order
    verify_tokens: Tensor | None = None  # [Tv] their token indices, row after row
    verify_padded: Tensor | None = None  # [Tv] each one's row in a [Bv * verify_len] padded layout
    verify_len: int = 0

    @classmethod
    def build(
        cls, lens_list: list[int], device: torch.device, verify: tuple[bool, ...] = (), in_place: bool = False
    ) -> DeltaPlan:
        """in_place: a step of decode and verify rows alone that the in-place kernel runs from the
        batch's own index tensors: nothing to regroup, so no host tensor is copied (a verify graph
        captures this step)."""
        one_each = max(lens_list) == 1
        if one_each or in_place:  # a decode step: token i is sequence i; no host tensors to copy
            seqs = torch.arange(len(lens_list) if one_each else 0, device=device)
            none = seqs[:0]
            return cls(seqs, seqs, none, none, none, seqs.new_zeros(1), prefill_len=0, all_decode=one_each)
        lens = torch.tensor(lens_list, dtype=torch.int64)
        cu = torch.zeros(len(lens_list) + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=cu[1:])
        single = lens == 1
        rows = torch.tensor(verify, dtype=torch.bool) if verify else torch.zeros_like(single)
        decode_seqs = single.nonzero().flatten()
        host = {"decode_seqs": decode_seqs, "decode_tokens": cu[decode_seqs]}
        p_len, host["prefill_cu_lens"] = _padded(
            host, "prefill", (~single & ~rows).nonzero().flatten(), lens, cu
        )
        v_len = _padded(host, "verify", rows.nonzero().flatten(), lens, cu)[0] if verify else 0
        all_prefill = not len(decode_seqs) and not v_len
        return cls(
            **to_device_packed(host, device),
            prefill_len=p_len,
            all_decode=False,
            all_prefill=all_prefill,
            verify_len=v_len,
        )


def _padded(host: dict[str, Tensor], name: str, seqs: Tensor, lens: Tensor, cu: Tensor) -> tuple[int, Tensor]:
    """Sequences `seqs` laid out padded to their longest (into host: `{name}_seqs`, `_tokens`,
    `_padded`); that length and their cumulative lengths."""
    s_lens = lens[seqs]
    s_len = int(s_lens.max()) if len(s_lens) else 0
    local = torch.repeat_interleave(torch.arange(len(s_lens)), s_lens)
    s_cu = torch.zeros(len(s_lens) + 1, dtype=torch.int64)
    torch.cumsum(s_lens, 0, out=s_cu[1:])
    offset = torch.arange(int(s_lens.sum())) - s_cu[local]
    host[f"{name}_seqs"] = seqs
    host[f"{name}_tokens"] = cu[seqs][local] + offset
    host[f"{name}_padded"] = local * s_len + offset
    return s_len, s_cu


def gated_delta_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state: Tensor,
    plan: DeltaPlan,
    use_fla: bool | None = None,
    kept: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The rule over a flat batch: q, k [T, Hk, Dk]; v [T, Hv, Dv]; g, beta [T, Hv]; state
    [B, Hv, Dk, Dv] before this step -> (o [T, Hv, Dv], new state float32). use_fla None: fla
    where it applies. kept [>= Bv, >= verify_len - 1, Hv, Dk, Dv]: where the plan's verify rows
    leave the state after each of their positions but the last (row i: the i-th verify row)."""
    if use_fla is None:  # fla's chunk kernel is CUDA-only and refuses float32 inputs
        use_fla = v.is_cuda and v.dtype in (torch.bfloat16, torch.float16) and fla_installed()
    decode = fla_decode if use_fla else recurrent_gated_delta_step
    if use_fla:
        prefill = partial(fla_prefill, cu_lens=plan.prefill_cu_lens)
    else:
        prefill = partial(_padded_prefill, plan=plan)
    verify = partial(_padded_rows, plan=plan, kept=kept)
    if plan.all_decode:  # the common decode step: sequences are already in order, one token each
        return decode(q, k, v, g, beta, state)
    if plan.all_prefill:  # prompt chunks alone: they too are in order already
        return prefill(q, k, v, g, beta, state)
    out = torch.empty_like(v)
    new_state = torch.empty(state.shape, dtype=torch.float32, device=state.device)
    for idx, seqs, form in (
        (plan.decode_tokens, plan.decode_seqs, decode),
        (plan.verify_tokens, plan.verify_seqs, verify),
        (plan.prefill_tokens, plan.prefill_seqs, prefill),
    ):
        if seqs is not None and idx is not None and seqs.numel():
            out[idx], new_state[seqs] = form(q[idx], k[idx], v[idx], g[idx], beta[idx], state[seqs])
    return out, new_state


def _padded_prefill(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, plan: DeltaPlan
) -> tuple[Tensor, Tensor]:
    # Pad the prefill sequences to one length so they run as one batch; zero g/beta on the
    # padding leaves each state untouched there (see chunk_gated_delta).
    pad = partial(_pad, index=plan.prefill_padded, length=plan.prefill_len, batch=state.shape[0])
    o, s = chunk_gated_delta(pad(q), pad(k), pad(v), pad(g), pad(beta), state)
    return o.flatten(0, 1)[plan.prefill_padded], s


def _padded_rows(*inputs: Tensor, plan: DeltaPlan, kept: Tensor | None) -> tuple[Tensor, Tensor]:
    # The verify rows (q, k, v, g, beta, state), padded alike, run token by token; their
    # per-position states into `kept`.
    *x, state = inputs
    assert plan.verify_padded is not None and kept is not None, "verify rows need a verify workspace"
    pad = partial(_pad, index=plan.verify_padded, length=plan.verify_len, batch=state.shape[0])
    o, s = recurrent_gated_delta_rows(*map(pad, x), state, kept[: state.shape[0]])
    return o.flatten(0, 1)[plan.verify_padded], s


def rows_only(lens_list: list[int], verify: tuple[bool, ...]) -> bool:
    """A step of decode tokens and verify rows alone (`StepBatch.verify`: one flag a sequence, or
    none): what the in-place kernel runs token by token. A prompt chunk goes to the chunked form."""
    return all(n == 1 or (bool(verify) and verify[b]) for b, n in enumerate(lens_list))


def _pad(x: Tensor, index: Tensor, length: int, batch: int) -> Tensor:
    buf = x.new_zeros((batch * length, *x.shape[1:]))
    buf[index] = x
    return buf.reshape(batch, length, *x.shape[1:])


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the delta-rule output, then multiplied by silu(z) (one kernel on CUDA)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        return pointwise.gated_rms_norm(x, gate, self.weight, self.eps)


@dataclass(frozen=True)
class VerifyRows:
    """A step's verify rows (`StepBatch.verify`) as the linear-attention layers keep their states:
    row i is the batch's i-th verify row; each keeps the state after its first `drafts` positions
    (the last one's is the slot's own) and its conv inputs (`RecurrentState.keep_inputs`)."""

    slots: Tensor  # [Bv] their slots
    inputs: Tensor  # [Bv * drafts] each row's first `drafts` tokens (a shorter row repeats its last)
    row_of_seq: Tensor  # [B] each sequence's verify row, -1 for the others
    drafts: int  # the most drafts a row carries this step

    @classmethod
    def build(cls, batch: ForwardBatch) -> VerifyRows | None:
        seqs = [b for b, kept in enumerate(batch.verify) if kept]
        if not seqs:
            return None
        lens = batch.lens_list
        if len(seqs) == len(lens) and min(lens) == max(lens):  # every row verifies as many drafts:
            # made on the device, no host copy (what a verify graph captures)
            rows, drafts = torch.arange(len(lens), device=batch.device), lens[0] - 1
            inputs = rows[:, None] * lens[0] + torch.arange(drafts, device=batch.device)
            return cls(batch.slots, inputs.flatten(), rows, drafts)
        cu = [0, *accumulate(lens)]
        drafts = max(lens[b] for b in seqs) - 1
        row_of_seq = [-1] * len(lens)
        for i, b in enumerate(seqs):
            row_of_seq[b] = i
        host = {
            "slots": torch.tensor([batch.slots_list[b] for b in seqs]),
            "inputs": torch.tensor([cu[b] + min(j, lens[b] - 1) for b in seqs for j in range(drafts)]),
            "row_of_seq": torch.tensor(row_of_seq),
        }
        return cls(**to_device_packed(host, batch.device), drafts=drafts)


@dataclass(frozen=True)
class HybridStep(LayerStep):
    """A hybrid model's `LayerStep`: also what its linear-attention layers share."""

    windows: ConvWindows | None  # every token's conv taps; None where the conv runs in place
    plan: DeltaPlan  # which sequences take the recurrent form and which the chunked one
    has_history: Tensor  # [B] bool: the slot already holds this sequence's earlier tokens
    any_fresh: bool  # some sequence starts at position 0 this step (host-side mirror)
    use_fla: bool | None  # None: fla kernels where they apply (CUDA, half precision, installed)
    # On CUDA (unless use_fla is False: the torch reference everywhere) the conv runs in place in
    # the state pool (`gated_delta_triton.conv_in_place`); in a step of decode and verify rows alone
    # the rule does too (`in_place`).
    conv_in_place: bool
    in_place: bool
    verify: VerifyRows | None  # the rows whose per-position states are kept (None: none)

    @classmethod
    def build(cls, batch: ForwardBatch, rope: Rope, conv_kernel: int, use_fla: bool | None) -> HybridStep:
        kernels = use_fla is not False and gated_delta_triton.available(batch.starts)
        in_place = kernels and rows_only(batch.lens_list, batch.verify)
        plan = DeltaPlan.build(batch.lens_list, batch.device, batch.verify, in_place)
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
            in_place=in_place,
            verify=VerifyRows.build(batch) if batch.verify else None,
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
        verify = step.verify
        if verify is not None:  # before the conv replaces the slots' saved inputs
            state.keep_inputs(verify.slots, qkv[verify.inputs].view(-1, verify.drafts, qkv.shape[-1]))
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
            out = gated_delta_triton.rows_in_place(
                q, k, v, a, b, self.A_log, self.dt_bias, state.recurrent, slots, keep,
                None if step.plan.all_decode else step.batch.cu_lens,
                (state.kept_states, verify.row_of_seq) if verify is not None else None,
            )  # fmt: skip
        else:
            rec0 = state.recurrent.index_select(0, slots)
            if step.any_fresh:
                rec0 = torch.where(keep[:, None, None, None], rec0, 0)
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
            kept = state.kept_states
            out, new_rec = gated_delta_varlen(q, k, v, g, b.sigmoid(), rec0, step.plan, step.use_fla, kept)
            state.recurrent.index_copy_(0, slots, new_rec.to(state.recurrent.dtype))
        return self.out_proj(self.norm(out, z).reshape(t, self.value_width))
