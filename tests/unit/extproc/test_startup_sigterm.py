"""SIGTERM while kvgate starts (a pod deleted while it loads its config or a tokenizer, or
scrapes its engines once): every mode ends promptly, leaves no process behind, and one
that already serves drains.

Each case runs as an ordinary process and as PID 1 of a PID namespace of its own, which is
what a container's ENTRYPOINT is (``unshare``; skipped where user namespaces are not
allowed). The two differ: the kernel drops a signal sent to a namespace's init that has no
handler for it, where an ordinary process takes SIGTERM's default action and ends. kvgate
as PID 1 went on starting and served until the pod's SIGKILL. A slow step is made one that
never ends: its file is a named pipe nobody writes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.config import hash_api_key
from tests.conftest import consecutive_free_ports, free_port

PROMPTLY_S = 10.0  # a loaded CI machine; each of these ends in well under a second here
ENV = {**os.environ, "KVGATE_NATIVE": "0"}


def _pid1_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rpf", "--kill-child", "sh", "-c", "test $$ = 1"],
                          capture_output=True, timeout=30)
    return done.returncode == 0


PID1 = pytest.param(True, id="pid1", marks=pytest.mark.skipif(
    not _pid1_works(), reason="no PID namespace here (unshare -rpf)"))
ORDINARY = pytest.param(False, id="ordinary")


def config(tmp_path: Path, workers: int = 1, **pool: object) -> dict:
    data = {
        "tiers": {"gold": {}},
        "tenants": [{"name": "a", "tier": "gold", "api_keys": [hash_api_key("sk-mine")]}],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:8000"], **pool}],
        "server": {"grpc_port": free_port(), "admin_port": consecutive_free_ports(workers),
                   "report_port": consecutive_free_ports(workers), "reload_poll_s": 0,
                   "shutdown_grace_s": 2},
    }
    if workers > 1:
        data["redis"] = {"url": "redis://127.0.0.1:1", "replicas": workers}  # never reached
    return data


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Started:
    """A command run as an ordinary process or as PID 1 of a new PID namespace; ``pid`` is
    kvgate's own (for PID 1, the child ``unshare`` forked). Its output goes to ``log``."""

    def __init__(self, command: list[str], log: Path, pid1: bool):
        prefix = ["unshare", "-rpf", "--kill-child"] if pid1 else []
        self.log = log
        with log.open("wb") as output:
            self.process = subprocess.Popen([*prefix, *command], stdout=output,
                                            stderr=subprocess.STDOUT, env=ENV)
        self.pid = self.process.pid
        if pid1:
            deadline = time.monotonic() + PROMPTLY_S
            while not (children := _children(self.process.pid)):
                assert time.monotonic() < deadline, "unshare started nothing"
                time.sleep(0.01)
            self.pid = children[0]

    def sigterm(self) -> tuple[int, float, list[int]]:
        """SIGTERM to kvgate: (exit status, seconds to exit, its processes still there
        ``PROMPTLY_S`` after it exited)."""
        tree = _tree(self.pid)
        sent = time.monotonic()
        os.kill(self.pid, signal.SIGTERM)
        try:
            status = self.process.wait(PROMPTLY_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {PROMPTLY_S:g} s after SIGTERM:\n{self.text()}")
        took = time.monotonic() - sent
        deadline = time.monotonic() + PROMPTLY_S
        while (left := [pid for pid in tree if _alive(pid)]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return status, took, left

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def kill(self) -> None:
        for pid in [*_tree(self.process.pid), self.process.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait()


@pytest.fixture
def started() -> Iterator[list[Started]]:
    runs: list[Started] = []
    yield runs
    for run in runs:
        if run.process.poll() is None:
            run.kill()


def serve(started: list[Started], tmp_path: Path, pid1: bool, config_path: Path,
          workers: int = 1) -> Started:
    run = Started([sys.executable, "-m", "extproc.cli", "serve", "-c", str(config_path),
                   "--workers", str(workers)], tmp_path / "serve.log", pid1)
    started.append(run)
    return run


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                for child in (task / "children").read_text().split()]
    except FileNotFoundError:
        return []


def _tree(pid: int) -> list[int]:
    """``pid``'s descendants (multiprocessing's resource tracker, the workers)."""
    found = []
    for child in _children(pid):
        found += [child, *_tree(child)]
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def held_open_once_read(fifo: Path, process: subprocess.Popen[bytes]) -> int:
    """Wait until something opens the named pipe ``fifo`` to read, then hold its write end
    open (returned): the reader waits for data that never comes, mid-start."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as error:
            if error.errno != errno.ENXIO:  # ENXIO: no reader yet
                raise
        assert process.poll() is None, f"exited {process.returncode} before reading {fifo}"
        assert time.monotonic() < deadline, f"nothing read {fifo}"
        time.sleep(0.02)


# -- the config read (`serve`'s, and the --workers parent's, first step) --------------------


@pytest.mark.parametrize("pid1", [ORDINARY, PID1])
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_while_reading_the_config(tmp_path, started, pid1, workers):
    """The parent of ``--workers`` reads its config before it has started a worker or
    installed a handler: SIGTERM ends it there, as its default action does (143 as PID 1,
    which had no such action: it read on, started its workers and served)."""
    fifo = tmp_path / "kvgate.yaml"
    os.mkfifo(fifo)
    run = serve(started, tmp_path, pid1, fifo, workers)
    writer = held_open_once_read(fifo, run.process)
    try:
        status, _took, left = run.sigterm()
    finally:
        os.close(writer)
    assert status == (128 + signal.SIGTERM if pid1 else -signal.SIGTERM), run.text()
    assert left == []


# -- a tokenizer loading (a worker's start) -------------------------------------------------


@pytest.mark.parametrize("pid1", [ORDINARY, PID1])
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_while_loading_a_tokenizer(tmp_path, started, pid1, workers):
    """One process: it ends at once (143 as PID 1: its tokenizer file was read in Rust,
    which holds the GIL, so no Python handler could run until the file system answered).
    ``--workers 2``: the parent forwards SIGTERM to its workers, which end by it, and exits;
    no worker is left, and the stop it was asked for is a clean one (exit status 0: it was
    1, a worker ended by the forwarded SIGTERM counted as failed)."""
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    data = config(tmp_path, workers, models=[{"name": "m", "tokenizer": str(fifo)}])
    run = serve(started, tmp_path, pid1, write(tmp_path, data), workers)
    writer = held_open_once_read(fifo, run.process)
    try:
        status, took, left = run.sigterm()
    finally:
        os.close(writer)
    if workers > 1:
        assert status == 0, run.text()
    else:
        assert status == (128 + signal.SIGTERM if pid1 else -signal.SIGTERM), run.text()
    assert took < 3 and left == [], run.text()


# -- the first scrape (start() in the event loop; the gRPC port opens after it) -------------


@pytest.fixture
def silent_engine() -> Iterator[socket.socket]:
    """An engine that takes the connection and never answers ``/metrics``."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener


@pytest.mark.parametrize("pid1", [ORDINARY, PID1])
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_while_starting_drains_once_started(tmp_path, started, silent_engine,
                                                     pid1, workers):
    """SIGTERM while ``start()`` waits on the first scrape: handled, not the default
    action, so that one landing after the gRPC port opened (requests admitted) drains them:
    the process finishes starting (at most ``scrape.timeout_s``), drains at once (no
    ``drain_delay_s``: it never reported ready) and exits 0; with ``--workers``, each
    worker does, and the parent exits 0."""
    data = config(tmp_path, workers,
                  endpoints=[f"127.0.0.1:{silent_engine.getsockname()[1]}"])
    # long enough that a worker's second round does not come before the other's first
    data["scrape"] = {"timeout_s": 5}
    data["server"]["drain_delay_s"] = 30
    run = serve(started, tmp_path, pid1, write(tmp_path, data), workers)
    silent_engine.settimeout(60)
    scrapes = [silent_engine.accept()[0] for _ in range(workers)]  # each one's first
    try:
        status, took, left = run.sigterm()
    finally:
        for scrape in scrapes:
            scrape.close()
    assert status == 0 and took < 5 + PROMPTLY_S and left == [], run.text()
    log = run.text()
    assert log.count("draining at once") == workers, log
    assert log.count("stopped: 0 stream(s) cut") == workers, log


# -- kvgate agent: NVML opening ------------------------------------------------------------


HUNG_NVML = """
import os, sys, threading
import pynvml

def hung():
    os.write(1, b"nvmlInit\\n")
    threading.Event().wait()
pynvml.nvmlInit = hung
from extproc.cli import main
sys.exit(main())
"""


@pytest.mark.parametrize("pid1", [ORDINARY, PID1])
def test_kvgate_agent_sigterm_while_nvml_opens(tmp_path, started, pid1):
    """``kvgate agent`` opens NVML (up to 30 s on a sick driver) before its handlers: as PID
    1 the DaemonSet's SIGTERM was lost there, and the agent served until SIGKILLed."""
    run = Started([sys.executable, "-c", HUNG_NVML, "agent", "--host", "127.0.0.1",
                   "--port", str(free_port())], tmp_path / "agent.log", pid1)
    started.append(run)
    deadline = time.monotonic() + 60
    while "nvmlInit" not in run.text():
        assert run.process.poll() is None and time.monotonic() < deadline, run.text()
        time.sleep(0.02)
    status, took, left = run.sigterm()
    assert status == (128 + signal.SIGTERM if pid1 else -signal.SIGTERM), run.text()
    assert took < 3 and left == []


def test_ctrl_c_while_workers_load_a_tokenizer_stops_cleanly(tmp_path, started):
    """Ctrl-C in a terminal sends SIGINT to the whole process group: the parent and every
    worker still starting. Each worker raised KeyboardInterrupt wherever it was (a
    traceback apiece) and exited 1, and so did the parent; now they end as by SIGTERM and
    the parent exits 0."""
    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    data = config(tmp_path, 2, models=[{"name": "m", "tokenizer": str(fifo)}])
    log = tmp_path / "serve.log"
    with log.open("wb") as output:
        process = subprocess.Popen(
            [sys.executable, "-m", "extproc.cli", "serve", "-c", str(write(tmp_path, data)),
             "--workers", "2"], stdout=output, stderr=subprocess.STDOUT, env=ENV,
            start_new_session=True)
    try:
        writer = held_open_once_read(fifo, process)
        try:
            deadline = time.monotonic() + PROMPTLY_S  # both workers are loading it
            while len(_children(process.pid)) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            tree = _tree(process.pid)
            os.killpg(process.pid, signal.SIGINT)
            status = process.wait(PROMPTLY_S)
        finally:
            os.close(writer)
        text = log.read_text(errors="replace")
        assert status == 0, text
        assert "KeyboardInterrupt" not in text, text
        deadline = time.monotonic() + PROMPTLY_S
        while [pid for pid in tree if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [pid for pid in tree if _alive(pid)] == []
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
