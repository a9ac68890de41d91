"""The C block kernel (models/kernels/cpu_blocks.c): built for this CPU at first use, loaded
through ctypes, and the calls that need nothing above the KV store: the paged decode attention.

The C compiler (`$CC`, else `cc`) builds the kernel with -march=native into the cache directory
once, keyed by the source, flags, compiler and CPU; without a compiler or AVX2/FMA the form is
unavailable and `auto` loads dense weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch
from ballast.models.base import ForwardBatch
from ballast.models.cache_dir import cache_dir
from ballast.models.kv_store import KVStore
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_blocks.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_P, _I, _T = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "q4_matmul": [_P, _I, _I, _P, _I, _P, _T],
    "q8_matmul": [_P, _I, _I, _P, _I, _P, _T],
    "q4_dequantize": [_P, _I, _I, _P, _T],
    "q8_dequantize": [_P, _I, _I, _P, _T],
    "llama_decode_work": [_P, _I, _I],
    "llama_decode": [_P, _I, _P, _P, _P, _P, _P, _P, _P, _T],
    "decode_attention": [_P, _I, _I, _P, _P, _I, _P, _P, _I, _I, _I, _I, ctypes.c_float, _P, _P, _T],
}


def _cpu_flags() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _build(cc: str) -> Path:
    """The kernel's shared object for this source, compiler and CPU, compiled once."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join((SOURCE.read_text(), *FLAGS, version, _cpu_flags())).encode()).hexdigest()
    out = cache_dir() / f"cpu_blocks-{key[:16]}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            built = Path(tmp) / out.name
            cmd = [cc, *FLAGS, "-o", str(built), str(SOURCE)]
            subprocess.run(cmd, capture_output=True, text=True, check=True)
            os.replace(built, out)  # whole or not at all, whichever process gets there first
    return out


@cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, None where it cannot be built or the CPU lacks AVX2 and FMA."""
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        log.info("--cpu-weights blocks unavailable: no C compiler (%s)", cc)
        return None
    try:
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        log.warning("--cpu-weights blocks unavailable: the kernel did not build: %s", detail)
        return None
    simd = lib.blocks_simd()
    if not simd:  # the build holds nothing else
        log.info("--cpu-weights blocks unavailable: this CPU has no AVX2 and FMA")
        return None
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
    lib.llama_decode_work.restype = _I
    lib.blocks_held_up.restype = ctypes.c_double
    log.info("CPU block kernel: %s (%s)", lib._name, "AVX-512" if simd == 1 else "AVX2")
    return lib


def available() -> bool:
    return library() is not None


class Stack(ctypes.Structure):
    """llama_stack in models/kernels/cpu_blocks.c, field for field."""

    _fields_ = [
        *((n, _I) for n in ("layers", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size")),
        *((n, ctypes.c_float) for n in ("eps", "scale")),
        ("weights", _P), ("kv", _P), ("kv_layer", _I), ("table", _P), ("table_width", _I),
        ("head", _P), ("vocab", _I), ("head_q4", _I), ("norm", _P),
    ]  # fmt: skip


def kernel_fits(head_dim: int) -> bool:
    """Whether the kernel's vectors tile a head (its rope and attention hold up to 512 wide)."""
    lib = library()
    return lib is not None and head_dim % (16 if lib.blocks_simd() == 1 else 8) == 0 and head_dim <= 512


def decode_attention(store: KVStore, layer: int, q: Tensor, batch: ForwardBatch) -> Tensor:
    """q [T, Hq, D] float32 of decode tokens (rows strided as the q/k/v projection's views leave them)
    over their sequences' positions up to their own in a float32 CPU store, read in place -> [T, Hq, D]."""
    lib, host, lay = library(), store.host, store.layout
    assert lib is not None and host is not None and q.stride(2) == 1 and q.stride(1) == q.shape[2]
    rows, heads, dim = q.shape
    out, scores = torch.empty(rows, heads, dim), torch.empty(rows * heads * batch.max_ctx)
    table, index = store.block_table, (batch.slot_of_token, batch.positions)
    lib.decode_attention(
        q.data_ptr(), rows, q.stride(0), host.kv[layer].data_ptr(), table.data_ptr(), table.shape[1],
        *(t.data_ptr() for t in index), heads, lay.num_kv_heads, dim, lay.block_size, dim**-0.5,
        out.data_ptr(), scores.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out
