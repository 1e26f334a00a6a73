"""The ``kvgate`` command: serve, check, hash-key, render-envoy, import-ratelimit,
agent, demo.

Every verb ends in one clear line on bad input (an unreadable or invalid config, a port
already taken, no key to hash) and exit status 2; ``--log-level debug`` adds the traceback.
"""

from __future__ import annotations

import signal
import sys

if __name__ == "__main__":  # `python -m extproc.cli`: SIGHUP ignored before the imports
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (the `kvgate` command: kvgate_cli.py)
    from extproc.processes import exit_on_sigterm_while_starting

    exit_on_sigterm_while_starting()  # as PID 1, SIGTERM is otherwise lost until serving

import argparse
import asyncio
import contextlib
import getpass
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from extproc.config import (
    EXAMPLE_CONFIG,
    Config,
    ConfigError,
    for_worker,
    hash_api_key,
    load_config,
    parse_config,
    read_config_data,
    upstream_authorizations,
)
from extproc.config_check import file_problems
from extproc.ports import PortInUse, ensure_free

DESCRIPTION = "Multi-tenant admission control for vLLM, as an Envoy external processor."
BEAT_S = 1.0
"""How often a worker's event loop writes its heartbeat for ``server.worker_stall_s``."""


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself, not a test calling main()
        # Until a command installs its own handler (serve's reload, the workers' parent's
        # forwarding, the demo's stop), SIGHUP is ignored: its default action ended a
        # `kvgate serve` that was sent a reload while it started. Workers inherit it. The
        # `kvgate` command (kvgate_cli.py) ignores it before any import: here, for a caller
        # that did not. As PID 1, SIGTERM ends it until then (it would be lost).
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        from extproc.processes import exit_on_sigterm_while_starting

        exit_on_sigterm_while_starting()
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging(args.log_level, args.log_format or "plain")
    if sys.stdout is None:  # started with stdout closed (`>&-`): what it prints goes nowhere
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the process's lifetime)
    try:
        return args.func(args)
    except ConfigError as error:
        _print_config_error(error)
        return 2
    except (PortInUse, OSError) as error:
        logging.getLogger("kvgate").debug("failed", exc_info=True)
        print(f"kvgate {args.command}: {_one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror + (f": {error.filename}" if error.filename else "")
    return str(error)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvgate")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _setup_logging(level: str, fmt: str) -> None:
    from extproc.logs import setup_logging

    setup_logging(level, fmt)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate", description=DESCRIPTION,
        epilog="`kvgate COMMAND --help` describes each command.",
    )
    parser.add_argument("--version", action="version", version=f"kvgate {_version()}")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--log-format", choices=["plain", "json"],
        help="text lines or one JSON object per line (default: server.log_format, plain)",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND", dest="command")

    serve = commands.add_parser("serve", help="run the ext_proc server")
    serve.add_argument("--config", "-c", type=Path, required=True)
    serve.add_argument(
        "--workers", type=int, default=1,
        help="worker processes sharing the gRPC port (SO_REUSEPORT); needs redis",
    )
    serve.set_defaults(func=_serve)

    check = commands.add_parser(
        "check", help="validate a config file; print every problem",
        description="Print every problem in a config file at once (field errors with their "
        "paths, unknown keys with the closest known one, cross-references, files it names "
        "that cannot be read) and exit 2; exit 0 when it is valid.",
    )
    check.add_argument("config", type=Path)
    check.add_argument(
        "--skip-files", action="store_true",
        help="do not check the files it names (a config for another machine, a ConfigMap)",
    )
    check.set_defaults(func=_check)

    hash_key = commands.add_parser("hash-key", help="print the sha256 form of an API key")
    hash_key.add_argument(
        "key", nargs="?", help="the key; when omitted, read from stdin (prompted for on a "
        "terminal), which keeps it out of the shell history")
    hash_key.set_defaults(func=_hash_key)

    render = commands.add_parser("render-envoy", help="write the Envoy bootstrap for a config")
    render.add_argument("config", type=Path)
    render.add_argument("-o", "--output", type=Path, help="file to write (default: stdout)")
    render.add_argument(
        "--gie", action="store_true",
        help="the bootstrap an Inference Extension gateway would use instead: kvgate as its "
        "endpoint picker, bodies FULL_DUPLEX_STREAMED (a reference, not kvgate's own setup)")
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
    agent.add_argument("--port", type=_port, help="default 9400 (agent.port)")
    agent.set_defaults(func=_agent)

    demo = commands.add_parser(
        "demo", help="Envoy + kvgate + simulated engines, on the bundled config or yours",
        description="Run Envoy, kvgate and one simulated vLLM engine per pool endpoint on "
        "this machine. Every port comes from the config file: envoy.listen_port (the "
        "gateway), envoy.admin_port, server.grpc_port, server.admin_port (/metrics and the "
        "status page), server.report_port, and each pools[].endpoints address (an engine). "
        "The bundled config uses 10000, 9901, 9001, 9002, any free port, 8101 and 8102; "
        "give your own with --config to move them.",
    )
    demo.add_argument("--config", "-c", type=Path, default=EXAMPLE_CONFIG,
                      help="default: the bundled example config")
    demo.add_argument(
        "--smoke", action="store_true", help="send a few requests through, print them, exit"
    )
    demo.set_defaults(func=_demo)
    return parser


