"""The plan of step N+1, built while step N runs and before its tokens are back.

While every running request decodes, step N+1 is known before N ends except for the tokens N
samples: each request that samples in N feeds its new token at the next position. Those decodes
are planned ahead (`DecodeToken.ahead`: their token is fed from the device), so the scheduler can submit
N+1 at once and the GPU goes from N to N+1 without waiting for the host (the host applies N's
tokens, detokenizes and streams them while N+1 runs).

What is not known is whether N's token ends its request (end of sequence, a stop string, an
abort). Such a request's N+1 token is computed and dropped: one wasted row, against a host round
trip saved on every step. A request that N's token brings to its max_tokens or to the context's
end is known to finish, and is left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ballast.engine.plan import DecodeToken, SamplingParams, StepPlan


@dataclass(frozen=True)
class Decoding:
    """What the lookahead needs of a running request: tokens generated so far (N's not counted),
    its limit and its sampling parameters."""

    generated: int
    max_tokens: int
    params: SamplingParams


def next_decodes(plan: StepPlan, running: Mapping[int, Decoding], max_model_len: int) -> StepPlan | None:
    """The decode-only plan that follows `plan` for the requests in `running` (by slot), or None
    when it cannot be built ahead: a running request samples nothing in `plan` (it is still
    prefilling), or no request goes on."""
    rows = [(d.slot, d.pos + 1) for d in plan.decodes]
    rows += [(p.slot, p.start_pos + len(p.token_ids)) for p in plan.prefills if p.sample]
    if {slot for slot, _ in rows} != set(running):
        return None
    decodes = []
    sampling: dict[int, SamplingParams] = {}
    for slot, pos in rows:
        req = running[slot]
        if req.generated + 1 >= req.max_tokens or pos >= max_model_len:
            continue  # plan's token is its last
        decodes.append(DecodeToken.ahead(slot, pos))
        sampling[slot] = req.params
    if not decodes:
        return None
    return StepPlan(decodes=tuple(decodes), sampling=sampling)
