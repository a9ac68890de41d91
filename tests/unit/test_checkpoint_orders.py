"""Where the scheduler orders checkpoint saves: interval multiples and the end of a cold prompt
(a shared system prompt or document), only the end of a prompt that continues a restored
checkpoint (a chat's next turn), and a finished request's prompt + output[:-1]."""

from __future__ import annotations

from ballast.scheduler.checkpoints import CheckpointPlanner

PROMPT = tuple(range(100, 150))  # 50 tokens


def orders(shedding: bool = False, recurrent: bool = True) -> CheckpointPlanner:
    return CheckpointPlanner(16, lambda prompt: 0, lambda: shedding, recurrent)


def chunk_ends(o: CheckpointPlanner, start: int, budget: int, restored: int) -> list[int]:
    ends = []
    while start < len(PROMPT):
        start = o.end_chunk_at_checkpoint(0, PROMPT, start, min(len(PROMPT), start + budget), restored)
        ends.append(start)
    return ends


def test_a_cold_prompt_is_split_and_saved_at_interval_multiples_and_its_end() -> None:
    o = orders()
    assert chunk_ends(o, 0, 40, restored=0) == [16, 32, 48, 50]
    _, saves, _ = o.take_orders()
    assert [len(s.prefix) for s in saves] == [16, 32, 48, 50]
    assert all(s.prefix == PROMPT[: len(s.prefix)] for s in saves)


def test_an_attention_only_models_cold_prompt_is_one_chunk_saved_at_every_multiple() -> None:
    """No recurrent state: the KV blocks of each multiple's prefix are written by the one step."""
    o = orders(recurrent=False)
    assert chunk_ends(o, 0, 64, restored=0) == [50]
    _, saves, _ = o.take_orders()
    assert [len(s.prefix) for s in saves] == [16, 32, 48, 50]
    assert all(s.prefix == PROMPT[: len(s.prefix)] for s in saves)
    # a chunk the token budget cuts short: the multiples it passes, then the ones of the next
    assert chunk_ends(o, 0, 20, restored=0) == [20, 40, 50]
    _, saves, _ = o.take_orders()
    assert [len(s.prefix) for s in saves] == [16, 32, 48, 50]


def test_a_prompt_continuing_a_restored_checkpoint_saves_only_at_its_end() -> None:
    o = orders()
    assert chunk_ends(o, 20, 40, restored=20) == [50]  # one chunk: no split at 32 or 48
    o.queue_final_save(0, PROMPT + (7, 8))
    _, saves, _ = o.take_orders()
    assert [len(s.prefix) for s in saves] == [50, 52]


def test_a_chunk_cut_short_by_the_token_budget_saves_nothing() -> None:
    o = orders()
    assert chunk_ends(o, 20, 12, restored=20) == [32, 44, 50]
    _, saves, _ = o.take_orders()
    assert [len(s.prefix) for s in saves] == [50]


def test_nothing_is_split_or_saved_while_the_ladder_sheds_the_cache() -> None:
    o = orders(shedding=True)
    assert chunk_ends(o, 0, 40, restored=0) == [40, 50]
    o.queue_final_save(0, PROMPT)
    shed, saves, restores = o.take_orders()
    assert shed and saves == () and restores == ()