def _port(text: str) -> int:
    """A TCP port, 0 to 65535, as argparse's ``type``: 70000 ended in an OverflowError
    traceback from bind(), -1 in a resolver's message."""
    port = int(text) if text.strip().lstrip("+-").isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port (0 to 65535)")
    return port


def _print_config_error(error: ConfigError) -> None:
    print(f"{error.source}: {len(error.problems)} problem(s)", file=sys.stderr)
    for problem in error.problems:
        print(f"  {problem}", file=sys.stderr)


def _check(args: argparse.Namespace) -> int:
    data, found = read_config_data(args.config)
    missing = [] if args.skip_files else file_problems(data)
    try:
        config = parse_config(data, str(args.config), found)
    except ConfigError as error:
        raise ConfigError(error.source, [*error.problems, *missing]) from None
    if not args.skip_files:
        missing += _secret_problems(config, missing)
    if missing:
        raise ConfigError(str(args.config), missing)
    print(
        f"{args.config}: OK — {len(config.tenants)} tenant(s), {len(config.tiers)} tier(s), "
        f"{len(config.pools)} pool(s)"
    )
    return 0


def _secret_problems(config: Config, reported: list[str]) -> list[str]:
    """``upstream_api_key`` read as ``kvgate serve`` reads it at start-up: an unset or empty
    environment variable, an empty key file (an unreadable file is in ``reported``)."""
    try:
        upstream_authorizations(config)
    except ConfigError as error:
        return [p for p in error.problems
                if not any(r.startswith(p.partition(":")[0]) for r in reported)]
    return []


def _hash_key(args: argparse.Namespace) -> int:
    key = (args.key if args.key is not None else _read_key()).strip()
    if not key:
        print("kvgate hash-key: no key given (as an argument, on stdin, or at the prompt)",
              file=sys.stderr)
        return 2
    print(hash_api_key(key))
    return 0


def _read_key() -> str:
    """The key from a terminal prompt (not echoed) or the first line of piped stdin."""
    try:
        if sys.stdin is not None and sys.stdin.isatty():
            return getpass.getpass("API key: ")
        return "" if sys.stdin is None else sys.stdin.readline()
    except EOFError:  # Ctrl-D at the prompt
        return ""


def _kvgate_ports(config: Config, worker: int = 0) -> list[tuple[str, int, str]]:
    """Where a kvgate process (worker ``worker`` of ``--workers``) listens, and the setting
    each port comes from."""
    server = for_worker(config, worker).server
    ports = [(server.host, server.grpc_port, "server.grpc_port"),
             (server.host, server.report_port, "server.report_port")]
    if server.admin_port is not None:
        ports.append((server.admin_host, server.admin_port, "server.admin_port"))
    return ports


