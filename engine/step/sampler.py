"""Batched sampling over [B, vocab] logits, one row per slot that needs a token this step.

Order follows Hugging Face's logits processors: `logit_bias` (OpenAI's order), penalties,
the grammar's -inf mask, then temperature, top-k, top-p, min-p and a draw. Logprobs are those of
the raw logits (before bias, penalty, grammar or filter), as vLLM reports: what the model believed.

The host waits for nothing: which filters run is decided from host-side knobs, and the step's one
device-to-host copy carries the tokens (with packed logprobs where asked). `draw` queues it all,
`collect` waits for that copy; the engine launches the next forward between the two.

A draw is an exponential race, argmax(p / E) with E ~ Exp(1). A seeded row's E is a counter-based
hash of (seed, tokens its slot has drawn, token index), so a seed and prompt give the same tokens
whatever shares the batch; unseeded rows share one generator (one kernel, no hash passes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ballast.engine.plan import SamplingParams
from ballast.engine.text.grammar import SlotMatchers
from ballast.models.base import column, to_device

_MASK64 = (1 << 64) - 1
_BELOW_ONE = 1.0 - 2.0**-24  # the largest float32 below 1
_NOISE_FLOOR = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Draw:
    """One step's tokens on their way to the host. `tokens` stays on the device (the next step
    may feed it without a round trip); `host` is the pinned copy, done once `ready` is."""

    slots: tuple[int, ...]
    params: tuple[SamplingParams, ...]
    tokens: torch.Tensor  # [B] int64, on the device
    host: torch.Tensor  # [B] int64 tokens, or [B, 2 + 2 top_n] float64 packed with logprobs
    ready: torch.cuda.Event | None
    top_n: int

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class Sampler:
    """Owns the per-slot sampling state: token counts for penalties, seeded draw counters."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        # Output-token counts feed frequency/presence penalties; `seen` marks prompt and output
        # tokens for the repetition penalty (HF and vLLM apply it to both).
        self._counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self._seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self._draws = torch.zeros(num_slots, dtype=torch.int64, device=device)  # tokens drawn per slot
        # Each slot's latest token, on the device: a step planned before it reached the host feeds it.
        self.last_tokens = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self._drawn: set[int] = set()  # slots that drew a token since their reset
        self._lanes = torch.arange(vocab_size, dtype=torch.int64, device=device) * _signed(_GOLDEN)
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self._uncollected_grammar = False
        self.matchers = SlotMatchers(vocab_size)

    @property
    def state_bytes(self) -> int:
        per_slot = self._draws.numel() * 8 + self.last_tokens.numel() * 8
        return self._counts.numel() * 4 + self._seen.numel() + per_slot + self._lanes.numel() * 8

    @staticmethod
    def planned_bytes(num_slots: int, vocab_size: int) -> int:
        """What `state_bytes` will be, before the sampler exists."""
        return num_slots * vocab_size * (4 + 1) + num_slots * 16 + vocab_size * 8

    def reset(self, slots: Sequence[int]) -> None:
        """A new sequence starts in these slots: forget their history and restart their seeds."""
        if not slots:
            return
        index = to_device(list(slots), torch.long, self.device)
        self._counts.index_fill_(0, index, 0)
        self._seen.index_fill_(0, index, False)
        self._draws.index_fill_(0, index, 0)
        self._drawn.difference_update(slots)
        self.matchers.reset(slots)

    def has_drawn(self, slot: int) -> bool:
        """The slot's sequence has drawn a token: `last_tokens` holds it."""
        return slot in self._drawn

    def observe_prompt(self, slot: int, token_ids: Sequence[int]) -> None:
        """Prompt tokens count for the repetition penalty (not for frequency/presence)."""
        self.matchers.observe(slot, token_ids)
        if token_ids:
            index = to_device(
                [min(max(t, 0), self.vocab_size - 1) for t in token_ids], torch.long, self.device
            )
            self._seen[slot].index_fill_(0, index, True)

    def sample(
        self, logits: torch.Tensor, slots: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[SampledToken]:
        """Draw one token per row of `logits` [B, vocab] (row i belongs to slots[i]) and wait for it."""
        return self.collect(self.draw(logits, slots, params))

    def draw(self, logits: torch.Tensor, slots: Sequence[int], params: Sequence[SamplingParams]) -> Draw:
        """Queue one token per row and its copy to the host, without waiting for the device. Rows
        under a grammar need the previous draw collected first (its tokens advance the matchers)."""
        if logits.dim() != 2 or logits.shape[0] != len(slots) or len(slots) != len(params):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(slots)} slots / {len(params)} params"
            )
        constrained = [i for i, p in enumerate(params) if p.constraint is not None]
        if constrained and self._uncollected_grammar:
            raise RuntimeError("a grammar row is drawn before the previous draw was collected")
        logits = logits[:, : self.vocab_size].float()
        slot_index = to_device(list(slots), torch.long, logits.device)
        top_n = max((p.logprobs or 0 for p in params), default=0)
        raw_logprobs = (
            torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
        )

        processed = self._apply_penalties(_biased(logits, params), slot_index, params)
        if constrained:
            processed = self.matchers.mask(
                processed,
                constrained,
                [slots[i] for i in constrained],
                [c for c in (params[i].constraint for i in constrained) if c is not None],
            )
        tokens = self._choose(processed, slot_index, params)
        self._record(slot_index, tokens)
        self._drawn.update(slots)
        self._uncollected_grammar = self._uncollected_grammar or bool(constrained)
        packed = tokens if raw_logprobs is None else _packed(tokens, raw_logprobs, top_n)
        host, ready = _to_host(packed)
        return Draw(tuple(slots), tuple(params), tokens, host, ready, top_n)

    def collect(self, draw: Draw) -> list[SampledToken]:
        """Wait for a draw's copy (the step's one device-to-host sync) and read it; grammar rows'
        matchers consume their tokens."""
        draw.wait()
        rows = draw.host.tolist()
        token_list = [int(row) for row in rows] if draw.host.dim() == 1 else [int(row[0]) for row in rows]
        constrained = [i for i, p in enumerate(draw.params) if p.constraint is not None]
        if constrained:
            self.matchers.accept([draw.slots[i] for i in constrained], [token_list[i] for i in constrained])
            self._uncollected_grammar = False
        if draw.host.dim() == 1:
            return [SampledToken(t) for t in token_list]
        out = []
        for token, row, p in zip(token_list, rows, draw.params, strict=True):
            if p.logprobs is None:
                out.append(SampledToken(token))
                continue
            n = p.logprobs
            top = tuple(
                (int(i), float(v)) for i, v in zip(row[2 : 2 + n], row[2 + draw.top_n :][:n], strict=True)
            )
            out.append(SampledToken(token, float(row[1]), top))
        return out

    def take(self, chosen: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Tokens chosen without `draw` (engine/spec/verify.py's plain rows), per slot in order:
        recorded as their draws would have been (penalty counts, draw counters, last token)."""
        chosen = [(slot, tokens) for slot, tokens in chosen if tokens]
        if not chosen:
            return
        slots = to_device([slot for slot, row in chosen for _ in row], torch.long, self.device)
        self._count(slots, to_device([t for _, row in chosen for t in row], torch.long, self.device))
        last = to_device([slot for slot, _ in chosen], torch.long, self.device)
        self.last_tokens.index_copy_(
            0, last, to_device([row[-1] for _, row in chosen], torch.long, self.device)
        )
        self._drawn.update(slot for slot, _ in chosen)

    def _apply_penalties(
        self, logits: torch.Tensor, slot_index: torch.Tensor, params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        if all(
            p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            for p in params
        ):
            return logits
        rep = column([p.repetition_penalty for p in params], logits.dtype, logits.device)
        freq = column([p.frequency_penalty for p in params], logits.dtype, logits.device)
        pres = column([p.presence_penalty for p in params], logits.dtype, logits.device)
        counts = self._counts.index_select(0, slot_index).to(logits.dtype)
        seen = self._seen.index_select(0, slot_index)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * counts - pres * (counts > 0).to(logits.dtype)

    def _choose(
        self, logits: torch.Tensor, slot_index: torch.Tensor, params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return tokens
        chosen = [params[i] for i in random_rows]
        every = len(random_rows) == len(params)
        rows = None if every else to_device(random_rows, torch.long, logits.device)
        filtered = filter_logits(
            logits if rows is None else logits.index_select(0, rows),
            temperature=[p.temperature for p in chosen],
            top_k=[p.top_k for p in chosen],
            top_p=[p.top_p for p in chosen],
            min_p=[p.min_p for p in chosen],
        )
        probs = torch.softmax(filtered, dim=-1)
        noise = self._noise(probs, chosen, slot_index if rows is None else slot_index.index_select(0, rows))
        # A zero in the noise would make a masked token's 0 / 0 a NaN, and argmax picks NaN: with
        # the floor, a token of probability 0 scores exactly 0 and never wins.
        drawn = (probs / noise.clamp_min_(_NOISE_FLOOR)).argmax(dim=-1)
        return drawn if rows is None else tokens.index_copy(0, rows, drawn)

    def _noise(
        self, probs: torch.Tensor, params: Sequence[SamplingParams], slots: torch.Tensor
    ) -> torch.Tensor:
        """Exp(1) values [B, vocab] for the race: the shared generator's, or for seeded rows the
        hash of their seed and draw count (a dozen elementwise kernels, paid only by them)."""
        seeded = [k for k, p in enumerate(params) if p.seed is not None]
        if not seeded:
            return torch.empty_like(probs).exponential_(generator=self._shared)
        index = None if len(seeded) == len(params) else to_device(seeded, torch.long, probs.device)
        seeds = [_signed(p.seed & _MASK64) for p in (params[k] for k in seeded) if p.seed is not None]
        counters = self._draws.index_select(0, slots if index is None else slots.index_select(0, index))
        hashed = self._exponential_noise(to_device(seeds, torch.int64, probs.device), counters)
        if index is None:
            return hashed
        return torch.empty_like(probs).exponential_(generator=self._shared).index_copy_(0, index, hashed)

    def _exponential_noise(self, seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
        """Exp(1) values [B, vocab], a pure function of (seed, counter, token index) per row."""
        row_key = _mix(seeds ^ _mix(counters + 1))
        bits = _mix(row_key.unsqueeze(-1) + self._lanes)
        # (x + 0.5) / 2^24 for the top 24 bits; in float32 the largest, 2^24 - 0.5, rounds to 2^24,
        # a uniform of 1 and a noise of 0, so the top is held to the largest float below 1.
        uniform = (_shift_right(bits, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))
        return -torch.log(uniform.clamp_max_(_BELOW_ONE))

    def _record(self, slot_index: torch.Tensor, tokens: torch.Tensor) -> None:
        """One token a row; rows are distinct slots."""
        self._count(slot_index, tokens)
        self.last_tokens.index_copy_(0, slot_index, tokens)

    def _count(self, slot_index: torch.Tensor, tokens: torch.Tensor) -> None:
        # One kernel each on the flattened tables (an accumulating index_put_ sorts its indices
        # on CUDA first); index_add_ adds a repeated slot or token once for each time it comes.
        flat = slot_index * self.vocab_size + tokens
        self._counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=self._counts.dtype))
        self._seen.view(-1).index_fill_(0, flat, True)
        self._draws.index_add_(0, slot_index, torch.ones_like(slot_index))


def filter_logits(
    logits: torch.Tensor,
    temperature: Sequence[float],
    top_k: Sequence[int],
    top_p: Sequence[float],
    min_p: Sequence[float],
) -> torch.Tensor:
    """Temperature-scaled logits [B, V] with what top-k / top-p / min-p exclude set to -inf (one
    knob per row; top_k 0 is off). Ties at the k-th largest logit are all kept, as a threshold is."""
    dtype, device = logits.dtype, logits.device
    logits = logits / column(temperature, dtype, device).clamp_min(1e-5)
    vocab = logits.shape[-1]
    neg_inf = logits.new_full((), float("-inf"))  # a fill, not a host-to-device copy
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    if any(k < vocab for k in ks):
        kth = logits.topk(max(ks), dim=-1).values.gather(
            -1, to_device([k - 1 for k in ks], torch.long, device)[:, None]
        )
        logits = torch.where(logits < kth, neg_inf, logits)
    if any(p < 1 for p in top_p):
        p_col = column(top_p, dtype, device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        # Keep the smallest prefix whose mass reaches top_p; rows at 1.0 keep everything even
        # where float rounding pushes the running sum past 1.
        drop_sorted = (before >= p_col) & (p_col < 1)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = torch.where(drop, neg_inf, logits)
    if any(m > 0 for m in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = column(min_p, dtype, device) * probs.max(dim=-1, keepdim=True).values
        logits = torch.where(probs < floor, neg_inf, logits)
    return logits


def _biased(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The logits with each row's logit_bias added (a copy; the raw logits stay for logprobs)."""
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries, strict=True)
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(tokens, torch.long, device))
    return logits.index_put(index, to_device(biases, logits.dtype, device), accumulate=True)


def _packed(tokens: torch.Tensor, raw_logprobs: torch.Tensor, top_n: int) -> torch.Tensor:
    """[B, 2 + 2 top_n] float64: token, its logprob, top_n ids, top_n logprobs (exact in float64)."""
    chosen = raw_logprobs.gather(-1, tokens.unsqueeze(-1))
    parts = [tokens.unsqueeze(-1).double(), chosen.double()]
    if top_n:
        top = raw_logprobs.topk(top_n, dim=-1)
        parts += [top.indices.double(), top.values.double()]
    return torch.cat(parts, dim=-1)


def _to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Start the copy of `values` to the host: (its host tensor, the event that marks it done)."""
    if values.device.type != "cuda":
        return values, None
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


# splitmix64's constants (Steele, Lea, Flood 2014): a bijective 64-bit mix with full avalanche.
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 value torch stores (multiplication then wraps as uint64 does)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 patterns (torch's >> on int64 is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    z = z + _signed(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * _signed(_MUL1)
    z = (z ^ _shift_right(z, 27)) * _signed(_MUL2)
    return z ^ _shift_right(z, 31)
