"""How every layer declares its settings, and the one check of their values.

A layer's configuration is a frozen dataclass; each field that users may set carries
`setting(env, doc, ...)` as its metadata: the `BALLAST_*` variable, a one-line doc, and for
numbers the accepted range, for strings optional choices. Each variable is declared by one field
of one layer. `check(config)` (called by every layer's `__post_init__`) enforces those ranges,
choices and types, so no layer restates them; the CLI (`ballast.server.config`) derives a flag from
each variable (`BALLAST_MAX_NUM_SEQS` <-> `--max-num-seqs`) and parses values strictly.

A new setting is one field: `name: int = field(default=..., metadata=setting("BALLAST_NAME",
"what it does", lo, hi))`; its flag, parsing, range check, error message and the documented table
follow from it.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """A setting has a value outside what it accepts (the message names its flag and variable),
    or two settings contradict each other."""


def setting(
    env: str,
    doc: str,
    lo: float | None = None,
    hi: float | None = None,
    *,
    choices: tuple[str, ...] | None = None,
    flag: str | None = None,
    deprecated: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Field metadata declaring a setting (see the module doc). `deprecated`: former variable
    names still read (their flags too), with a warning, for one release."""
    meta: dict[str, Any] = {"env": env, "doc": doc, "deprecated": deprecated}
    if lo is not None and hi is not None:
        meta["range"] = (lo, hi)
    if choices is not None:
        meta["choices"] = choices
    if flag is not None:
        meta["flag"] = flag
    return meta


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
    deprecated: tuple[str, ...] = ()  # former variable names (see `setting`)
    default: Any = None  # the field's default

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

    def problem(self, value: object) -> str | None:
        """Why `value` is not acceptable here, as "is ..." (None: it is)."""
        if value is None:
            return None if self.optional else "is required"
        if self.kind is bool:
            return None if isinstance(value, bool) else "is not a bool"
        if self.kind is str:
            if not isinstance(value, str):
                return "is not a string"
            if not value:
                return "is empty"
        elif isinstance(value, bool) or not isinstance(value, int if self.kind is int else int | float):
            return "is not an integer" if self.kind is int else "is not a number"
        if self.choices and value not in self.choices:
            return "is not one of the choices"
        if self.range and isinstance(value, int | float) and not self.range[0] <= value <= self.range[1]:
            return "is out of range"
        return None


def settings_of(layer: type) -> list[Setting]:
    """The settings a layer config declares: every field whose metadata names an `env`."""
    hints = typing.get_type_hints(layer)
    out = []
    for f in dataclasses.fields(layer):
        meta = f.metadata
        if "env" not in meta:
            continue
        kind, optional = _field_kind(hints[f.name])
        rng = meta.get("range")
        choices = meta.get("choices")
        out.append(
            Setting(
                layer=layer,
                name=f.name,
                env=meta["env"],
                flag=meta.get("flag") or flag_for(meta["env"]),
                kind=kind,
                optional=optional,
                doc=meta.get("doc", ""),
                range=(rng[0], rng[1]) if rng else None,
                choices=tuple(choices) if choices else None,
                deprecated=tuple(meta.get("deprecated", ())),
                default=f.default,
            )
        )
    return out


def check(config: object) -> None:
    """Every setting of a built config holds an accepted value; raises ConfigError naming the first
    that does not."""
    for s in settings_of(type(config)):
        value = getattr(config, s.name)
        why = s.problem(value)
        if why is not None:
            raise ConfigError(f"{s.label}={value!r} {why}: accepted {s.accepted()} ({s.doc})")


def flag_for(env: str) -> str:
    return "--" + env.removeprefix("BALLAST_").lower().replace("_", "-")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1 << 53 else repr(x)


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
