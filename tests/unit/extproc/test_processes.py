"""How the server process asks Linux to schedule it (``server.cpu_policy``)."""

from __future__ import annotations

import os
import threading

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
