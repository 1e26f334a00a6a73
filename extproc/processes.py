"""Processes: the child processes kvgate starts (Envoy for the demo; kvgate itself, the
engines and Envoy for its benchmarks and tests), and how the kvgate server process asks the
OS to schedule it."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from extproc.config import Config

log = logging.getLogger(__name__)


def set_cpu_policy(policy: str) -> bool:
    """``"batch"``: put the calling thread, and the threads it starts later, under Linux's
    SCHED_BATCH. gRPC's poller thread wakes on every completion; under the default policy
    each wake-up preempts the event loop mid-message (~15 times per request, measured), so
    both work on cold caches. SCHED_BATCH turns off that wake-up preemption: the loop
    finishes what it is doing first. Measured in ``bench.overhead``: ~12–20% less CPU per
    request and higher throughput, no cost at concurrency 1. Call it before the gRPC server
    exists. ``"normal"`` (or a platform without SCHED_BATCH) leaves scheduling alone.
    Returns whether the policy was applied."""
    if policy != "batch" or not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as error:  # a sandbox may forbid it: serving matters more
        log.warning("could not switch to SCHED_BATCH (%s); scheduling left as it is", error)
        return False
    return True


def exit_on_sigterm_while_starting() -> None:
    """As a container's PID 1 (the image's ENTRYPOINT is ``kvgate``): SIGTERM ends the
    process until a command installs its own handler.

    The kernel drops a signal sent to a PID namespace's init that has no handler for it.
    Before ``kvgate serve`` and ``kvgate agent`` installed theirs (imports, the config, a
    tokenizer, NVML), a deleted pod's SIGTERM was lost: kvgate went on starting, served,
    and was SIGKILLed at the end of the pod's grace period, cutting what it had admitted by
    then. Anywhere else SIGTERM's default action ends the process at once, even mid-call in
    C (a Python handler waits for the main thread), so it is left as it is. Call it from
    the main thread; the command's own handler replaces it.
    """
    if os.getpid() == 1:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    with contextlib.suppress(OSError):
        os.write(2, b"kvgate: SIGTERM while starting; exiting\n")
    os._exit(128 + signum)  # the status a shell reports for a process SIGTERM ended


def die_with_parent(parent_pid: int) -> None:
    """Linux: this process gets SIGTERM (and drains) when its parent dies, however it died.
    A `kvgate serve --workers` parent killed with SIGKILL left its workers serving on as
    orphans that no reload or stop reached any more. Elsewhere, nothing changes."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        set_parent_death_signal = 1  # PR_SET_PDEATHSIG
        if libc.prctl(set_parent_death_signal, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


class StallWatch:
    """Which of ``kvgate serve --workers``' workers stopped writing their heartbeat (a shared
    value each worker's event loop changes every second once it serves) for ``stall_s`` of
    the watcher's own time, or never wrote it within ``start_s`` (stuck while starting: an
    NVML or tokenizer load that hangs; the pod's startup probe reaches any worker through
    the shared gRPC port, so it passes while this one never gets ready). Each look counts at
    most :attr:`MAX_STEP_S` since the one before, so a watcher that was stopped itself with
    its workers (Ctrl-Z on the process group, a paused VM) does not take that pause for
    theirs; no clocks are compared across processes."""

    MAX_STEP_S = 1.0

    def __init__(self, beats: Sequence[Any], stall_s: float, start_s: float = math.inf):
        self.beats = beats
        self.stall_s = stall_s
        self.start_s = start_s
        self._last = [0.0] * len(beats)
        self._silent = [0.0] * len(beats)
        self._looked: float | None = None

    def stalled(self, now: float) -> list[tuple[int, float, bool]]:
        """(worker index, seconds silent, whether it never started) of each worker silent
        past ``stall_s`` (or never started within ``start_s``), once."""
        step = 0.0 if self._looked is None else min(max(0.0, now - self._looked),
                                                     self.MAX_STEP_S)
        self._looked = now
        found = []
        for index, beat in enumerate(self.beats):
            value = beat.value
            if value != self._last[index]:
                self._last[index], self._silent[index] = value, 0.0
                continue
            self._silent[index] += step
            if self._silent[index] > (self.stall_s if value else self.start_s):
                found.append((index, self._silent[index], not value))
                self._silent[index] = -math.inf  # named once
        return found


def stop_process(process: subprocess.Popen[bytes] | None, timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it is still running after ``timeout`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class KvgateProcess:
    """A ``kvgate serve`` subprocess on a config written to ``workdir``: for set-ups with
    several replicas, or that must kill one (tests, the soak benchmark)."""

    def __init__(self, config: Config, workdir: Path, name: str = "kvgate", workers: int = 1,
                 options: tuple[str, ...] = ()):
        self.config = config
        self.path = workdir / f"{name}.yaml"
        self.write_config(config)
        self.workers = workers
        self.options = options  # kvgate's own, before the verb (--log-format json)
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the process)

    def write_config(self, config: Config) -> None:
        """(Re)write the config file the process reads (a running one reloads it)."""
        import yaml

        self.path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.config.server.grpc_port}"

    def start(self, timeout: float = 20) -> KvgateProcess:
        command = [sys.executable, "-m", "extproc.cli", *self.options, "serve",
                   "-c", str(self.path), "--workers", str(self.workers)]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        import httpx

        deadline = time.monotonic() + timeout
        admin = f"http://127.0.0.1:{self.config.server.admin_port}/healthz"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvgate exited {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(admin, timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"kvgate did not become healthy:\n{self.log()}")

    def log(self, tail: int | None = 4000) -> str:
        """What the process wrote (the last ``tail`` characters; None: all of it)."""
        self._log.seek(0)
        text = self._log.read().decode(errors="replace")
        return text if tail is None else text[-tail:]

    def kill(self) -> None:
        """SIGKILL: a crashed replica that releases nothing."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def stop(self) -> None:
        stop_process(self.process)

    def __enter__(self) -> KvgateProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
