"""Operator events in the log, and the JSON log format (`--log-format json`).

An event is an ordinary log record whose extra fields carry the facts (`event`, `request_id`,
...): in text mode it reads as a sentence, in JSON mode it is one object per line with those
fields at the top level, so a log pipeline can filter on `event` without parsing prose. Each fact
is logged once, where it is decided:

- `level` (logger `ballast.events.level`): the memory level changed (from the MemWatch listener).
- `request` / `finished` / `refused` (logger `ballast.events.request`): a request was accepted
  for scheduling, ended (outcome, tokens, latencies), or was refused (status and reason).
- `verdict` (logger `ballast.events.request`, logged by the scheduler): admission's answer.
- `first_token` (the same logger, by the scheduler): a request queued with a projected wait got its
  first token, after how long against the projection (the queue-wait estimate's error).

Prompt and output text are never logged, unless the operator asks for prompts (`--log-prompts`).
Per-request events are quiet in text mode unless the log level is debug: a busy server would
otherwise print several lines per request in a format nobody parses.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import TYPE_CHECKING, Any

from ballast.memory.types import Level, MemState

if TYPE_CHECKING:
    from ballast.engine.interface import TokenizerLike
    from ballast.scheduler.request import GenerationRequest

LEVEL_LOG = logging.getLogger("ballast.events.level")
REQUEST_LOG = logging.getLogger("ballast.events.request")

# Attributes every LogRecord has; anything else on a record came from `extra=` and is an event field.
# uvicorn's `color_message` is its message again with terminal colour codes: not for a log pipeline.
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",
    "color_message",
}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, then the event's own fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": dt.datetime.fromtimestamp(record.created, dt.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(log_format: str, log_level: str) -> None:
    """Root logging for `ballast serve`: text lines, or JSON objects, on stderr."""
    handler = logging.StreamHandler()
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(log_level.upper())
    logging.captureWarnings(log_format == "json")  # a library's warning is a log line too, not bare text
    quiet = log_format == "text" and log_level != "debug"
    REQUEST_LOG.setLevel(logging.WARNING if quiet else logging.NOTSET)


def level_changed(old: Level, new: Level, state: MemState) -> None:
    """A MemWatch listener: log each change of the overall memory level, once."""
    h = state.host
    LEVEL_LOG.log(
        logging.WARNING if new > old and new >= Level.TIGHT else logging.INFO,
        "memory level %s -> %s (available %d B, reserve %d B, PSI full %.2f %%)",
        old.name,
        new.name,
        h.effective_available_bytes,
        state.host_reserve_bytes,
        h.psi_full_avg10,
        extra={
            "event": "level",
            "from": old.name,
            "to": new.name,
            "host_level": state.host_level.name,
            "available_bytes": h.effective_available_bytes,
            "reserve_bytes": state.host_reserve_bytes,
            "psi_some_avg10": h.psi_some_avg10,
            "psi_full_avg10": h.psi_full_avg10,
            "gpu_levels": {str(d.index): d.level.name for d in state.dies},
        },
    )


def request_accepted(
    endpoint: str, gen: GenerationRequest, tokenizer: TokenizerLike, with_prompt: bool
) -> None:
    fields: dict[str, Any] = {
        "event": "request",
        "request_id": gen.request_id,
        "endpoint": endpoint,
        "prompt_tokens": len(gen.prompt_ids),
        "max_tokens": gen.max_tokens,
    }
    if with_prompt and REQUEST_LOG.isEnabledFor(logging.INFO):
        fields["prompt"] = tokenizer.decode(list(gen.prompt_ids))
    REQUEST_LOG.info(
        "request %s: %s, %d prompt tokens, max_tokens %d",
        gen.request_id,
        endpoint,
        len(gen.prompt_ids),
        gen.max_tokens,
        extra=fields,
    )


def request_refused(request_id: str, endpoint: str, status: int, code: str | None, reason: str) -> None:
    REQUEST_LOG.info(
        "request %s refused: %d %s: %s",
        request_id,
        status,
        code,
        reason,
        extra={
            "event": "refused",
            "request_id": request_id,
            "endpoint": endpoint,
            "status": status,
            "code": code,
            "reason": reason,
        },
    )


def request_finished(
    request_id: str,
    endpoint: str,
    outcome: str,
    prompt_tokens: int,
    completion_tokens: int,
    ttft_s: float | None,
    e2e_s: float,
) -> None:
    REQUEST_LOG.info(
        "request %s finished: %s, %d prompt + %d completion tokens in %.3f s",
        request_id,
        outcome,
        prompt_tokens,
        completion_tokens,
        e2e_s,
        extra={
            "event": "finished",
            "request_id": request_id,
            "endpoint": endpoint,
            "outcome": outcome,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "ttft_s": None if ttft_s is None else round(ttft_s, 6),
            "e2e_s": round(e2e_s, 6),
        },
    )
