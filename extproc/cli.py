"""The ``kvgate`` command: serve, check, hash-key, render-envoy, import-ratelimit, demo."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import logging
import os
import sys
from pathlib import Path

from extproc.config import EXAMPLE_CONFIG, ConfigError, hash_api_key, load_config


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except ConfigError as error:
        _print_config_error(error)
        return 2
    except KeyboardInterrupt:
        return 130


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the ext_proc server")
    serve.add_argument("--config", "-c", type=Path, required=True)
    serve.add_argument(
        "--workers", type=int, default=1,
        help="worker processes sharing the gRPC port (SO_REUSEPORT); needs redis",
    )
    serve.set_defaults(func=_serve)

    check = commands.add_parser("check", help="validate a config file; print every error")
    check.add_argument("config", type=Path)
    check.set_defaults(func=_check)

    hash_key = commands.add_parser("hash-key", help="print the sha256 form of an API key")
    hash_key.add_argument("key", nargs="?", help="the key (prompted for when omitted)")
    hash_key.set_defaults(func=_hash_key)

    render = commands.add_parser("render-envoy", help="write the Envoy bootstrap for a config")
    render.add_argument("config", type=Path)
    render.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    render.set_defaults(func=_render_envoy)

    ratelimit = commands.add_parser(
        "import-ratelimit",
        help="convert envoyproxy/ratelimit config files into kvgate's ratelimit: section",
    )
    ratelimit.add_argument("files", type=Path, nargs="+", metavar="FILE")
    ratelimit.add_argument(
        "--algorithm", default="fixed_window",
        choices=["fixed_window", "token_bucket", "sliding_window"],
        help="for every limit (default fixed_window: the same decisions as envoyproxy/ratelimit)",
    )
    ratelimit.set_defaults(func=_import_ratelimit)

    agent = commands.add_parser(
        "agent", help="serve this node's NVML GPU readings for a gateway-mode kvgate"
    )
    agent.add_argument("--config", "-c", type=Path, help="reads the agent: section")
    agent.add_argument("--host", help="default 0.0.0.0 (agent.host)")
    agent.add_argument("--port", type=int, help="default 9400 (agent.port)")
    agent.set_defaults(func=_agent)

    demo = commands.add_parser(
        "demo", help="Envoy + kvgate + two simulated engines on the bundled config"
    )
    demo.add_argument("--config", "-c", type=Path, default=EXAMPLE_CONFIG)
    demo.add_argument(
        "--smoke", action="store_true", help="send a few requests through, print them, exit"
    )
    demo.set_defaults(func=_demo)
    return parser


def _print_config_error(error: ConfigError) -> None:
    print(f"{error.source}: {len(error.problems)} problem(s)", file=sys.stderr)
    for problem in error.problems:
        print(f"  {problem}", file=sys.stderr)


def _check(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    print(
        f"{args.config}: OK — {len(config.tenants)} tenant(s), {len(config.tiers)} tier(s), "
        f"{len(config.pools)} pool(s)"
    )
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    key = args.key or getpass.getpass("API key: ")
    if not key:
        print("no key given", file=sys.stderr)
        return 2
    print(hash_api_key(key))
    return 0


def _render_envoy(args: argparse.Namespace) -> int:
    from extproc.envoy_config import render_to_file, render_yaml

    config = load_config(args.config)
    if args.output:
        render_to_file(config, args.output)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(render_yaml(config))
    return 0


def _import_ratelimit(args: argparse.Namespace) -> int:
    from extproc.rls_import import RatelimitImportError, import_files

    try:
        text, notes = import_files(args.files, args.algorithm)
    except RatelimitImportError as error:
        print(f"kvgate import-ratelimit: {error}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"# {note}", file=sys.stderr)
    sys.stdout.write(text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if args.workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    if args.workers == 1:
        _serve_worker(args.config, 0, args.log_level, reuse_port=False)
        return 0
    if config.redis is None:
        print(
            f"--workers {args.workers} needs `redis:` in {args.config}: with in-memory limits "
            "each worker would enforce the whole limit on its own, multiplying every limit by "
            "the number of workers. Configure redis.url, or run one worker.",
            file=sys.stderr,
        )
        return 2
    return _run_workers(args.config, args.workers, args.log_level)


def _serve_worker(
    config_path: Path, index: int, log_level: str, *, reuse_port: bool = True
) -> None:
    """One serving process; worker i serves its metrics on admin_port + i."""
    from extproc.processes import set_cpu_policy
    from extproc.server import KvgateServer, install_uvloop

    _setup_logging(log_level)
    config = load_config(config_path)
    set_cpu_policy(config.server.cpu_policy)  # before gRPC starts its threads
    admin = config.server.admin_port
    if index and admin:
        config = config.model_copy(
            update={"server": config.server.model_copy(update={"admin_port": admin + index})}
        )
    install_uvloop()
    asyncio.run(KvgateServer(config, reuse_port=reuse_port).serve_forever())


def _run_workers(config_path: Path, workers: int, log_level: str) -> int:
    import multiprocessing
    import signal

    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=_serve_worker, args=(config_path, i, log_level), name=f"kvgate-worker-{i}"
        )
        for i in range(workers)
    ]
    for process in processes:
        process.start()

    def forward(signum: int, _frame: object) -> None:
        for process in processes:
            if process.pid and process.is_alive():
                os.kill(process.pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    for process in processes:
        process.join()
    return max((p.exitcode or 0) for p in processes)


def _agent(args: argparse.Namespace) -> int:
    import signal

    from extproc.config import AgentSettings
    from extproc.datalayer.agent import run_agent
    from extproc.datalayer.nvml import open_gpu_reader

    settings = load_config(args.config).agent if args.config else AgentSettings()
    host = args.host or settings.host
    port = settings.port if args.port is None else args.port

    async def serve() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run_agent(host, port, open_gpu_reader(), settings.interval_s)

    asyncio.run(serve())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from extproc.demo import run_demo

    return run_demo(load_config(args.config), smoke=args.smoke)


if __name__ == "__main__":
    sys.exit(main())
