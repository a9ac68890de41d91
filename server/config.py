"""THE one configuration path: CLI flags and `BALLAST_*` variables -> one frozen config per layer.

Every layer declares its settings as fields of a frozen dataclass (`ballast.settings`). This
module reads those declarations, so a new setting needs no change here. The flag of a setting is
`metadata["flag"]` if given, else derived from its variable: `BALLAST_MAX_NUM_SEQS` <->
`--max-num-seqs`. A flag beats the variable, the variable beats the default.

Values are parsed strictly (a bool is exactly "1", "0", "true" or "false"; an int has no
fraction, no blanks and no underscores; a float is finite). A bad value raises `ConfigError` naming
the flag, the variable and the accepted range; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ballast.settings import ConfigError, Setting, check, flag_for, setting, settings_of

_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
_ORIGIN_RE = re.compile(r"https?://[^/\s,]+")
_BOOLS = {"1": True, "true": True, "0": False, "false": False}

C = TypeVar("C")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP layer's settings."""

    host: str = field(default="127.0.0.1", metadata=setting("BALLAST_HOST", "address to listen on"))
    port: int = field(
        default=8000, metadata=setting("BALLAST_PORT", "TCP port to listen on (0 = any free port)", 0, 65535)
    )
    api_key: str | None = field(
        default=None,
        metadata=setting(
            "BALLAST_API_KEY",
            "if set, /v1 requires 'Authorization: Bearer <key>' (and /dashboard the key, as Bearer or as "
            "the password of HTTP Basic)",
        ),
    )
    max_body_bytes: int = field(
        default=8 << 20,
        metadata=setting(
            "BALLAST_MAX_BODY_BYTES", "largest request body accepted (413 beyond)", 1024, 1 << 34
        ),
    )
    max_parsing_bytes: int = field(
        default=64 << 20,
        metadata=setting(
            "BALLAST_MAX_PARSING_BYTES",
            "request bodies read and parsed at once, in bytes (429 + Retry-After beyond): parsing takes "
            "up to 8x a body's bytes of heap, booked against the host budget",
            1024,
            1 << 36,
        ),
    )
    max_concurrent_requests: int = field(
        default=1024,
        metadata=setting(
            "BALLAST_MAX_CONCURRENT_REQUESTS",
            "HTTP requests in flight at once (429 + Retry-After beyond; /health, /ready and /metrics "
            "are never refused): each holds a handler, its prompt and its mailbox before the queue "
            "bounds it",
            1,
            1 << 20,
        ),
    )
    body_timeout_s: float = field(
        default=30.0,
        metadata=setting(
            "BALLAST_BODY_TIMEOUT_S",
            "longest wait for the next piece of a request body (408 beyond: a slowloris client cannot hold "
            "a handler)",
            0.1,
            3600.0,
        ),
    )
    header_timeout_s: float = field(
        default=30.0,
        metadata=setting(
            "BALLAST_HEADER_TIMEOUT_S",
            "longest wait for a request's headers, from the connection's opening or the request's first "
            "byte (408 and close beyond: a client trickling its headers cannot hold a connection)",
            0.1,
            3600.0,
        ),
    )
    served_model_name: str | None = field(
        default=None,
        metadata=setting(
            "BALLAST_SERVED_MODEL_NAME", "model name clients use; default: the engine's model name"
        ),
    )
    special_tokens_in_chat: bool = field(
        default=False,
        metadata=setting(
            "BALLAST_SPECIAL_TOKENS_IN_CHAT",
            "parse special-token strings in chat message content (and every other field the template "
            "renders) as control tokens (off: they are text, so a user cannot forge a turn)",
        ),
    )
    log_level: str = field(
        default="info",
        metadata=setting(
            "BALLAST_LOG_LEVEL",
            "uvicorn log level",
            choices=("critical", "error", "warning", "info", "debug"),
        ),
    )
    log_format: str = field(
        default="text",
        metadata=setting(
            "BALLAST_LOG_FORMAT",
            "'json': one JSON object per log line, with request, verdict, refusal and level-change events",
            choices=("text", "json"),
        ),
    )
    log_prompts: bool = field(
        default=False,
        metadata=setting("BALLAST_LOG_PROMPTS", "put the prompt text in request events (off: never logged)"),
    )
    dashboard: bool = field(
        default=True,
        metadata=setting("BALLAST_DASHBOARD", "serve the live page /dashboard and its JSON /dashboard/state"),
    )

    reasoning_parser: str = field(
        default="auto",
        metadata=setting(
            "BALLAST_REASONING_PARSER",
            "how to split a reasoning model's thinking from its answer: 'auto' reads <think>...</think> "
            "when the chat template writes </think>, 'think' always, 'none' never",
            choices=("auto", "think", "none"),
        ),
    )
    allowed_origins: str | None = field(
        default=None,
        metadata=setting(
            "BALLAST_ALLOWED_ORIGINS",
            "comma-separated origins browsers may call the API from (CORS), or '*' for any; unset: "
            "no CORS headers, so browsers refuse cross-origin calls",
        ),
    )

    def __post_init__(self) -> None:
        check(self)
        if self.max_body_bytes > self.max_parsing_bytes:
            raise ConfigError(
                f"BALLAST_MAX_BODY_BYTES={self.max_body_bytes} is above BALLAST_MAX_PARSING_BYTES="
                f"{self.max_parsing_bytes}: a body that large could never be read"
            )
        for origin in self.origins():
            if origin != "*" and not _ORIGIN_RE.fullmatch(origin):
                raise ConfigError(
                    f"--allowed-origins: {origin!r} is not '*' or an origin such as https://app.example.com"
                )

    def origins(self) -> tuple[str, ...]:
        if self.allowed_origins is None:
            return ()
        return tuple(o.strip() for o in self.allowed_origins.split(","))


