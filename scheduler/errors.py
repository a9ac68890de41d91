"""Typed refusals the scheduler raises (synchronously from `submit`) or puts in a `FinishEvent`.

They are mapped to HTTP status codes and OpenAI error bodies in one place, `ballast.server.errors`.
"""

from __future__ import annotations


class Refused(Exception):
    """Base of every way the scheduler declines or ends a request other than by finishing it."""

    retryable: bool = False


class RetryLater(Refused):
    """A refusal the client may retry, here or elsewhere, after `retry_after_s` (Retry-After)."""

    retryable = True

    def __init__(self, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(RetryLater):
    """Memory pressure (CRITICAL, or an admission REJECT) or a scheduler that is not running."""

    def __init__(self, retry_after_s: float, reason: str) -> None:
        super().__init__(retry_after_s, f"server overloaded: {reason} (retry after {retry_after_s:g} s)")
        self.reason = reason


class QueueFull(RetryLater):
    """The bounded waiting queue is full."""

    def __init__(self, retry_after_s: float, max_queue: int = 0) -> None:
        super().__init__(
            retry_after_s, f"request queue is full ({max_queue} waiting); retry after {retry_after_s:g} s"
        )


class ContextTooLong(Refused):
    """prompt + max_tokens cannot fit the model's context (a client error; retrying will not help)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int) -> None:
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} for the "
            "completion). Please reduce the prompt or the completion length."
        )
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class RequestTimeout(Refused):
    """The request's deadline passed (waiting or running); its slot was released cleanly."""

    def __init__(self, timeout_s: float, completion_tokens: int = 0) -> None:
        super().__init__(f"request timed out after {timeout_s:.3g} s ({completion_tokens} tokens generated)")


class StepAborted(RetryLater):
    """The engine step running this request failed and was recovered (an out-of-memory error, a
    bug hit by this batch): the request is lost, the server is sound, and trying again may work."""

    def __init__(self, retry_after_s: float, cause: str, completion_tokens: int = 0) -> None:
        super().__init__(
            retry_after_s,
            f"the engine step running this request failed ({cause}); "
            f"{completion_tokens} tokens had been generated; retry after {retry_after_s:g} s",
        )


class QueueWaitTooLong(RetryLater):
    """The request would not (or did not) start within the queue-wait bound, for want of a slot,
    of KV blocks or of prefill compute (`waits_for`): refused at once instead of waiting, so a
    client or load balancer can go elsewhere."""

    def __init__(
        self,
        retry_after_s: float,
        wait_s: float,
        bound_s: float,
        estimated: bool,
        waits_for: str = "a slot",
        share: float = 1.0,
    ) -> None:
        """share: the part of the bound the wait was held to (a new request's projection: 0.7)."""
        how = "estimated wait" if estimated else "waited"
        limit = (
            f"max queue wait {bound_s:g} s" if share == 1.0 else f"{share:g} of max queue wait {bound_s:g} s"
        )
        super().__init__(
            retry_after_s,
            f"cannot start in time (waiting for {waits_for}): {how} {wait_s:.3g} s > {limit}; "
            f"retry after {retry_after_s:g} s",
        )
        self.wait_s = wait_s
        self.waits_for = waits_for


class RequestFailed(Refused):
    """Handling this request's output failed (a detokenizer error): only this request ends; the
    engine and every other request go on."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"request failed: {type(cause).__name__}: {cause}")


class EngineFailed(Refused):
    """A step failed on the engine thread: the engine is unsound, every in-flight request ends with
    this error and the scheduler stops taking work (`/health` should fail)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.cause = cause


class EngineStalled(RetryLater):
    """A step did not return within the watchdog's deadline (a stuck kernel, a deadlocked
    collective): every request ends with this, the server reports itself unsound and exits. The
    request may succeed on another replica, or on this one once restarted."""

    def __init__(self, retry_after_s: float, waited_s: float, deadline_s: float) -> None:
        super().__init__(
            retry_after_s,
            f"the engine stalled: a step has not returned after {waited_s:.1f} s (deadline "
            f"{deadline_s:.1f} s); the server is restarting; retry after {retry_after_s:g} s",
        )
        self.deadline_s = deadline_s


# The `outcomes` label of each refusal kind; any other (EngineFailed) counts as "failed".
_OUTCOME_LABELS: tuple[tuple[type[Refused], str], ...] = (
    (RequestTimeout, "timeout"),
    (Overloaded, "overloaded"),
    (QueueFull, "queue_full"),
    (QueueWaitTooLong, "queue_wait"),
    (ContextTooLong, "context_length"),
    (StepAborted, "step_failed"),
    (EngineStalled, "stalled"),
    (RequestFailed, "request_failed"),
)
REFUSAL_OUTCOMES = (*(label for _, label in _OUTCOME_LABELS), "failed")


def outcome_of(error: Refused) -> str:
    return next((label for kind, label in _OUTCOME_LABELS if isinstance(error, kind)), "failed")
