"""The bounded FCFS waiting queue: requests that were accepted but hold no slot yet."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class WaitingQueue(Generic[T]):
    """First come, first served. Only the head is ever admitted, so a request can never be
    overtaken by a later one (no starvation); removal from the middle (abort, deadline, refusal
    at CRITICAL) goes through `remove`."""

    def __init__(self, max_size: int) -> None:
        if max_size < 0:
            raise ValueError("queue size must be >= 0")
        self.max_size = max_size
        self._items: deque[T] = deque()

    @property
    def full(self) -> bool:
        return len(self._items) >= self.max_size

    def push(self, item: T) -> None:
        """The caller checks `full` first and raises its typed refusal; this is the guard."""
        if self.full:
            raise OverflowError(f"waiting queue is full ({self.max_size})")
        self._items.append(item)

    def push_front(self, item: T) -> None:
        """Put back a request that already held a slot (preempted), ahead of everyone: it was
        admitted before any of them. It may exceed max_size by the requests preempted at once."""
        self._items.appendleft(item)

    def head(self) -> T | None:
        return self._items[0] if self._items else None

    def pop_head(self) -> T:
        return self._items.popleft()

    def remove(self, item: T) -> None:
        """Take a waiting item out of the queue, wherever it stands."""
        self._items.remove(item)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)
