"""How the server process asks Linux to schedule it (``server.cpu_policy``)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from extproc.processes import set_cpu_policy


def _in_a_thread(policy: str) -> tuple[bool, int, int]:
    """Applied in a fresh thread (a policy is per thread): what it returns, the thread's
    policy after, and the policy of a thread that thread starts."""
    seen: list[object] = []

    def child() -> None:
        seen.append(os.sched_getscheduler(0))

    def run() -> None:
        applied = set_cpu_policy(policy)
        seen.append(applied)
        seen.append(os.sched_getscheduler(0))
        started = threading.Thread(target=child)
        started.start()
        started.join()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    applied, own, inherited = seen
    return bool(applied), int(own), int(inherited)  # type: ignore[call-overload]


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux only")
def test_batch_applies_to_the_thread_and_the_threads_it_starts():
    assert _in_a_thread("batch") == (True, os.SCHED_BATCH, os.SCHED_BATCH)


def test_normal_leaves_scheduling_alone():
    applied, own, inherited = _in_a_thread("normal")
    assert not applied and own == inherited == os.sched_getscheduler(0)


def test_a_worker_dies_with_its_parent_however_it_died(tmp_path):
    """`kvgate serve --workers` workers outlived a parent killed with SIGKILL, serving on
    with no one to forward a reload or a stop to them."""
    child = (
        "import signal, sys, time\n"
        "try:\n"
        "    from extproc.processes import die_with_parent\n"
        "except ImportError:  # (before the fix: nothing asked)\n"
        "    def die_with_parent(_pid): pass\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))\n"
        "die_with_parent(int(sys.argv[1]))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n")
    parent = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {child!r}, str(os.getpid())])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE)
    assert process.stdout is not None
    child_pid = int(process.stdout.readline())
    time.sleep(1.0)  # the child has asked for the signal
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child_pid}").exists() and "Z" not in _state(child_pid):
        assert time.monotonic() < deadline, "the worker outlived its parent"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except (FileNotFoundError, IndexError):
        return "Z"


class _Beat:
    def __init__(self) -> None:
        self.value = 0.0


def test_a_worker_silent_for_stall_s_of_the_watchers_time_is_named_once():
    from extproc.processes import StallWatch

    beats = [_Beat(), _Beat()]
    watch = StallWatch(beats, stall_s=2.0)
    now = 100.0
    for _ in range(50):  # not started yet: never written, never stalled
        now += 0.2
        assert watch.stalled(now) == []
    named = []
    for n in range(30):
        now += 0.2
        beats[0].value = now  # worker 0 beats on; worker 1 beat once, then stopped
        if n == 0:
            beats[1].value = now
        named += watch.stalled(now)
    assert [(index, starting) for index, _, starting in named] == [(1, False)]  # once
    assert 2.0 < named[0][1] <= 2.2  # after 2 s of silence


def test_a_worker_that_never_begins_to_beat_is_named_after_start_s():
    """Stuck while starting (a tokenizer on a hung file system, the GPU driver): its
    heartbeat is never written, and the watch names it once ``start_s`` has passed."""
    from extproc.processes import StallWatch

    beats = [_Beat(), _Beat()]
    watch = StallWatch(beats, stall_s=2.0, start_s=5.0)
    now, named = 100.0, []
    for n in range(40):
        now += 0.2
        if n >= 10:  # worker 0 starts serving after 2 s; worker 1 never does
            beats[0].value = now
        named += watch.stalled(now)
    assert [(index, starting) for index, _, starting in named] == [(1, True)]
    assert 5.0 < named[0][1] <= 5.2


def test_the_watchers_own_pause_is_not_taken_for_the_workers():
    """The whole process group stopped for a minute (Ctrl-Z, a paused VM) and resumed:
    the watcher looks before the workers' next beat, and must not kill them for it."""
    from extproc.processes import StallWatch

    beat = _Beat()
    watch = StallWatch([beat], stall_s=2.0)
    beat.value = 1.0
    assert watch.stalled(10.0) == []
    assert watch.stalled(70.0) == []  # a minute later, the same beat: counts as 1 s at most
    beat.value = 71.0
    assert watch.stalled(70.2) == []
