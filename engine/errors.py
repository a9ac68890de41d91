"""The engine's errors (the step's own classification of failures is in `faults`)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Base of the engine's errors."""


class PlanError(EngineError):
    """A StepPlan asks for something impossible (a slot out of range, a position past capacity)."""


class EngineUnhealthy(EngineError):
    """A previous step failed; the engine's device state can no longer be trusted."""
