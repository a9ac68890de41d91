"""Where ballast keeps what it fetches or builds once per machine: the default model's GGUF and the
CPU block kernel built for this CPU."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

CACHE_ENV = "BALLAST_CACHE_DIR"


class CacheDirError(RuntimeError):
    """$BALLAST_CACHE_DIR names no usable directory."""


def cache_dir(env: Mapping[str, str] = os.environ) -> Path:
    """`$BALLAST_CACHE_DIR`, else `~/.cache/ballast`. A set-but-empty variable is an error, not a
    silent fallback: the operator meant something by setting it."""
    raw = env.get(CACHE_ENV)
    if raw is None:
        return Path.home() / ".cache" / "ballast"
    if not raw.strip():
        raise CacheDirError(f"{CACHE_ENV} is set but empty; unset it or give a directory")
    return Path(raw).expanduser()
