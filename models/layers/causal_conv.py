"""Causal depthwise conv1d over a flat batch of sequences, with a rolling per-slot state (its last
kernel-1 inputs), so a chunk or decode token continues where the previous step stopped. Instead of
padding, each token's window is gathered from one buffer of every sequence's saved state followed
by the step's tokens: one gather + multiply-add per kernel tap, no loop over tokens or sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class ConvWindows:
    """Where every tap of every token's conv window lives in the source buffer
    `cat([state.reshape(B * (K-1), C), x])` (saved states, oldest input first, then the step's
    tokens). Built once a step, shared by every linear-attention layer."""

    kernel: int
    token_taps: Tensor | None  # [K, T] int64: source row of tap j (oldest first) for token t
    state_taps: Tensor | None  # [K-1, B] int64: source row of the new state's column j for sequence b
    # A decode step: each token's window is its sequence's state and itself, no taps (None above).
    decode_only: bool = False

    @classmethod
    def build(cls, cu_lens: Tensor, lens: Tensor, seq_of_token: Tensor, kernel: int) -> ConvWindows:
        """cu_lens [B+1], lens [B], seq_of_token [T] (all int64, on the compute device)."""
        if seq_of_token.shape[0] == lens.shape[0]:  # T == B and every len >= 1: one token each
            return cls(kernel=kernel, token_taps=None, state_taps=None, decode_only=True)
        hist = kernel - 1
        num_seqs = int(lens.shape[0])
        device = lens.device
        state_base = num_seqs * hist

        def source_rows(seq: Tensor, rel: Tensor) -> Tensor:
            # rel: position relative to the sequence's first new token; < 0 reads the saved state,
            # whose column hist + rel holds the input rel steps before the chunk.
            from_state = seq * hist + (hist + rel).clamp_min(0)
            from_tokens = state_base + cu_lens[seq] + rel.clamp_min(0)
            return torch.where(rel < 0, from_state, from_tokens)

        num_tokens = int(seq_of_token.shape[0])
        offset = torch.arange(num_tokens, device=device) - cu_lens[seq_of_token]
        taps = torch.arange(kernel, device=device).unsqueeze(1)  # [K, 1]
        token_taps = source_rows(seq_of_token.unsqueeze(0), offset.unsqueeze(0) - hist + taps)
        seqs = torch.arange(num_seqs, device=device).unsqueeze(0)
        cols = torch.arange(hist, device=device).unsqueeze(1)  # [K-1, 1]
        state_taps = source_rows(seqs.expand(hist, -1), lens.unsqueeze(0) - hist + cols)
        return cls(kernel=kernel, token_taps=token_taps, state_taps=state_taps)


def causal_conv1d_varlen(
    x: Tensor, state: Tensor, weight: Tensor, windows: ConvWindows
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv of a flat batch: x [T, C]; state [B, C, K-1] each sequence's previous
    inputs (zeros for a fresh one); weight [C, K] -> (silu(conv(x)) [T, C], new state),
    accumulated in float32 like the reference."""
    kernel = windows.kernel
    if weight.shape[-1] != kernel or state.shape[-1] != kernel - 1:
        raise ValueError(
            f"kernel mismatch: weight {tuple(weight.shape)}, state {tuple(state.shape)}, {kernel}"
        )
    if windows.decode_only:
        return _conv_decode(x, state, weight)
    assert windows.token_taps is not None and windows.state_taps is not None
    channels = x.shape[-1]
    source = torch.cat([state.transpose(1, 2).reshape(-1, channels).to(x.dtype), x], dim=0)
    w = weight.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(kernel):  # the kernel taps, not the tokens
        out.addcmul_(source.index_select(0, windows.token_taps[j]).float(), w[:, j])
    new_state = source[windows.state_taps.reshape(-1)].reshape(kernel - 1, -1, channels).permute(1, 2, 0)
    return F.silu(out).to(x.dtype), new_state.to(state.dtype)


def _conv_decode(x: Tensor, state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    # One token per sequence: the window is [state, x], in the gathered form's accumulation order
    # (the same bits), at half its kernel launches, which bound a decode step on a GPU.
    window = torch.cat([state.to(x.dtype), x.unsqueeze(-1)], dim=-1)  # [B, C, K]
    src = window.float()
    w = weight.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(w.shape[-1]):
        out.addcmul_(src[..., j], w[:, j])
    return F.silu(out).to(x.dtype), window[..., 1:].to(state.dtype)