def _replicas_below_workers(config: Config, workers: int) -> str | None:
    """``redis.replicas`` counts every process sharing the limits, workers included: fewer
    than ``--workers`` and, while Redis is unreachable, the ``local`` policy lets each
    worker enforce more than its share (``replicas: 1`` and 4 workers: four times every
    limit)."""
    if config.redis is None or config.redis.failure_policy != "local":
        return None
    if config.redis.replicas >= workers:
        return None
    replicas = config.redis.replicas
    return (f"--workers {workers}: redis.replicas is {replicas}, but it counts every process "
            f"sharing the limits (replicas × workers): under failure_policy local each worker "
            f"would enforce 1/{replicas} of every limit while Redis is unreachable. Set "
            f"redis.replicas to at least {workers}.")


def _port_overlap(config: Config, workers: int) -> str | None:
    """Two settings whose ports the workers would share (admin_port + i meeting
    report_port + j, or the gRPC port, say): one line saying so, or None. The gRPC port
    is among them, shared by every worker as one setting: admin_port + i or report_port + i
    meeting it passed the free-port check (one port, free once) and the worker then died at
    start, address in use, with a traceback and exit 1."""
    owners: dict[int, str] = {}
    for i in range(workers):
        for _host, port, what in _kvgate_ports(config, i):
            if port and owners.setdefault(port, what) != what:
                return (f"--workers {workers}: {owners[port]} and {what} both take port {port} "
                        f"(each worker i listens on admin_port + i and report_port + i); move "
                        "one of them further apart")
    return None


def _port_past_range(config: Config, workers: int) -> str | None:
    """The last worker's admin_port + i or report_port + i past 65535: one line saying so,
    or None (it was an OverflowError traceback from the free-port check)."""
    for _host, port, what in _kvgate_ports(config, workers - 1):
        if port > 65535:
            return (f"--workers {workers}: {what} + {workers - 1} is port {port}, past 65535 "
                    f"(each worker i listens on admin_port + i and report_port + i); lower "
                    "it or run fewer workers")
    return None


def _ensure_free(ports: list[tuple[str, int, str]]) -> None:
    """Every port free before anything starts: one line naming the setting otherwise."""
    for host, port, what in ports:
        ensure_free(host, port, what)


def _render_envoy(args: argparse.Namespace) -> int:
    from extproc.envoy_config import render_to_file, render_yaml
    from extproc.envoy_gie import render_gie_yaml

    if args.output and _same_file(args.config, args.output):
        print(f"kvgate render-envoy: -o {args.output} is the config file itself: the bootstrap "
              "would replace it", file=sys.stderr)
        return 2
    config = load_config(args.config)
    problems = []
    if config.server.body_mode == "full_duplex" and not args.gie:
        problems.append(
            "server.body_mode: full_duplex is for a gateway that streams bodies to kvgate; the "
            "bootstrap kvgate renders sends them whole (use auto, or render --gie)")
    if config.server.grpc_port == 0:
        problems.append("server.grpc_port: 0 (any free port) cannot be rendered: Envoy must "
                        "know the port kvgate listens on; set a fixed one")
    if problems:
        raise ConfigError(str(args.config), problems)
    if (config.server.tls is None) != (config.envoy.ext_proc_tls is None):
        print(f"kvgate render-envoy: warning: {args.config}: "
              + ("server.tls is set but envoy.ext_proc_tls is not: Envoy would speak plaintext "
                 "to kvgate's TLS port" if config.server.tls else
                 "envoy.ext_proc_tls is set but server.tls is not: Envoy would speak TLS to "
                 "kvgate's plaintext port")
              + " (right only if something between them terminates or adds TLS)",
              file=sys.stderr)
    render = render_gie_yaml if args.gie else render_yaml
    if args.output:
        render_to_file(config, args.output, render)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(render(config))
    return 0


