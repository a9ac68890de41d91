"""The gated delta rule's forms. In torch (the reference every kernel is checked against), float32
whatever the inputs' dtype: `recurrent_gated_delta_step` one token a sequence, as a decode step
runs it; `recurrent_gated_delta_rows` a few tokens a sequence the same way, token by token, keeping
the state after each (a verify row: engine.spec rolls a slot back to the state after its last
accepted token); `chunk_gated_delta` many tokens as matmuls over 64-token chunks (WY / UT form).
And fla's kernels for both (CUDA, half precision), where it is installed.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 64


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, the normalisation fla applies in-kernel.
    As an RMS norm (x / sqrt(mean(x^2) + eps / D)) scaled by 1 / sqrt(D): one fused kernel."""
    dim = x.shape[-1]
    return F.rms_norm(x, (dim,), eps=eps / dim) * dim**-0.5


def expand_heads(x: Tensor, num_v_heads: int, dim: int) -> Tensor:
    """Grouped value heads: q/k head h serves value heads [h*r, (h+1)*r)."""
    ratio = num_v_heads // x.shape[dim]
    return x if ratio == 1 else x.repeat_interleave(ratio, dim=dim)


def recurrent_gated_delta_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """One token for each of B sequences: q, k [B, Hk, Dk]; v [B, Hv, Dv]; g, beta [B, Hv]; state
    [B, Hv, Dk, Dv] -> (o [B, Hv, Dv] in v's dtype, new state float32)."""
    num_v_heads = v.shape[-2]
    q = expand_heads(l2norm(q.float()), num_v_heads, 1) * q.shape[-1] ** -0.5
    k = expand_heads(l2norm(k.float()), num_v_heads, 1)
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

    qc = to_chunks(expand_heads(l2norm(q.float()), num_v_heads, 2)) * k_dim**-0.5
    kc = to_chunks(expand_heads(l2norm(k.float()), num_v_heads, 2))
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


def recurrent_gated_delta_rows(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, kept: Tensor
) -> tuple[Tensor, Tensor]:
    """B sequences of (padded) length L in the recurrent form, token by token: shapes as
    `chunk_gated_delta`'s. The state after each of the first L - 1 tokens goes to kept [B, >= L-1,
    Hv, Dk, Dv] (the last one is returned). Each token takes the arithmetic of a decode step, so
    the state after token j is the bits a run of decode steps reaches; padding (g = 0, beta = 0,
    zero q, k) leaves the state exactly as it was."""
    length = v.shape[1]
    out = torch.empty_like(v)
    s = state
    for j in range(length):
        out[:, j], s = recurrent_gated_delta_step(q[:, j], k[:, j], v[:, j], g[:, j], beta[:, j], s)
        if j < length - 1:
            kept[:, j] = s
    return out, s


@lru_cache(maxsize=1)
def fla_installed() -> bool:
    return importlib.util.find_spec("fla") is not None


def fla_prefill(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, cu_lens: Tensor
) -> tuple[Tensor, Tensor]:
    """fla's chunked kernel over a flat batch of sequences (varlen: cu_lens)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    hv = v.shape[-2]
    # q/k heads expanded here: only some fla releases support grouped values in-kernel. q, k, v
    # may be views into the conv's output: fla's kernels read contiguous copies.
    o, s = chunk_gated_delta_rule(
        q=expand_heads(q, hv, 1).contiguous().unsqueeze(0),
        k=expand_heads(k, hv, 1).contiguous().unsqueeze(0),
        v=v.contiguous().unsqueeze(0),
        g=g.float().unsqueeze(0),
        beta=beta.unsqueeze(0),
        initial_state=state.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_lens,
    )
    return o.squeeze(0).to(v.dtype), s.float()


def fla_decode(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor
) -> tuple[Tensor, Tensor]:
    """fla's recurrent kernel, one token a sequence."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    hv = v.shape[-2]
    o, s = fused_recurrent_gated_delta_rule(
        q=expand_heads(q, hv, 1).unsqueeze(1),
        k=expand_heads(k, hv, 1).unsqueeze(1),
        v=v.unsqueeze(1),
        g=g.float().unsqueeze(1),
        beta=beta.unsqueeze(1),
        initial_state=state.float().contiguous(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o.squeeze(1).to(v.dtype), s.float()
