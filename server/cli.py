"""The `ballast` command: `serve`, `memory [--watch]`, `generate`.

Every setting of every layer is a flag here and a `BALLAST_*` variable (see `ballast.server.config`);
a bad value exits with code 2 and a message naming the flag, the variable and the accepted range.
`ballast serve` exits non-zero if the engine fails to load or becomes unsound, so a supervisor
restarts it.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import uvicorn
from ballast.engine.config import EngineConfig, PrefixCacheConfig
from ballast.memory.config import MemoryConfig
from ballast.memory.ladder import LadderConfig, plan_for
from ballast.memory.report import render
from ballast.memory.types import LadderPlan, MemState
from ballast.memory.watch import MemWatch
from ballast.models.cache_dir import CACHE_ENV
from ballast.scheduler.config import SchedulerConfig
from ballast.server import events
from ballast.server.config import ConfigError, ServerConfig, add_flags, build, warn_unknown
from ballast.server.header_timeout import protocol_with_header_timeout
from ballast.server.kv_events import KVEventsConfig

from ballast import __version__

if TYPE_CHECKING:
    from ballast.server.kv_publisher import KVEventPublisher

log = logging.getLogger("ballast.server")
# Seconds between the engine turning unsound and the shutdown: the clients' errors go out and the
# probes answer 503 meanwhile.
FATAL_LINGER_S = 1.0

# Order matters only for --help: the settings people reach for first come first.
LAYERS: tuple[type, ...] = (
    ServerConfig,
    EngineConfig,
    PrefixCacheConfig,
    SchedulerConfig,
    MemoryConfig,
    KVEventsConfig,
)
# Variables read outside the config layers (so not typos).
OTHER_VARIABLES: tuple[str, ...] = (CACHE_ENV,)
MEMORY_LAYERS: tuple[type, ...] = (MemoryConfig, EngineConfig, SchedulerConfig)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser and its subcommand parsers (a config error is reported by the subcommand's)."""
    parser = argparse.ArgumentParser(
        prog="ballast", description="OpenAI-compatible LLM server with memory governance."
    )
    parser.add_argument("--version", action="version", version=f"ballast {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{serve,memory,generate}")
    serve = sub.add_parser(
        "serve", help="serve the OpenAI API over HTTP", description="Serve the OpenAI API over HTTP."
    )
    add_flags(serve, LAYERS)
    memory = sub.add_parser(
        "memory",
        help="print the memory snapshot and the ladder plan",
        description="Print what the memory layer sees.",
    )
    memory.add_argument("--watch", action="store_true", help="print again every second until interrupted")
    add_flags(memory, MEMORY_LAYERS)
    # `generate` owns its flags (engine/generate.py); listed here so --help shows it.
    sub.add_parser(
        "generate", help="generate text from one prompt (see `ballast generate --help`)", add_help=False
    )
    return parser, {"serve": serve, "memory": memory}


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    env = os.environ if environ is None else environ
    if args_in and args_in[0] == "generate":
        from ballast.engine.generate import main as generate_main  # torch-heavy: only when asked

        return generate_main(args_in[1:])
    parser, subparsers = build_parser()
    args = parser.parse_args(args_in)
    if args.command is None:  # `ballast` alone: what it can do
        parser.print_help()
        return 0
    try:
        if args.command == "serve":
            return serve(args, env)
        return memory(args, env)
    except ConfigError as exc:
        subparsers[args.command].error(
            str(exc)
        )  # exits 2 with the usage line, as argparse does for a bad flag
        return 2


