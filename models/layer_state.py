"""The interface every decoder layer's per-slot state implements (models/state.py has the kinds).

Its own module, imported by the model interface (models/base.py) and by the state kinds alike, so
that neither imports the other."""

from __future__ import annotations

import abc
from collections.abc import Sequence

from torch import Tensor


class LayerState(abc.ABC):
    """One decoder layer's state for every slot."""

    @abc.abstractmethod
    def reset(self, slots: Tensor) -> None:
        """Sequences start at position 0 in these slots."""

    @abc.abstractmethod
    def slot_views(self, slot: int) -> tuple[Tensor, ...]:
        """Views (no copy) of the slot's own state: what a checkpoint must copy to resume the slot
        later (empty where the state is shared by reference, as attention blocks are)."""

    @abc.abstractmethod
    def load(self, slot: int, saved: Sequence[Tensor]) -> None:
        """Put tensors shaped like `slot_views` (from any slot) into this slot."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes this state holds on its device."""
