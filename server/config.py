"""THE one configuration path: CLI flags and `BALLAST_*` variables -> one frozen config per layer.

Every layer states its settings as fields of a frozen dataclass whose metadata names the
environment variable (`env`), the accepted range (`range`, for numbers), optional `choices` (for
strings) and a one-line `doc`; see `ballast.memory.config.MemoryConfig`. This module reads those
fields, so a new setting needs no change here. The flag of a setting is `metadata["flag"]` if
given, else derived from its variable: `BALLAST_MAX_NUM_SEQS` <-> `--max-num-seqs`. A flag beats
the variable, the variable beats the default.

Values are parsed strictly (a bool is exactly "1", "0", "true" or "false"; an int has no
fraction, no blanks and no underscores; a float is finite). A bad value raises `ConfigError` naming
the flag, the variable and the accepted range; the CLI turns it into exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

_INT_RE = re.compile(r"[+-]?[0-9]+")
_FLOAT_RE = re.compile(r"[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?")
_BOOLS = {"1": True, "true": True, "0": False, "false": False}

C = TypeVar("C")


class ConfigError(ValueError):
    """A setting has a value outside what it accepts; the message names the flag and variable."""


def _setting(env: str, doc: str, lo: float | None = None, hi: float | None = None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"env": env, "doc": doc, **extra}
    if lo is not None and hi is not None:
        meta["range"] = (lo, hi)
    return meta


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP layer's settings."""

    host: str = field(default="127.0.0.1", metadata=_setting("BALLAST_HOST", "address to listen on"))
    port: int = field(default=8000, metadata=_setting("BALLAST_PORT", "TCP port to listen on (0 = any free port)", 0, 65535))
    api_key: str | None = field(default=None, metadata=_setting("BALLAST_API_KEY", "if set, /v1 requires 'Authorization: Bearer <key>'"))
    max_body_bytes: int = field(default=8 << 20, metadata=_setting("BALLAST_MAX_BODY_BYTES", "largest request body accepted (413 beyond)", 1024, 1 << 34))
    body_timeout_s: float = field(default=30.0, metadata=_setting("BALLAST_BODY_TIMEOUT_S", "longest wait for the next piece of a request body (408 beyond: a slowloris client cannot hold a handler)", 0.1, 3600.0))
    served_model_name: str | None = field(default=None, metadata=_setting("BALLAST_SERVED_MODEL_NAME", "model name clients use; default: the engine's model name"))
    log_level: str = field(default="info", metadata=_setting("BALLAST_LOG_LEVEL", "uvicorn log level", choices=("critical", "error", "warning", "info", "debug")))
    log_format: str = field(default="text", metadata=_setting("BALLAST_LOG_FORMAT", "'json': one JSON object per log line, with request, verdict, refusal and level-change events", choices=("text", "json")))
    log_prompts: bool = field(default=False, metadata=_setting("BALLAST_LOG_PROMPTS", "put the prompt text in request events (off: never logged)"))
    dashboard: bool = field(default=True, metadata=_setting("BALLAST_DASHBOARD", "serve the live page /dashboard and its JSON /dashboard/state"))

    def __post_init__(self) -> None:
        check_ranges(self)
        if self.api_key is not None and not self.api_key:
            raise ConfigError("BALLAST_API_KEY / --api-key must not be empty (leave it unset for no auth)")


@dataclass(frozen=True)
class Setting:
    """One configurable field of one layer's config."""

    layer: type
    name: str  # the dataclass field
    env: str
    flag: str
    kind: type  # int, float, bool or str
    optional: bool  # None is a legal value (the default of an unset optional setting)
    doc: str
    range: tuple[float, float] | None
    choices: tuple[str, ...] | None

    @property
    def label(self) -> str:
        return f"{self.flag} ({self.env})"

    def accepted(self) -> str:
        if self.kind is bool:
            return "one of 1, 0, true, false"
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.range:
            lo, hi = self.range
            return f"{self.kind.__name__} in {_num(lo)}..{_num(hi)}"
        return f"a non-empty {self.kind.__name__}"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1 << 53 else repr(x)


