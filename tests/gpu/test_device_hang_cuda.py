"""A hang inside a kernel (issue 47): `BALLAST_FAULTS` kind device_hang spins a kernel on the GPU
mid-decode and the engine thread waits for it inside CUDA. The watchdog must still fire: every
client (streaming or queued) gets its 503 engine_stalled, /health answers 503 with that code, and
the process exits non-zero, though its engine thread never comes back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
import persistent_faults  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_a_kernel_spinning_on_the_device_is_caught_by_the_watchdog(tmp_path: Path) -> None:
    from ballast.bench.checkpoint_dir import write_tokenizer

    write_tokenizer(tmp_path)  # the device machine cannot fetch the default model's tokenizer
    f = persistent_faults.run_hang(watchdog_s=2.0, kind="device_hang", extra=("--tokenizer", str(tmp_path)))
    print(f)
    assert f["clients_engine_stalled"] == f["clients"] == 5, f
    assert f["health_503_code"] == "engine_stalled", f
    assert f["exit_code"] not in (0, None), f
    assert f["detect_s_max"] < f["deadline_s"] + 10, f
