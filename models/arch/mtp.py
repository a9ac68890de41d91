"""Qwen3-Next's multi-token-prediction (MTP) layer, the drafter of `--speculative-config` "mtp".

The published checkpoints (config `num_nextn_predict_layers`, tensors `mtp.*`) carry it beside the
decoder. At position i it reads two things: the target's last hidden state there (after the final
norm) and the embedding of the token at i + 1 (the one the target chose), each RMS-normed
(`pre_fc_norm_hidden`, `pre_fc_norm_embedding`, centred weights as the model's other norms),
concatenated [embedding, hidden] and projected back to the model width by `fc` (2h -> h). One full
decoder layer (gated attention and the MoE MLP, as the target's full-attention layers) and `norm`
follow; the target's own `lm_head` then gives the logits of the token at i + 2. Its normed output
stands in for the target's hidden state when the layer drafts further ahead.

Its attention keeps KV at the target's positions, in a layer of the slot's own KV blocks
(`Qwen3NextForCausalLM.layer_specs` lists it after the decoder's layers): the KV pool holds and
counts it like any other layer, and a sequence's blocks carry it when they are cut or released.

Not in transformers (5.x loads the decoder and drops `mtp.*`); the reference this is checked against
is tests/unit/test_mtp.py's float32 transcription of the formula above.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from ballast.models.arch.decoder import DecoderLayer
from ballast.models.base import ForwardBatch
from ballast.models.layers.core import LayerStep, Rope
from ballast.models.layers.state import LayerState
from torch import Tensor, nn


class MultiTokenPredictor(nn.Module):
    """`mtp.*` under the checkpoints' names: fc, the two pre-fc norms, layers.N, norm. The model
    supplies its norm (`norm()` makes one) and its full-attention decoder layers."""

    def __init__(self, hidden: int, norm: Callable[[], nn.Module], layers: Iterable[DecoderLayer]) -> None:
        super().__init__()
        self.pre_fc_norm_embedding = norm()
        self.pre_fc_norm_hidden = norm()
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(layers)
        self.norm = norm()

    def forward(
        self,
        embedded: Tensor,
        hidden: Tensor,
        rope: Rope,
        batch: ForwardBatch,
        state: LayerState,
        depth: int = 0,
    ) -> Tensor:
        """The normed output [T, h] at each row: embedded are the next tokens' embeddings, hidden
        the target's (or a previous MTP pass's) normed hidden states at the same positions; depth
        picks the layer (drafting j tokens ahead uses layer j mod n)."""
        x = torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)], dim=-1)
        x = self.fc(x)
        layer = self.layers[depth % len(self.layers)]
        x, pending = layer(x, None, LayerStep(batch, rope), state)
        return self.norm(x + pending)
