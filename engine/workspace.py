"""Device memory a step takes beside the model's activations: the sampler's [rows, vocab]
temporaries and the prompt-logprob chunks' logits. The load profile misses both and the caching
allocator keeps what they once took, so on CUDA they are bounded here and leased at load.
"""

from __future__ import annotations

from dataclasses import dataclass

# Peak live bytes per logit while the sampler draws one row set, counted on its widest path
# (top-p with seeded rows and logprobs asked): the float32 logits and their log-softmax (8), the
# sort's values and int64 order (12), sorted probabilities, their cumulative sum and the mask
# scattered back (10), the filtered logits and their softmax (8), the race's Exp(1) noise (4),
# and a seeded row's int64 hash lanes and their mixing temporaries (3 x 8). 66, rounded up; a GPU
# test measures the allocator's peak against it.
SAMPLER_BYTES_PER_LOGIT = 72

# The scheduler scores at most this many prompt positions a step (a chunk that asks is cut to its
# PROMPT_LOGPROBS_CHUNK; tests/unit/test_step_workspace.py holds the two equal).
PROMPT_LOGPROBS_ROWS = 256


@dataclass(frozen=True)
class StepWorkspace:
    sampler_bytes: int
    prompt_logprobs_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.sampler_bytes + self.prompt_logprobs_bytes

    def report(self) -> str:
        mib = 1 << 20
        return (
            f"sampler workspace {self.sampler_bytes / mib:.1f} MiB, "
            f"prompt-logprob chunk {self.prompt_logprobs_bytes / mib:.1f} MiB"
        )


@dataclass(frozen=True)
class VerifySize:
    """The verify steps the engine is loaded for (engine.spec): up to `rows` drafting sequences a
    step, of up to `drafts` drafts each. A hybrid's recurrent layers keep the state after each
    drafted position of each such row in a workspace this size, allocated with the slot states at
    load and leased with them, so a rejected draft is undone by a copy (`LayerState.roll_back`)."""

    rows: int = 0
    drafts: int = 0


def step_workspace(num_slots: int, vocab_size: int, logits_bytes: int) -> StepWorkspace:
    """The bound for a step of up to num_slots sampled rows. Prompt logprobs: the chunk's logits
    at the model's dtype (logits_bytes), their float32 copy and its log-softmax."""
    return StepWorkspace(
        sampler_bytes=num_slots * vocab_size * SAMPLER_BYTES_PER_LOGIT,
        prompt_logprobs_bytes=PROMPT_LOGPROBS_ROWS * vocab_size * (logits_bytes + 8),
    )
