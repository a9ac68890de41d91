"""Device (GPU) memory signals: NVML per GPU, `torch.cuda.mem_get_info` as a fallback, nothing on
a CPU-only box.

MemWatch polls a `DeviceReader` every tick, so another process taking VRAM is seen even while we
idle. NVML needs no CUDA context; the torch fallback is used only when torch has already
initialised CUDA, because a first CUDA call from the watcher would create a context (hundreds of
MiB of VRAM per device) in a process that may never have wanted one.

Die indices are CUDA ordinals as torch numbers them (after CUDA_VISIBLE_DEVICES), so the figures
line up with the engine's devices and the ledger's dies.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DieReading:
    """Driver figures for one GPU."""

    index: int  # CUDA ordinal
    name: str
    total_bytes: int
    free_bytes: int

    @property
    def used_bytes(self) -> int:
        return max(0, self.total_bytes - self.free_bytes)


class DeviceReader(Protocol):
    def read(self) -> tuple[DieReading, ...]:
        """Current figures for every visible GPU; () when there are none."""
        ...


class StaticDeviceReader:
    """Figures set by the caller instead of a driver: tests feed die figures through it, and a
    host whose GPUs are accounted elsewhere can state them. `set()` replaces them atomically."""

    def __init__(self, dies: Iterable[DieReading] = ()) -> None:
        self._dies = tuple(dies)

    def set(self, *dies: DieReading) -> None:
        self._dies = tuple(dies)

    def read(self) -> tuple[DieReading, ...]:
        return self._dies


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used here (no driver, no library, or a device list it cannot map)."""


def _visible_entries() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES split into entries, or None when unset (every GPU visible)."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return None
    return [e.strip() for e in raw.split(",") if e.strip()]


class NvmlReader:
    """Per-GPU figures from NVML. Initialised once, on the first read; if that fails (no driver,
    no GPU) it reports no GPUs from then on, and `available` is False."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] | None = None
        self._failed = False

    @property
    def available(self) -> bool:
        if self._handles is None and not self._failed:
            try:
                self._init()
            except NvmlUnavailable as e:
                log.info("NVML unavailable, no NVML GPU figures: %s", e)
                self._failed = True
        return self._handles is not None

    def _init(self) -> None:
        try:
            import pynvml
        except ImportError as e:
            raise NvmlUnavailable(f"pynvml not importable: {e}") from e
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            all_handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            entries = _visible_entries()
            if entries is None:
                chosen = all_handles
            else:
                uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in all_handles]
                chosen = [map_visible_entry(e, all_handles, uuids) for e in entries]
        except pynvml.NVMLError as e:
            raise NvmlUnavailable(str(e)) from e
        self._nvml = pynvml
        self._handles = list(enumerate(chosen))

    def read(self) -> tuple[DieReading, ...]:
        if not self.available or self._handles is None:
            return ()
        out = []
        for index, handle in self._handles:
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                name = _text(self._nvml.nvmlDeviceGetName(handle))
            except self._nvml.NVMLError as e:
                # A GPU that stops answering (fell off the bus, driver reset) is left out of this
                # poll rather than reported with invented figures.
                log.warning("NVML read failed for GPU %d: %s", index, e)
                continue
            out.append(
                DieReading(index=index, name=name, total_bytes=int(mem.total), free_bytes=int(mem.free))
            )
        return tuple(out)


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py versions return bytes.
    return value.decode() if isinstance(value, bytes) else value


def map_visible_entry(entry: str, handles: list[Any], uuids: list[str]) -> Any:
    """The NVML handle of one CUDA_VISIBLE_DEVICES entry: an NVML index or a (prefix of a) GPU
    UUID. MIG instances and anything else cannot be mapped here; the torch fallback handles them."""
    if entry.isdigit():
        if int(entry) >= len(handles):
            raise NvmlUnavailable(f"CUDA_VISIBLE_DEVICES names GPU {entry}, NVML sees {len(handles)}")
        return handles[int(entry)]
    if entry.startswith("GPU-"):
        matches = [h for h, u in zip(handles, uuids, strict=True) if u.startswith(entry)]
        if len(matches) == 1:
            return matches[0]
    raise NvmlUnavailable(f"cannot map CUDA_VISIBLE_DEVICES entry {entry!r} to an NVML device")


class TorchCudaReader:
    """Figures from `torch.cuda.mem_get_info`, only for devices torch already works on.

    It never imports torch and never touches a device without a context of ours: only devices
    whose caching allocator holds memory, or the current device, are queried.
    """

    def read(self) -> tuple[DieReading, ...]:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return ()
        current = torch.cuda.current_device()
        out = []
        for index in range(torch.cuda.device_count()):
            if index != current and torch.cuda.memory_reserved(index) == 0:
                continue
            free, total = torch.cuda.mem_get_info(index)
            out.append(
                DieReading(
                    index=index,
                    name=torch.cuda.get_device_name(index),
                    total_bytes=int(total),
                    free_bytes=int(free),
                )
            )
        return tuple(out)


class SystemDeviceReader:
    """The default reader: NVML when it works, else torch's view of the devices it uses."""

    def __init__(self) -> None:
        self._nvml = NvmlReader()
        self._torch = TorchCudaReader()

    def read(self) -> tuple[DieReading, ...]:
        if self._nvml.available:
            return self._nvml.read()
        return self._torch.read()
