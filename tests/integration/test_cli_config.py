"""The one configuration path: flags and BALLAST_* variables -> the layers' frozen configs.

Every setting every layer declares gets a bad value through the real CLI entry point: it must exit
with code 2 and name the variable and the accepted range. Good values land in the right layer, a
flag beats the variable, and a value one layer declares reaches every layer that uses it.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ballast.engine.config import EngineConfig
from ballast.memory.config import MemoryConfig
from ballast.scheduler.config import SchedulerConfig
from ballast.server.cli import LAYERS, OTHER_VARIABLES, build_configs, main
from ballast.server.config import (
    ConfigError,
    ServerConfig,
    Setting,
    add_flags,
    build,
    parse_value,
    settings_of,
    unknown_variables,
)

from ballast import __version__

ALL_SETTINGS = {s.env: s for layer in LAYERS for s in settings_of(layer)}


def bad_values(s: Setting) -> list[str]:
    if s.kind is bool:
        return ["yes", "True", " 1", "2"]
    if s.choices:
        return ["bogus", ""]
    if s.kind is str:
        return ["", " padded "]
    out = ["abc", "1_000", " 3"]
    if s.kind is int:
        out.append("1.5")
    else:
        out += ["nan", "inf"]
    if s.range is not None:
        lo, hi = s.range
        out.append(str(int(hi) + 1 if s.kind is int else hi * 2 + 1))
        out.append(str(int(lo) - 1 if s.kind is int else lo - 1))
    return out


CASES = [(env, raw) for env, s in sorted(ALL_SETTINGS.items()) for raw in bad_values(s)]


@pytest.mark.parametrize(("env", "raw"), CASES)
def test_each_bad_variable_exits_2_naming_it_and_its_range(
    env: str, raw: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve"], {env: raw})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert env in err and ALL_SETTINGS[env].flag in err
    assert ALL_SETTINGS[env].accepted() in err


def test_bad_flag_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--max-model-len", "1"], {})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-model-len='1'" in err and "2..1048576" in err


def test_cross_field_error_names_both_variables(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve"], {"BALLAST_MAX_NUM_SEQS": "64", "BALLAST_MAX_NUM_BATCHED_TOKENS": "32"})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "BALLAST_MAX_NUM_BATCHED_TOKENS" in err and "BALLAST_MAX_NUM_SEQS" in err


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_flags(parser, LAYERS)
    return parser.parse_args(argv)


def test_flags_beat_env_and_shared_variables_feed_every_layer() -> None:
    env = {
        "BALLAST_MAX_NUM_SEQS": "4",
        "BALLAST_PORT": "9001",
        "BALLAST_LADDER_DISABLE": "true",
        "BALLAST_MODEL": "builtin:tiny-llama",
    }
    args = parse(["--port", "9002", "--max-model-len", "512", "--api-key", "k"])
    cfg = build_configs(args, env, LAYERS)
    server, engine, sched, memory = (
        cfg[ServerConfig],
        cfg[EngineConfig],
        cfg[SchedulerConfig],
        cfg[MemoryConfig],
    )
    assert isinstance(server, ServerConfig) and isinstance(engine, EngineConfig)
    assert isinstance(sched, SchedulerConfig) and isinstance(memory, MemoryConfig)
    assert (server.port, server.api_key) == (9002, "k")
    assert (engine.max_num_seqs, engine.max_model_len, engine.model) == (4, 512, "builtin:tiny-llama")
    assert sched.max_num_seqs == 4
    assert sched.ladder_disable is True and memory.ladder_disable is True


def test_bool_flag_alone_means_true_and_accepts_false() -> None:
    assert build(MemoryConfig, parse(["--ladder-disable"]), {}).ladder_disable is True
    assert (
        build(
            MemoryConfig, parse(["--ladder-disable", "false"]), {"BALLAST_LADDER_DISABLE": "1"}
        ).ladder_disable
        is False
    )


def test_defaults_without_flags_or_env() -> None:
    assert build(ServerConfig, parse([]), {}) == ServerConfig()
    assert build(MemoryConfig, None, {}) == MemoryConfig()


def test_strict_parsing() -> None:
    port = ALL_SETTINGS["BALLAST_PORT"]
    assert parse_value(port, "8080", "BALLAST_PORT") == 8080
    assert parse_value(ALL_SETTINGS["BALLAST_HOST_RESERVE_FRACTION"], "1e-1", "x") == pytest.approx(0.1)
    for raw in ("8080.0", "0x1f90", "8080 ", "+"):
        with pytest.raises(ConfigError):
            parse_value(port, raw, "BALLAST_PORT")


def test_unknown_variables_are_reported_as_likely_typos() -> None:
    env = {"BALLAST_MAX_NUM_SEQ": "4", "BALLAST_PORT": "1", "PATH": "/bin", "BALLAST_CACHE_DIR": "/tmp/c"}
    # BALLAST_CACHE_DIR is read by the default model's fetcher, outside the config layers.
    assert unknown_variables(env, LAYERS, OTHER_VARIABLES) == ["BALLAST_MAX_NUM_SEQ"]


def test_every_setting_has_a_unique_flag_and_a_doc() -> None:
    flags: dict[str, str] = {}
    for s in ALL_SETTINGS.values():
        assert s.doc, s.env
        assert flags.setdefault(s.flag, s.env) == s.env
    for vllm_flag in (
        "--model",
        "--host",
        "--port",
        "--max-num-seqs",
        "--max-model-len",
        "--api-key",
        "--served-model-name",
        "--max-num-batched-tokens",
    ):
        assert vllm_flag in flags


def test_memory_subcommand_prints_snapshot_and_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["memory", "--max-num-seqs", "4"], {}) == 0
    out = capsys.readouterr().out
    assert "host" in out and "ladder" in out and "max slots" in out


def test_console_script_exits_2_on_bad_env() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ballast.server.cli", "serve"],
        env={"BALLAST_HOST_RESERVE_FRACTION": "0.95", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "BALLAST_HOST_RESERVE_FRACTION" in proc.stderr and "0..0.9" in proc.stderr


def test_generate_delegates_to_the_engine_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--help"], {})
    assert exit_info.value.code == 0
    assert "--prompt" in capsys.readouterr().out


@pytest.mark.slow
def test_serve_exits_1_when_the_model_cannot_load(tmp_path: Path) -> None:
    # A directory that looks like a model (so the early check passes) of an unknown architecture.
    (tmp_path / "config.json").write_text('{"model_type": "no-such-arch", "architectures": ["NoSuchArch"]}')
    proc = subprocess.run(
        [sys.executable, "-m", "ballast.server.cli", "serve", "--port", "0", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "listening on http://127.0.0.1:" in proc.stdout
    assert "fatal: model load failed" in proc.stderr and "no-such-arch" in proc.stderr


def test_serve_exits_2_at_once_for_an_unknown_builtin(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "builtin:no-such-model"], {})
    assert exit_info.value.code == 2 and "no-such-model" in capsys.readouterr().err


@pytest.mark.slow
def test_memory_watch_prints_every_second_until_interrupted() -> None:
    # As from a terminal: SIGINT at its default. A library imported by another test module may have
    # left it ignored in this process, and an ignored SIGINT stays ignored in a child Python.
    proc = subprocess.Popen(
        [sys.executable, "-m", "ballast.server.cli", "memory", "--watch"],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        headers = []
        for line in proc.stdout:
            if line.startswith("ballast memory"):
                headers.append(line)
                if len(headers) == 2:
                    break
        assert len(headers) == 2 and headers[0] != headers[1]  # a fresh snapshot each time (seq moves)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0


def test_the_old_window_names_still_work_with_a_warning(capsys: pytest.CaptureFixture[str]) -> None:
    assert build(SchedulerConfig, parse([]), {"BALLAST_PREFILL_WINDOW": "1024"}).context_window == 1024
    assert "BALLAST_PREFILL_WINDOW is deprecated, use BALLAST_CONTEXT_WINDOW" in capsys.readouterr().err
    assert build(SchedulerConfig, parse(["--prefill-window", "512"]), {}).context_window == 512
    assert "--prefill-window is deprecated, use --context-window" in capsys.readouterr().err
    # The new name wins, silently.
    assert (
        build(
            SchedulerConfig, parse(["--context-window", "256"]), {"BALLAST_PREFILL_WINDOW": "1024"}
        ).context_window
        == 256
    )
    assert "deprecated" not in capsys.readouterr().err
    assert unknown_variables({"BALLAST_PREFILL_WINDOW": "1"}, LAYERS) == []


def test_version_help_and_a_missing_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"], {})
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"ballast {__version__}"
    assert main([], {}) == 0  # no command: the help, not an error
    assert "{serve,memory,generate}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["serve", "--help"], {})
    help_text = " ".join(capsys.readouterr().out.split())
    assert (
        "default 8; env BALLAST_MAX_NUM_SEQS" in help_text
        and "default unset; env BALLAST_API_KEY" in help_text
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", str(tmp_path / "absent.gguf")], {})
    assert exit_info.value.code == 2
    assert f"model '{tmp_path / 'absent.gguf'}' not found" in capsys.readouterr().err