def build_configs(
    args: argparse.Namespace, env: Mapping[str, str], layers: Sequence[type]
) -> dict[type, object]:
    """Each layer's config; the scheduler's takes its slot count from the engine's and its ladder
    and PSI settings from the memory layer's (each setting is declared once)."""
    warn_unknown(env, LAYERS, OTHER_VARIABLES)
    cfg: dict[type, object] = {
        layer: build(layer, args, env) for layer in layers if layer is not SchedulerConfig
    }
    if SchedulerConfig in layers:
        engine, mem = cfg[EngineConfig], cfg[MemoryConfig]
        assert isinstance(engine, EngineConfig) and isinstance(mem, MemoryConfig)
        cfg[SchedulerConfig] = build(
            SchedulerConfig,
            args,
            env,
            max_num_seqs=engine.max_num_seqs,
            ladder_disable=mem.ladder_disable,
            psi_full_reject_pct=mem.psi_full_reject_pct,
        )
    return cfg


def _ladder_plan(state: MemState, engine: EngineConfig, sched: SchedulerConfig) -> LadderPlan:
    window = sched.window_for(engine.max_model_len)
    return plan_for(state.level, LadderConfig(sched.max_num_seqs, window), disabled=sched.ladder_disable)


def memory(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    cfg = build_configs(args, env, MEMORY_LAYERS)
    memory_cfg, engine_cfg, sched_cfg = cfg[MemoryConfig], cfg[EngineConfig], cfg[SchedulerConfig]
    assert (
        isinstance(memory_cfg, MemoryConfig)
        and isinstance(engine_cfg, EngineConfig)
        and isinstance(sched_cfg, SchedulerConfig)
    )
    watch = MemWatch(memory_cfg)
    if not args.watch:
        state = watch.poll_now()
        print(render(state, _ladder_plan(state, engine_cfg, sched_cfg)))
        return 0
    watch.start()
    try:
        while True:
            state = watch.read()
            print(render(state, _ladder_plan(state, engine_cfg, sched_cfg)), flush=True)
            print()
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        watch.stop()


def open_kv_events(cfg: object, prefix_cfg: PrefixCacheConfig) -> KVEventPublisher | None:
    """The KV-event publisher with its sockets open, or None when no endpoint is set."""
    assert isinstance(cfg, KVEventsConfig)
    if not cfg.enabled:
        return None
    if not prefix_cfg.enabled:
        raise ConfigError(
            "--kv-events-endpoint (BALLAST_KV_EVENTS_ENDPOINT) publishes the prefix cache's entries: "
            "it needs --prefix-cache-fraction (BALLAST_PREFIX_CACHE_FRACTION) > 0"
        )
    try:
        from ballast.server.kv_publisher import KVEventPublisher
    except ImportError as exc:
        raise ConfigError(
            f"--kv-events-endpoint (BALLAST_KV_EVENTS_ENDPOINT) needs pyzmq and msgpack "
            f"(pip install 'ballast[kv-events]'): {exc}"
        ) from exc
    return KVEventPublisher(cfg)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(args: argparse.Namespace, env: Mapping[str, str]) -> int:
    cfg = build_configs(args, env, LAYERS)
    from ballast.engine.engine import Engine  # heavy imports only once the configs are known good
    from ballast.engine.runner.loading import ModelSpecError, check_spec
    from ballast.memory.pool import CheckpointPool
    from ballast.models.base import ModelError
    from ballast.server.app import create_app

    server_cfg, engine_cfg, sched_cfg, memory_cfg = (
        cfg[ServerConfig],
        cfg[EngineConfig],
        cfg[SchedulerConfig],
        cfg[MemoryConfig],
    )
    prefix_cfg = cfg[PrefixCacheConfig]
    assert (
        isinstance(server_cfg, ServerConfig)
        and isinstance(engine_cfg, EngineConfig)
        and isinstance(prefix_cfg, PrefixCacheConfig)
    )
    assert isinstance(sched_cfg, SchedulerConfig) and isinstance(memory_cfg, MemoryConfig)
    try:
        check_spec(engine_cfg.model)
    except (ModelSpecError, ModelError) as exc:
        raise ConfigError(f"--model (BALLAST_MODEL): {exc}") from exc
    kv_events = open_kv_events(cfg[KVEventsConfig], prefix_cfg)  # binds its sockets now, or exits 2
    events.configure_logging(server_cfg.log_format, server_cfg.log_level)
    watch = MemWatch(memory_cfg)
    watch.add_listener(events.level_changed)
    # The prefix cache's checkpoint buffers come from (and go back to) this pool; its cap follows
    # the live, cgroup-aware host total, and the scheduler trims it while idle.
    pool = CheckpointPool(
        lambda: watch.read().host.effective_total_bytes,
        memory_cfg.pool_fraction,
        memory_cfg.pool_max_buffers,
        memory_cfg.pool_min_buffer_bytes,
    )
    exit_code = 0
    server: uvicorn.Server | None = None
    json_logs = server_cfg.log_format == "json"

    def on_fatal(reason: str) -> None:
        nonlocal exit_code
        if json_logs:
            log.critical("fatal: %s; shutting down", reason, extra={"event": "fatal", "reason": reason})
        else:
            print(f"ballast: fatal: {reason}; shutting down", file=sys.stderr, flush=True)
        exit_code = 1
        if server is not None:
            # Linger a moment so the in-flight responses (each client's error) are sent and the
            # probes are seen failing, then shut down; uvicorn's graceful shutdown does the rest.
            linger = threading.Timer(FATAL_LINGER_S, lambda: setattr(server, "should_exit", True))
            linger.daemon = True
            linger.start()

    def load_engine() -> Engine:
        # The main KV pool's format is the operator's (--kv-quant), whatever the level at load: a
        # PSI blip then must not make it int8 for the process's life. Pressure acts at run time,
        # where the ladder starts new sequences in the int8 pool while WATCH lasts.
        spec = sched_cfg.speculative
        mtp = spec.num_speculative_tokens if spec is not None and spec.method == "mtp" else 0
        verify = spec.verify_size(engine_cfg.max_num_seqs) if spec is not None else None
        engine = Engine.load(
            engine_cfg, watch, prefix_cache=prefix_cfg, pool=pool, mtp_drafts=mtp, verify=verify
        )
        if kv_events is not None:
            kv_events.attach(engine)
        return engine

    app = create_app(
        server_cfg,
        sched_cfg,
        load_engine,
        memwatch=watch,
        on_fatal=on_fatal,
        pool=pool,
        pool_max_idle_s=memory_cfg.pool_max_idle_s,
        model_aliases=() if server_cfg.served_model_name else (engine_cfg.model,),
        collectors=(kv_events.collector(),) if kv_events is not None else (),
    )
    try:
        sock = _bind(server_cfg.host, server_cfg.port)
    except OSError as exc:
        print(f"ballast: cannot listen on {server_cfg.host}:{server_cfg.port}: {exc}", file=sys.stderr)
        return 1
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    # In JSON mode uvicorn's loggers keep no handlers of their own: their records reach the root's
    # JSON handler like ours, so every line of the log is one object.
    logs: dict[str, Any] = {"log_config": None} if json_logs else {}
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            http=protocol_with_header_timeout(server_cfg.header_timeout_s),
            log_level=server_cfg.log_level,
            lifespan="on",
            timeout_graceful_shutdown=10,
            **logs,
        )
    )
    url = f"http://{shown}:{port}"
    if json_logs:
        log.info(
            "listening on %s (model %s loading; /ready turns 200 when it is served)",
            url,
            engine_cfg.model,
            extra={"event": "listening", "url": url, "model": engine_cfg.model},
        )
    else:
        print(
            f"ballast: listening on {url} (model {engine_cfg.model} loading; /ready turns 200 when it is "
            "served)",
            flush=True,
        )
    try:
        server.run(sockets=[sock])
    finally:
        if kv_events is not None:
            kv_events.stop()
    if exit_code:
        # An unsound engine may hold its thread in a step that never returns (a stall) or in a
        # poisoned device call: the interpreter's exit would join that thread forever.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)
    return exit_code


if __name__ == "__main__":
    raise SystemExit(main())
