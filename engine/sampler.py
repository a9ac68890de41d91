"""Batched sampling over [B, vocab] logits, one row per slot that needs a token this step.

Order of operations follows Hugging Face's logits processors: penalties on the raw logits, then
temperature, top-k, top-p, min-p, then a draw. Logprobs are those of the model's own distribution
(log-softmax of the raw logits, before any bias, penalty, grammar or filter), as vLLM reports by
default: they say what the model believed, whatever the request's sampling knobs were.

`logit_bias` is added to the raw logits first (OpenAI's order: the bias shifts what the model
said, the rest of sampling works on the shifted values). A request with a `constraint` then has
every token its grammar forbids set to -inf (`ballast.engine.grammar.SlotMatchers`), so neither
greedy nor random choice can leave the grammar.

Reproducibility: a request with a seed draws from its own per-slot generator, seeded at the
request's first sample, and each draw consumes exactly `vocab` exponentials from it. So the same
seed and prompt give the same tokens whatever else shares the batch. Unseeded rows share one
engine generator and draw in a single batched call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from ballast.engine.grammar import SlotMatchers
from ballast.engine.plan import SamplingParams


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


class Sampler:
    """Owns the per-slot sampling state: token counts for penalties and seeded generators."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.num_slots = num_slots
        self.vocab_size = vocab_size
        self.device = device
        # Output-token counts feed frequency/presence penalties; `seen` marks prompt and output
        # tokens for the repetition penalty (HF and vLLM apply it to both).
        self._counts = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device)
        self._seen = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device)
        self._generators: dict[int, torch.Generator] = {}
        self._shared = torch.Generator(device=device)
        self._shared.manual_seed(seed)
        self.matchers = SlotMatchers(vocab_size)

    @property
    def state_bytes(self) -> int:
        return self._counts.numel() * self._counts.element_size() + self._seen.numel()

    @staticmethod
    def planned_bytes(num_slots: int, vocab_size: int) -> int:
        """What `state_bytes` will be: int32 counts and bool marks per slot and token."""
        return num_slots * vocab_size * (4 + 1)

    def reset(self, slots: Sequence[int]) -> None:
        """A new sequence starts in these slots: forget their history and generators."""
        if not slots:
            return
        index = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        self._counts.index_fill_(0, index, 0)
        self._seen.index_fill_(0, index, False)
        for slot in slots:
            self._generators.pop(slot, None)
        self.matchers.reset(slots)

    def observe_prompt(self, slot: int, token_ids: Sequence[int]) -> None:
        """Prompt tokens count for the repetition penalty (not for frequency/presence)."""
        self.matchers.observe(slot, token_ids)
        if token_ids:
            index = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
            self._seen[slot].index_fill_(0, index.clamp_(0, self.vocab_size - 1), True)

    def sample(
        self, logits: torch.Tensor, slots: Sequence[int], params: Sequence[SamplingParams]
    ) -> list[SampledToken]:
        """Draw one token per row of `logits` [B, vocab]; row i belongs to slots[i]."""
        if logits.dim() != 2 or logits.shape[0] != len(slots) or len(slots) != len(params):
            raise ValueError(
                f"logits {tuple(logits.shape)} do not match {len(slots)} slots / {len(params)} params"
            )
        logits = logits[:, : self.vocab_size].float()
        slot_index = torch.tensor(list(slots), dtype=torch.long, device=logits.device)
        want_logprobs = [p.logprobs is not None for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None

        processed = self._apply_penalties(_biased(logits, params), slot_index, params)
        constrained = [i for i, p in enumerate(params) if p.constraint is not None]
        if constrained:
            processed = self.matchers.mask(
                processed,
                constrained,
                [slots[i] for i in constrained],
                [c for c in (params[i].constraint for i in constrained) if c is not None],
            )
        tokens = self._choose(processed, slots, params)
        self._record(slot_index, tokens)
        token_list = tokens.tolist()  # the step's one device-to-host sync
        if constrained:
            self.matchers.accept([slots[i] for i in constrained], [token_list[i] for i in constrained])
        return _outputs(token_list, tokens, raw_logprobs, params)

    def _apply_penalties(
        self, logits: torch.Tensor, slot_index: torch.Tensor, params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        if all(
            p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0
            for p in params
        ):
            return logits
        rep = _column(params, "repetition_penalty", logits)
        freq = _column(params, "frequency_penalty", logits)
        pres = _column(params, "presence_penalty", logits)
        counts = self._counts.index_select(0, slot_index).to(logits.dtype)
        seen = self._seen.index_select(0, slot_index)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        return logits - freq * counts - pres * (counts > 0).to(logits.dtype)

    def _choose(
        self, logits: torch.Tensor, slots: Sequence[int], params: Sequence[SamplingParams]
    ) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return tokens
        rows = torch.tensor(random_rows, dtype=torch.long, device=logits.device)
        chosen = [params[i] for i in random_rows]
        filtered = filter_logits(
            logits.index_select(0, rows),
            temperature=_column(chosen, "temperature", logits),
            top_k=[p.top_k for p in chosen],
            top_p=_column(chosen, "top_p", logits),
            min_p=_column(chosen, "min_p", logits),
        )
        probs = torch.softmax(filtered, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i. It
        # lets each seeded row draw from its own generator with a fixed number of values per step.
        noise = torch.empty_like(probs)
        unseeded = [k for k, row in enumerate(random_rows) if params[row].seed is None]
        if len(unseeded) == len(random_rows):
            noise.exponential_(generator=self._shared)
        elif unseeded:
            noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_(generator=self._shared)
        for k, row in enumerate(random_rows):
            seed = params[row].seed
            if seed is not None:
                noise[k].exponential_(generator=self._generator_for(slots[row], seed))
        tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens

    def _generator_for(self, slot: int, seed: int) -> torch.Generator:
        gen = self._generators.get(slot)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(seed)
            self._generators[slot] = gen
        return gen

    def _record(self, slot_index: torch.Tensor, tokens: torch.Tensor) -> None:
        # One kernel each on the flattened tables (an accumulating index_put_ sorts its indices
        # on CUDA first); rows are distinct slots, so no two updates hit the same cell.
        flat = slot_index * self.vocab_size + tokens
        self._counts.view(-1).index_add_(0, flat, torch.ones_like(flat, dtype=self._counts.dtype))
        self._seen.view(-1).index_fill_(0, flat, True)


def filter_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: Sequence[int],
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature-scaled logits [B, V] with the tokens top-k / top-p / min-p exclude set to -inf.

    temperature, top_p and min_p are [B, 1] columns; top_k 0 means off. Ties at the top-k boundary
    keep every token whose logit equals the k-th largest, as a threshold filter does.
    """
    logits = logits / temperature.clamp_min(1e-5)
    vocab = logits.shape[-1]
    neg_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if any(0 < k < vocab for k in top_k):
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(-1, (k - 1).unsqueeze(-1))
        logits = torch.where(logits < kth, neg_inf, logits)
    if bool((top_p < 1).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        # Keep the smallest prefix whose mass reaches top_p; rows at 1.0 keep everything even
        # where float rounding pushes the running sum past 1.
        drop_sorted = (before >= top_p) & (top_p < 1)
        drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
        logits = torch.where(drop, neg_inf, logits)
    if bool((min_p > 0).any()):
        probs = torch.softmax(logits, dim=-1)
        floor = min_p * probs.max(dim=-1, keepdim=True).values
        logits = torch.where(probs < floor, neg_inf, logits)
    return logits


def _biased(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The logits with each row's logit_bias added (a copy; the raw logits stay for logprobs)."""
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries, strict=True)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    return logits.index_put(
        index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True
    )


def _column(params: Sequence[SamplingParams], name: str, like: torch.Tensor) -> torch.Tensor:
    values = [float(getattr(p, name)) for p in params]
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(-1)


def _outputs(
    token_list: list[int],
    tokens: torch.Tensor,
    raw_logprobs: torch.Tensor | None,
    params: Sequence[SamplingParams],
) -> list[SampledToken]:
    if raw_logprobs is None:
        return [SampledToken(t) for t in token_list]
    top_n = max(p.logprobs or 0 for p in params)
    chosen = raw_logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).tolist()
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    if top_n:
        top = raw_logprobs.topk(top_n, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for i, (token, p) in enumerate(zip(token_list, params, strict=True)):
        if p.logprobs is None:
            out.append(SampledToken(token))
            continue
        n = p.logprobs
        top_pairs = tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True)) if n else ()
        out.append(SampledToken(token, chosen[i], top_pairs))
    return out
