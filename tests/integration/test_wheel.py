"""Packaging: the built wheel carries every subpackage under `ballast.*` and imports on its own.

Catches a folder missing from pyproject's package list or package-dir map, which an editable
install would hide.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUBPACKAGES = ("memory", "models", "engine", "scheduler", "server", "bench")


def test_wheel_contains_and_imports_every_subpackage(tmp_path: Path) -> None:
    # Built from a clean copy: setuptools reuses a build/ folder left in the checkout, which kept a
    # package the list had dropped.
    src = tmp_path / "src"
    skip = shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "tests", "docs", "deploy")
    shutil.copytree(ROOT, src, ignore=skip)
    out = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = out.glob("ballast_llm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for sub in SUBPACKAGES:  # every package folder, nested ones too (engine/spec was left out once)
        for init in sorted((ROOT / sub).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT).as_posix()
            assert f"ballast/{rel}/__init__.py" in names, f"wheel lacks ballast/{rel}"
    assert "ballast/memory/types.py" in names
    assert "ballast/server/dashboard.html" in names, "the /dashboard page is package data"
    assert not any(n.startswith(("memory/", "tests/")) for n in names), (
        "top-level folders leaked into the wheel"
    )

    target = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(target)
    # Import from the extracted wheel, in a fresh interpreter run from an unrelated directory, with
    # the wheel's tree first on sys.path: the module must come from there, not the checkout.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import ballast.memory.types as t, ballast.memory.config as c;"
        "assert t.__file__.startswith(sys.argv[1]), t.__file__;"
        "c.MemoryConfig(); print(t.Level.CRITICAL.name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(target)], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "CRITICAL"