def _same_file(a: Path, b: Path) -> bool:
    """Whether two paths name one file (a symlink, ``./``, a hard link): ``render-envoy
    kvgate.yaml -o kvgate.yaml`` replaced the config with the bootstrap, and said it wrote."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing (or unreadable): reading or writing says so
        return False


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
    # a tokenizer counts on the calling thread: its batch encoding would otherwise spread
    # over every core, Envoy's included, for one request's embeddings
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = load_config(args.config)
    if args.workers < 1:
        print("--workers must be at least 1", file=sys.stderr)
        return 2
    if args.workers > 1 and config.redis is None:  # a config problem: before any port
        print(
            f"--workers {args.workers} needs `redis:` in {args.config}: with in-memory limits "
            "each worker would enforce the whole limit on its own, multiplying every limit by "
            "the number of workers. Configure redis.url, or run one worker.",
            file=sys.stderr,
        )
        return 2
    too_few = _replicas_below_workers(config, args.workers)
    if too_few is not None:
        print(too_few, file=sys.stderr)
        return 2
    problems = _start_up_problems(config)
    if problems:
        raise ConfigError(str(args.config), problems)
    overlap = _port_overlap(config, args.workers) or _port_past_range(config, args.workers)
    if overlap is not None:
        print(overlap, file=sys.stderr)
        return 2
    _ensure_free([p for i in range(args.workers) for p in _kvgate_ports(config, i)
                  if i == 0 or p[2] != "server.grpc_port"])
    if args.workers == 1:
        _serve_worker(args.config, 0, args.log_level, args.log_format, reuse_port=False)
        return 0
    return _run_workers(args.config, args.workers, args.log_level, args.log_format,
                        config.server.worker_stall_s, config.server.worker_start_s)


def _start_up_problems(config: Config) -> list[str]:
    """What a serving process reads from outside the file as it starts (the upstream API
    keys, the gRPC port's TLS files) that cannot be read, read here first: all of it in one
    report before anything starts. With ``--workers`` each worker found it on its own, in a
    ConfigError traceback apiece, and the parent exited 1."""
    from extproc.server import _server_credentials

    problems: list[str] = []
    try:
        upstream_authorizations(config)
    except ConfigError as error:
        problems += error.problems
    if config.server.tls is not None:
        try:
            _server_credentials(config.server.tls)
        except ConfigError as error:
            problems += error.problems
    return problems


def _serve_worker(
    config_path: Path, index: int, log_level: str, log_format: str | None = None, *,
    reuse_port: bool = True, parent_pid: int | None = None, workers: int = 1,
    heartbeat: Any = None,
) -> None:
    """One serving process (:func:`for_worker`); a worker (``parent_pid``) ends with its
    parent, and once it serves writes the time into ``heartbeat`` (a shared double) every
    :data:`BEAT_S` from its event loop, for the parent's watch (:func:`_watch_workers`)."""
    from extproc.processes import die_with_parent, set_cpu_policy
    from extproc.server import KvgateServer, install_uvloop

    if parent_pid is not None:
        die_with_parent(parent_pid)

    config = load_config(config_path)
    _setup_logging(log_level, log_format or config.server.log_format)
    set_cpu_policy(config.server.cpu_policy)  # before gRPC starts its threads
    config = for_worker(config, index)
    install_uvloop()
    try:
        server = KvgateServer(config, reuse_port=reuse_port, config_path=config_path,
                              worker=index, workers=workers)
        asyncio.run(_serve_beating(server, heartbeat))
    except ConfigError as error:  # a secret or TLS file read at start-up: name the file
        raise ConfigError(str(config_path), error.problems) from None


async def _serve_beating(server: Any, heartbeat: Any) -> None:
    beating = None if heartbeat is None else asyncio.create_task(_beat(server, heartbeat))
    try:
        await server.serve_forever()
    finally:
        if beating is not None:
            beating.cancel()


async def _beat(server: Any, heartbeat: Any) -> None:
    """Once the server serves (a slow start, a tokenizer loading, is not a stall)."""
    import time

    while True:
        if server.started:
            heartbeat.value = time.monotonic()
        await asyncio.sleep(BEAT_S)


def _run_workers(config_path: Path, workers: int, log_level: str, log_format: str | None,
                 stall_s: float, start_s: float) -> int:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    beats = [context.Value("d", 0.0, lock=False) for _ in range(workers)]
    processes = [
        context.Process(
            target=_serve_worker, args=(config_path, i, log_level, log_format),
            kwargs={"parent_pid": os.getpid(), "workers": workers, "heartbeat": beats[i]},
            name=f"kvgate-worker-{i}",
        )
        for i in range(workers)
    ]
    # Workers start with SIGINT ignored, until each serves and handles it: a terminal's
    # Ctrl-C reaches every process of its group, and a worker still starting raised
    # KeyboardInterrupt wherever it was (a traceback apiece, exit 1). The parent's stop
    # reaches them as SIGTERM.
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for process in processes:
            process.start()
    finally:
        signal.signal(signal.SIGINT, previous)

    def forward(signum: int, _frame: object) -> None:
        for process in processes:
            if process.pid and process.is_alive():
                os.kill(process.pid, signum)

    stopping = False

    def stop(_signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        forward(signal.SIGTERM, frame)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, stop)
    signal.signal(signal.SIGHUP, forward)  # every worker reloads
    return _watch_workers(processes, lambda: stopping, beats, stall_s, start_s)


def _watch_workers(processes: list[Any], stopping: Callable[[], bool],
                   beats: Sequence[Any] = (), stall_s: float = 30.0,
                   start_s: float = 60.0) -> int:
    """Until every worker has exited. One that exits before a SIGTERM or SIGINT asked it
    to (killed, crashed) stops the others and the parent exits 1, so the orchestrator
    restarts the whole — rather than serving on with fewer workers, silently. One whose
    heartbeat (``beats``, as :func:`_serve_worker` writes them) is ``stall_s`` old, or
    that has not begun it ``start_s`` after it was started, is killed first: a stuck worker
    answered no probe (the pod's liveness asks worker 0) and was never restarted. The exit
    status is 1 when any worker failed (a negative exit code is a signal; one ended by the
    SIGTERM the parent forwarded, while still starting, did not fail)."""
    import time

    from extproc.processes import StallWatch

    watch = StallWatch(beats, stall_s, start_s)
    failed = False
    while any(p.is_alive() for p in processes):
        stalled = watch.stalled(time.monotonic())
        if not stopping():
            _kill_stalled(processes, stalled, stall_s, start_s)
        for process in processes:
            if process.exitcode is not None and not stopping() and not failed:
                failed = True
                print(f"kvgate: {process.name} exited ({process.exitcode}) before it was "
                      "asked to; stopping the others", file=sys.stderr, flush=True)
                for other in processes:
                    if other.pid and other.is_alive():
                        os.kill(other.pid, signal.SIGTERM)
        time.sleep(0.2)
    # a worker still starting ends by the forwarded SIGTERM's default action (its handler
    # comes later): asked to, so a clean stop (counted as failed, a pod deleted while
    # kvgate started ended 1, and systemd marked the unit failed)
    failed = failed or any(p.exitcode and not (stopping() and p.exitcode == -signal.SIGTERM)
                           for p in processes)
    return 1 if failed else 0


def _kill_stalled(processes: list[Any], stalled: list[tuple[int, float, bool]],
                  stall_s: float, start_s: float) -> None:
    for index, silent_s, starting in stalled:
        process = processes[index]
        if process.pid and process.is_alive():
            why = (f" has not started serving in {silent_s:.0f} s (server.worker_start_s "
                   f"{start_s:g})" if starting else f"'s event loop has not run for "
                   f"{silent_s:.0f} s (server.worker_stall_s {stall_s:g})")
            print(f"kvgate: {process.name}{why}; killing it", file=sys.stderr, flush=True)
            os.kill(process.pid, signal.SIGKILL)


def _agent(args: argparse.Namespace) -> int:
    from extproc.config import AgentSettings, load_agent_settings
    from extproc.datalayer.agent import run_agent
    from extproc.datalayer.nvml import open_gpu_reader

    settings = load_agent_settings(args.config) if args.config else AgentSettings()
    host = args.host or settings.host
    port = settings.port if args.port is None else args.port
    ensure_free(host, port, "agent port (--port, agent.port)")
    reader = open_gpu_reader()  # before the loop: SIGTERM still ends it while NVML starts

    async def serve() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await run_agent(host, port, reader, settings.interval_s)

    asyncio.run(serve())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from extproc.demo import demo_ports, run_demo

    config = load_config(args.config)
    _ensure_free([*_kvgate_ports(config), *demo_ports(config)])
    return run_demo(config, smoke=args.smoke, source=args.config)


if __name__ == "__main__":
    sys.exit(main())
