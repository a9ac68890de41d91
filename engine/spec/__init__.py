"""Speculative decoding: drafts proposed on the host, verified by the target in one step.

A drafting sequence carries k + 1 positions in a step (its last token and k drafts, like a short
prompt chunk with logits at every position); the sampler draws position by position exactly as it
would without drafts, and a position's draft is accepted when the draw equals it. The output is
therefore the target's own: for greedy rows the same tokens, for sampled rows the same
distribution (with a seed, the same tokens). Rejected positions are rolled back: their KV blocks
are released, and a recurrent state is set to the one the verify step kept after the last accepted
token (the rule runs a verify row token by token anyway; no second forward).
"""