def _flag_for(env: str) -> str:
    return "--" + env.removeprefix("BALLAST_").lower().replace("_", "-")


def _field_kind(hint: Any) -> tuple[type, bool]:
    """(base type, optional) of a field annotation such as `int`, `str | None`."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and rest[0] in (int, float, bool, str):
            return rest[0], True
    if hint in (int, float, bool, str):
        return hint, False
    raise TypeError(f"unsupported config field type {hint!r}")


# Settings of layer configs whose fields carry no metadata (yet): the same keys, stated here.
# Field metadata, where present, wins; a field named here that the layer lacks is a TypeError.
def settings_of(layer: type) -> list[Setting]:
    """The settings a layer config declares: every field whose metadata names an `env`."""
    hints = typing.get_type_hints(layer)
    out = []
    for f in dataclasses.fields(layer):
        meta = f.metadata
        if "env" not in meta:
            continue
        env = meta["env"]
        kind, optional = _field_kind(hints[f.name])
        rng = meta.get("range")
        choices = meta.get("choices")
        out.append(
            Setting(
                layer=layer,
                name=f.name,
                env=env,
                flag=meta.get("flag") or _flag_for(env),
                kind=kind,
                optional=optional,
                doc=meta.get("doc", ""),
                range=(rng[0], rng[1]) if rng else None,
                choices=tuple(choices) if choices else None,
            )
        )
    return out


def parse_value(setting: Setting, raw: str, source: str) -> int | float | bool | str:
    """Parse one raw string strictly; `source` (the flag or the variable) names it in errors."""
    where = f"{source}={raw!r}"
    bad = ConfigError(f"{where} is not valid for {setting.label}: accepted {setting.accepted()} ({setting.doc})")
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


def check_ranges(config: object) -> None:
    """Range and choice checks of a built config (for values that did not come through parsing)."""
    for s in settings_of(type(config)):
        value = getattr(config, s.name)
        if value is None and s.optional:
            continue
        if s.choices and value not in s.choices:
            raise ConfigError(f"{s.label}={value!r}: accepted {s.accepted()} ({s.doc})")
        if s.range and not isinstance(value, bool) and isinstance(value, int | float):
            lo, hi = s.range
            if not lo <= value <= hi:
                raise ConfigError(f"{s.label}={value!r} is out of range: accepted {s.accepted()} ({s.doc})")


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
            help_text = f"{s.doc}; {s.accepted()}; env {s.env}".replace("%", "%%")
            dest = "cfg_" + s.env.lower()
            if s.kind is bool:
                # `--flag` alone means true; `--flag false` is also accepted, for scripts.
                group.add_argument(s.flag, dest=dest, nargs="?", const="1", default=None, metavar="BOOL", help=help_text)
            else:
                group.add_argument(s.flag, dest=dest, default=None, metavar=s.kind.__name__.upper(), help=help_text)


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
    try:
        return layer(**values)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:  # the layer's own cross-field validation
        raise ConfigError(f"{layer.__name__}: {exc}") from exc


def unknown_variables(environ: Mapping[str, str], layers: Sequence[type], also_known: Sequence[str] = ()) -> list[str]:
    """`BALLAST_*` variables no layer declares: most likely typos, which the CLI warns about."""
    known = {s.env for layer in layers for s in settings_of(layer)} | set(also_known)
    return sorted(k for k in environ if k.startswith("BALLAST_") and k not in known)


def warn_unknown(environ: Mapping[str, str], layers: Sequence[type], also_known: Sequence[str] = ()) -> None:
    for name in unknown_variables(environ, layers, also_known):
        print(f"ballast: warning: {name} is set but no setting reads it (typo?)", file=sys.stderr)