def parse_value(setting: Setting, raw: str, source: str) -> int | float | bool | str:
    """Parse one raw string strictly; `source` (the flag or the variable) names it in errors."""
    where = f"{source}={raw!r}"
    bad = ConfigError(
        f"{where} is not valid for {setting.label}: accepted {setting.accepted()} ({setting.doc})"
    )
    value: int | float | bool | str
    if setting.kind is bool:
        if raw not in _BOOLS:
            raise bad
        return _BOOLS[raw]
    if setting.kind is int:
        if not _INT_RE.fullmatch(raw):
            raise bad
        value = int(raw)
    elif setting.kind is float:
        if not _FLOAT_RE.fullmatch(raw) or not math.isfinite(float(raw)):
            raise bad
        value = float(raw)
    else:
        if not raw or raw != raw.strip():
            raise bad
        value = raw
    if setting.choices and value not in setting.choices:
        raise bad
    if setting.range and isinstance(value, int | float):
        lo, hi = setting.range
        if not lo <= value <= hi:
            raise bad
    return value


def add_flags(parser: argparse.ArgumentParser, layers: Sequence[type]) -> None:
    """One option per distinct variable; two layers sharing a variable share the flag."""
    seen: dict[str, str] = {}
    for layer in layers:
        group = parser.add_argument_group(layer.__name__)
        for s in settings_of(layer):
            if s.flag in seen:
                if seen[s.flag] != s.env:
                    raise TypeError(f"flag {s.flag} claimed by {seen[s.flag]} and {s.env}")
                continue
            seen[s.flag] = s.env
            for old in s.deprecated:  # still accepted, not shown
                group.add_argument(
                    flag_for(old), dest="cfg_" + old.lower(), default=None, help=argparse.SUPPRESS
                )
            default = (
                "unset" if s.default is None else str(s.default).lower() if s.kind is bool else s.default
            )
            help_text = f"{s.doc}; {s.accepted()}; default {default}; env {s.env}".replace("%", "%%")
            dest = "cfg_" + s.env.lower()
            if s.kind is bool:
                # `--flag` alone means true; `--flag false` is also accepted, for scripts.
                group.add_argument(
                    s.flag, dest=dest, nargs="?", const="1", default=None, metavar="BOOL", help=help_text
                )
            else:
                group.add_argument(
                    s.flag, dest=dest, default=None, metavar=s.kind.__name__.upper(), help=help_text
                )


def build(layer: type[C], args: argparse.Namespace | None, environ: Mapping[str, str], **fixed: Any) -> C:
    """Build one layer's config from flags (None: no flags), the environment and fixed values
    (used for fields that are not settings, e.g. the memory layer's root)."""
    values: dict[str, Any] = dict(fixed)
    for s in settings_of(layer):
        raw_flag = getattr(args, "cfg_" + s.env.lower(), None) if args is not None else None
        if raw_flag is not None:
            values[s.name] = parse_value(s, raw_flag, s.flag)
        elif s.env in environ:
            values[s.name] = parse_value(s, environ[s.env], s.env)
        else:
            for old in s.deprecated:
                raw_old = getattr(args, "cfg_" + old.lower(), None) if args is not None else None
                source, raw = (flag_for(old), raw_old) if raw_old is not None else (old, environ.get(old))
                if raw is not None:
                    print(
                        f"ballast: warning: {source} is deprecated, use "
                        f"{s.flag if source.startswith('--') else s.env}",
                        file=sys.stderr,
                    )
                    values[s.name] = parse_value(s, raw, source)
                    break
    try:
        return layer(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # the layer's own cross-field validation
        raise ConfigError(f"{layer.__name__}: {exc}") from exc


def unknown_variables(
    environ: Mapping[str, str], layers: Sequence[type], also_known: Sequence[str] = ()
) -> list[str]:
    """`BALLAST_*` variables no layer declares: most likely typos, which the CLI warns about."""
    known = {e for layer in layers for s in settings_of(layer) for e in (s.env, *s.deprecated)} | set(
        also_known
    )
    return sorted(k for k in environ if k.startswith("BALLAST_") and k not in known)


def warn_unknown(environ: Mapping[str, str], layers: Sequence[type], also_known: Sequence[str] = ()) -> None:
    for name in unknown_variables(environ, layers, also_known):
        print(f"ballast: warning: {name} is set but no setting reads it (typo?)", file=sys.stderr)
