"""The target's verdict on drafts: position by position, the sampler draws what it would draw
without drafting, and the draft stands while the draws equal it.

For a draft proposed without a distribution (prompt lookup proposes one token, q = 1 there) this
is rejection sampling exactly: the draft d is kept with probability p(d), and on a rejection the
token comes from p with d taken out, renormalised - which is what a draw from p that differs from
d is. So the output distribution is the target's, and a seeded row draws the very tokens it would
draw without drafting (its noise is keyed by the count of tokens drawn, which drafting keeps).
Penalty counts and grammar matchers advance with each accepted draw, as they would one step at
a time, so nothing in the sampler needs undoing after a rejection.

A row whose draws read nothing earlier draws change (greedy, with no penalty, bias, grammar or
logprobs: `_plain`) takes all its positions' argmaxes in one device-to-host copy, not one draw
and wait per position, and the sampler records its emitted tokens as their draws would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.step.sampler import SampledToken, Sampler


@dataclass(frozen=True)
class Verdict:
    """One drafting row's outcome: the tokens it emits (the accepted drafts, then the target's
    own token at the first rejected position, or after the last draft)."""

    slot: int
    drafts: int  # how many were proposed
    tokens: tuple[SampledToken, ...]

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


def verify(
    sampler: Sampler,
    logits: Sequence[torch.Tensor],
    slots: Sequence[int],
    drafts: Sequence[tuple[int, ...]],
    params: Sequence[SamplingParams],
) -> list[Verdict]:
    """logits[i]: [len(drafts[i]) + 1, vocab], row j predicting the token after draft j (row 0
    after the slot's last token). One draw per position for the rows still standing; the plain
    rows' positions all at once."""
    plain = [i for i, p in enumerate(params) if _plain(p)]
    emitted: list[list[SampledToken]] = [[] for _ in slots]
    if plain:
        best = torch.cat([logits[i][:, : sampler.vocab_size] for i in plain]).float().argmax(dim=-1).tolist()
        for i in plain:
            row, best = best[: len(drafts[i]) + 1], best[len(drafts[i]) + 1 :]
            kept = next(
                (j for j, (t, d) in enumerate(zip(row, drafts[i], strict=False)) if t != d), len(drafts[i])
            )
            emitted[i] = [SampledToken(t) for t in row[: kept + 1]]
        sampler.take([(slots[i], [t.token_id for t in emitted[i]]) for i in plain])
    standing = [i for i in range(len(slots)) if not emitted[i]]
    position = 0
    while standing:
        rows = torch.stack([logits[i][position] for i in standing])
        drawn = sampler.sample(rows, [slots[i] for i in standing], [params[i] for i in standing])
        still = []
        for i, token in zip(standing, drawn, strict=True):
            emitted[i].append(token)
            if position < len(drafts[i]) and token.token_id == drafts[i][position]:
                still.append(i)
        standing = still
        position += 1
    return [
        Verdict(slot, len(draft), tuple(tokens))
        for slot, draft, tokens in zip(slots, drafts, emitted, strict=True)
    ]


def _plain(p: SamplingParams) -> bool:
    """Its draw is the argmax of the raw logits, whatever was drawn before."""
    penalised = p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
    return p.greedy and not penalised and not p.logit_bias and p.constraint is None and p.logprobs is None
