"""The NVML seam and the agent (extproc.datalayer.nvml, .agent).

This machine has no GPU, so the real NVML is only checked for its "unavailable" path; GPU
data comes from ``FakeGpuReader`` injected at the ``GpuReader`` seam. ``StubNvml`` stands in
for the ``pynvml`` module in the two tests that walk NvmlReader's device/MIG enumeration,
which would otherwise run nowhere without a MIG-capable GPU.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any

import aiohttp
import pynvml
import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.datalayer.agent import NO_NVML_TEXT, start_agent
from extproc.datalayer.nvml import (
    NOT_AVAILABLE_BYTES,
    UTILIZATION,
    AsyncGpuReader,
    GpuReading,
    NvmlReader,
    open_gpu_reader,
    parse_gpu_metrics,
    render_gpu_metrics,
)

GiB = 1 << 30
GPUS = [
    GpuReading(0, "GPU-aaaa", "NVIDIA H200", 40 * GiB, 141 * GiB, 37.0),
    GpuReading(1, "GPU-bbbb", 'Odd "name" \\ here', 10 * GiB, 80 * GiB, None),
    GpuReading(2, "MIG-cccc", "NVIDIA H200 MIG 1g.18gb", 3 * GiB, 18 * GiB, None,
               mig=True, parent_index=1),
]


@dataclass
class FakeGpuReader:
    """A ``GpuReader`` whose readings the test sets.

    ``fail`` makes ``read()`` raise; ``gate``, when set, makes it hang until the gate opens
    (as NVML can on a sick driver).
    """

    readings: list[GpuReading] = field(default_factory=lambda: list(GPUS))
    fail: bool = False
    gate: threading.Event | None = None
    reads: int = 0

    def read(self) -> list[GpuReading]:
        self.reads += 1
        if self.gate is not None:
            self.gate.wait(timeout=5)
        if self.fail:
            raise RuntimeError("GPU has fallen off the bus")
        return list(self.readings)


# -- NVML: the unavailable path, and enumeration through a stub ----------------------------


def nvml_works() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


def test_no_nvml_gives_none_and_one_log_line(caplog: pytest.LogCaptureFixture) -> None:
    if nvml_works():
        pytest.skip("NVML works on this host")
    with caplog.at_level(logging.DEBUG, logger="extproc.datalayer"):
        assert open_gpu_reader() is None
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "NVML unavailable" in record.getMessage()


class StubNvml:
    """The few ``pynvml`` calls NvmlReader makes, over a scripted set of devices.

    Device 0: a plain GPU. Device 1: MIG enabled, 3 slots, slot 1 empty; utilization not
    supported on it or its instances. Device 2 (when ``lost``): answers nothing.
    """

    NVMLError = pynvml.NVMLError
    NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE

    def __init__(self, lost: bool = False, init_error: Exception | None = None):
        self.lost, self.init_error, self.shut_down = lost, init_error, False
        self.devices = {
            ("gpu", 0): dict(uuid="GPU-0", name=b"NVIDIA H200", used=5, total=100, util=42,
                             mig=None),
            ("gpu", 1): dict(uuid="GPU-1", name="NVIDIA H200", used=30, total=100, util=None,
                             mig=pynvml.NVML_DEVICE_MIG_ENABLE),
            ("mig", 1, 0): dict(uuid="MIG-10", name="NVIDIA H200 MIG 3g", used=10, total=50,
                                util=None, mig=None),
            ("mig", 1, 2): dict(uuid="MIG-12", name="NVIDIA H200 MIG 1g", used=2, total=16,
                                util=None, mig=None),
        }

    def _device(self, handle: Any) -> dict[str, Any]:
        if handle not in self.devices:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.devices[handle]

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlDeviceGetCount(self) -> int:
        return 3 if self.lost else 2

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        return ("gpu", index)

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        device = self._device(handle)
        return SimpleNamespace(used=device["used"], total=device["total"])

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._device(handle)["uuid"]

    def nvmlDeviceGetName(self, handle: Any) -> str | bytes:
        return self._device(handle)["name"]

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        util = self._device(handle)["util"]
        if util is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return SimpleNamespace(gpu=util, memory=0)

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        mode = self._device(handle)["mig"]
        if mode is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [mode, mode]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return 3

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, slot: int) -> Any:
        key = ("mig", handle[1], slot)
        if key not in self.devices:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return key


def test_nvml_reader_walks_gpus_and_mig_instances() -> None:
    readings = NvmlReader(StubNvml(lost=True)).read()
    assert readings == [
        GpuReading(0, "GPU-0", "NVIDIA H200", 5, 100, 42.0),
        GpuReading(1, "GPU-1", "NVIDIA H200", 30, 100, None),
        GpuReading(0, "MIG-10", "NVIDIA H200 MIG 3g", 10, 50, None, mig=True, parent_index=1),
        GpuReading(2, "MIG-12", "NVIDIA H200 MIG 1g", 2, 16, None, mig=True, parent_index=1),
    ]  # the lost device 2 is left out, the others still read
    assert [r.key for r in readings] == ["0", "1", "1:0", "1:2"]


def test_a_mig_slice_that_fails_mid_read_hides_only_itself() -> None:
    """A slice destroyed between its handle and its memory query (or sick) is left out; the
    slices after it on the same GPU are still read, each its endpoint's own watermark."""

    class SliceGone(StubNvml):
        def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
            if handle == ("mig", 1, 0):
                raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
            return super().nvmlDeviceGetMemoryInfo(handle)

    assert [r.key for r in NvmlReader(SliceGone()).read()] == ["0", "1", "1:2"]



class ParentMemoryDenied(StubNvml):
    """A MIG node seen from a container: NVML refuses the MIG-enabled GPU's own memory
    query (``Insufficient Permissions``; nvidia-smi shows it so) while each slice answers
    (NVIDIA/nvidia-container-toolkit#842, NVIDIA/k8s-device-plugin#1683)."""

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> Any:
        if handle == ("gpu", 1):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return super().nvmlDeviceGetMemoryInfo(handle)


def test_a_gpu_whose_own_reading_fails_still_gives_its_mig_slices() -> None:
    """The parent's refused memory query left out its slices too: every endpoint on them lost
    its own watermark, and a node of MIG GPUs alone read as no GPUs at all."""
    assert [r.key for r in NvmlReader(ParentMemoryDenied()).read()] == ["0", "1:0", "1:2"]

    class OnlyMig(ParentMemoryDenied):
        def nvmlDeviceGetCount(self) -> int:
            return 1

        def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
            return ("gpu", 1)

    reader = open_gpu_reader(OnlyMig())
    assert reader is not None and [r.uuid for r in reader.read()] == ["MIG-10", "MIG-12"]


def test_a_gpu_whose_mig_slots_cannot_be_counted_keeps_its_own_reading() -> None:
    class SlotsUnknown(StubNvml):
        def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    assert [r.key for r in NvmlReader(SlotsUnknown()).read()] == ["0", "1"]

NOT_AVAILABLE_UINT = pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value  # 0xFFFFFFFF


class Sentinels(StubNvml):
    """NVML's "not available" where a figure should be: GPU 0's utilization is 0xFFFFFFFF
    (as some devices and drivers answer), and each of GPUs 2-5 has memory figures no GPU
    can have; GPU 1 and its MIG slices read as in ``StubNvml``."""

    def __init__(self) -> None:
        super().__init__()
        self.devices[("gpu", 0)]["util"] = NOT_AVAILABLE_UINT
        bad_memory = {2: (NOT_AVAILABLE_BYTES, 100), 3: (5, NOT_AVAILABLE_BYTES), 4: (0, 0),
                      5: (101, 100)}
        for index, (used, total) in bad_memory.items():
            self.devices[("gpu", index)] = dict(uuid=f"GPU-{index}", name="NVIDIA H200",
                                                used=used, total=total, util=7, mig=None)

    def nvmlDeviceGetCount(self) -> int:
        return 6


SENTINEL_READINGS = [
    GpuReading(0, "GPU-0", "NVIDIA H200", 5, 100, None),  # the utilization is unknown
    GpuReading(1, "GPU-1", "NVIDIA H200", 30, 100, None),
    GpuReading(0, "MIG-10", "NVIDIA H200 MIG 3g", 10, 50, None, mig=True, parent_index=1),
    GpuReading(2, "MIG-12", "NVIDIA H200 MIG 1g", 2, 16, None, mig=True, parent_index=1),
]  # GPUs 2-5, their memory unknown, are left out as a GPU whose memory query fails is


def test_nvml_sentinels_are_read_as_unknown() -> None:
    """Read in-process (``gpu_source: local``): 0xFFFFFFFF utilization was 4294967295 %,
    a used-memory sentinel a GPU 1.8e17 times full (its endpoint held for good)."""
    readings = NvmlReader(Sentinels()).read()
    assert readings == SENTINEL_READINGS
    text = render_gpu_metrics(readings)
    assert f"{UTILIZATION}{{" not in text and "GPU-2" not in text


@pytest.mark.parametrize("util", [101, -1, float("nan"), NOT_AVAILABLE_UINT])
def test_a_utilization_outside_0_to_100_is_unknown(util: float) -> None:
    nvml = StubNvml()
    nvml.devices[("gpu", 0)]["util"] = util
    assert NvmlReader(nvml).read()[0].utilization_pct is None


async def test_the_agent_serves_no_nvml_sentinel() -> None:
    agent = await start_agent(reader=NvmlReader(Sentinels()), interval_s=0.05)
    try:
        status, text = await get(agent.metrics_url)
    finally:
        await agent.stop()
    assert status == 200 and f"{UTILIZATION}{{" not in text
    assert parse_gpu_metrics(text) == SENTINEL_READINGS


def test_parse_takes_sentinels_from_an_older_agent_as_unknown() -> None:
    """A gateway scraping an agent from before the check (a rolling upgrade) or another
    exporter: the sentinels it serves are unknown here too, not a watermark."""
    line = '{}{{gpu="{}",uuid="GPU-{}",name="x",mig_instance=""}} {}\n'
    page = "".join(
        line.format("kvgate_gpu_memory_used_bytes", gpu, gpu, used)
        + line.format("kvgate_gpu_memory_total_bytes", gpu, gpu, total)
        + line.format(UTILIZATION, gpu, gpu, ratio)
        for gpu, used, total, ratio in [
            (0, 5, 100, NOT_AVAILABLE_UINT / 100),  # what such an agent served
            (1, float(NOT_AVAILABLE_BYTES), 100, 0.5),  # 2**64 once a float
            (2, 5, float(NOT_AVAILABLE_BYTES), 0.5), (3, 0, 0, 0.5), (4, -1, 100, 0.5),
            (5, 5, 100, -0.5)])
    assert parse_gpu_metrics(page) == [GpuReading(0, "GPU-0", "x", 5, 100, None),
                                       GpuReading(5, "GPU-5", "x", 5, 100, None)]


def test_open_gpu_reader_with_working_nvml(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="extproc.datalayer"):
        reader = open_gpu_reader(StubNvml())
    assert isinstance(reader, NvmlReader) and len(reader.read()) == 4
    assert "reading 4 GPU" in caplog.text


def test_open_gpu_reader_never_raises(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="extproc.datalayer"):
        assert open_gpu_reader(StubNvml(init_error=OSError("libnvidia-ml.so.1"))) is None
    assert len(caplog.records) == 1 and "libnvidia-ml.so.1" in caplog.text


def test_open_gpu_reader_gives_up_on_an_nvml_that_hangs(
        caplog: pytest.LogCaptureFixture) -> None:
    """A sick driver can hang ``nvmlInit`` itself: the process starts without GPU readings
    (one warning) instead of never opening its ports."""
    released = threading.Event()

    class Hung(StubNvml):
        def nvmlInit(self) -> None:
            released.wait(timeout=30)

    started = time.monotonic()
    try:
        with caplog.at_level(logging.INFO, logger="extproc.datalayer"):
            assert open_gpu_reader(Hung(), timeout_s=0.2) is None
    finally:
        released.set()
    assert time.monotonic() - started < 5
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "did not answer" in record.getMessage()


async def test_a_hung_read_times_out_and_is_not_started_twice() -> None:
    reader = FakeGpuReader(gate=threading.Event())
    threaded = AsyncGpuReader(reader)
    for _ in range(3):
        with pytest.raises(TimeoutError):
            await threaded.read(timeout_s=0.02)
    assert reader.reads == 1  # every call waited on the one hung read
    reader.gate.set()
    assert await threaded.read(timeout_s=1) == GPUS  # the hung read's own result
    reader.fail = True
    with pytest.raises(RuntimeError, match="fallen off"):
        await threaded.read(timeout_s=1)
    assert reader.reads == 2


# -- Prometheus text round trip ------------------------------------------------------------


def test_render_then_parse_gives_the_readings_back() -> None:
    text = render_gpu_metrics(GPUS)
    assert ('kvgate_gpu_memory_used_bytes{gpu="0",mig_instance="",name="NVIDIA H200",'
            'uuid="GPU-aaaa"} 4.294967296e+10') in text
    assert 'kvgate_gpu_utilization_ratio{gpu="0",' in text  # only GPU 0 reports it
    assert text.count("kvgate_gpu_utilization_ratio{") == 1
    assert parse_gpu_metrics(text) == GPUS
    assert parse_gpu_metrics(render_gpu_metrics([])) == [] == parse_gpu_metrics("")


readings = st.builds(
    GpuReading,
    index=st.integers(0, 64),
    uuid=st.uuids().map(lambda u: f"GPU-{u}"),
    name=st.text(max_size=30),
    memory_used_bytes=st.integers(0, 1 << 50),
    memory_total_bytes=st.integers(1, 1 << 50),
    utilization_pct=st.none() | st.integers(0, 100).map(float),
    mig=st.just(False),
).map(lambda r: replace(r, memory_used_bytes=r.memory_used_bytes % (r.memory_total_bytes + 1)))


@given(st.lists(readings, max_size=8, unique_by=lambda r: r.uuid))
def test_round_trip_property(gpus: list[GpuReading]) -> None:
    assert parse_gpu_metrics(render_gpu_metrics(gpus)) == gpus


def test_parse_skips_incomplete_and_junk_rows() -> None:
    text = render_gpu_metrics(GPUS[:1]) + (
        'kvgate_gpu_memory_used_bytes{gpu="5",uuid="GPU-half"} 7\n'  # no total: skipped
        'kvgate_gpu_memory_total_bytes{gpu="x",uuid="GPU-bad"} 7\n'
        'kvgate_gpu_memory_used_bytes{gpu="x",uuid="GPU-bad"} 7\n'  # gpu not a number
        "kvgate_gpu_memory_used_bytes{broken 7\n<html>\n")
    assert parse_gpu_metrics(text) == GPUS[:1]


# -- the agent over HTTP -------------------------------------------------------------------


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


async def test_agent_serves_readings_and_health() -> None:
    reader = FakeGpuReader()
    agent = await start_agent(reader=reader, interval_s=0.02)
    try:
        status, text = await get(agent.metrics_url)
        assert status == 200 and parse_gpu_metrics(text) == GPUS
        assert await get(f"{agent.url}/healthz") == (200, "ok\n")

        reader.readings = [GPUS[0]]
        reads = reader.reads
        await eventually(lambda: reader.reads >= reads + 2)  # a refresh completed since
        assert parse_gpu_metrics((await get(agent.metrics_url))[1]) == [GPUS[0]]
    finally:
        await agent.stop()


async def test_agent_without_nvml_serves_a_valid_empty_page() -> None:
    agent = await start_agent(reader=None)
    try:
        status, text = await get(agent.metrics_url)
        assert (status, text) == (200, NO_NVML_TEXT)
        assert parse_gpu_metrics(text) == []
        assert (await get(f"{agent.url}/healthz"))[0] == 200
    finally:
        await agent.stop()


async def test_agent_serves_no_stale_readings_when_a_read_fails(
        caplog: pytest.LogCaptureFixture) -> None:
    reader = FakeGpuReader(fail=True)
    with caplog.at_level(logging.INFO, logger="extproc.datalayer"):
        agent = await start_agent(reader=reader, interval_s=0.01)
        try:
            await eventually(lambda: reader.reads >= 4)
            text = (await get(agent.metrics_url))[1]
            assert "fallen off the bus" in text and parse_gpu_metrics(text) == []
            reader.fail = False
            deadline = time.monotonic() + 3.0
            while parse_gpu_metrics((await get(agent.metrics_url))[1]) != GPUS:
                assert time.monotonic() < deadline, "the agent did not recover"
                await asyncio.sleep(0.01)
        finally:
            await agent.stop()
    assert [r.levelno for r in caplog.records] == [logging.WARNING, logging.INFO]


async def eventually(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    """Wait until ``condition()`` holds; fail the test (not hang it) after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def test_kvgate_agent_command_serves_metrics_without_a_gpu():
    import subprocess
    import sys
    import time

    import httpx

    from extproc.ports import free_port

    port = free_port()
    agent = subprocess.Popen([sys.executable, "-m", "extproc.cli", "agent", "--host",
                              "127.0.0.1", "--port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "agent did not start"
                time.sleep(0.1)
        assert page.status_code == 200
        assert page.text.startswith("#")  # valid, empty: NVML is absent here
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
    finally:
        agent.terminate()
        output = agent.communicate(timeout=10)[0].decode()
    assert agent.returncode == 0
    assert output.count("NVML") >= 1  # one clear line saying the GPU signal is absent


HANGING_NVML = """
import sys, threading
from types import SimpleNamespace
import pynvml

reads = []
def memory(handle):
    reads.append(handle)
    if len(reads) > 1:  # the start's read answers, every later one hangs in the "driver"
        threading.Event().wait()
    return SimpleNamespace(used=5, total=100)
def no_mig(handle):
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
pynvml.nvmlInit = pynvml.nvmlShutdown = lambda: None
pynvml.nvmlDeviceGetCount = lambda: 1
pynvml.nvmlDeviceGetHandleByIndex = lambda index: index
pynvml.nvmlDeviceGetMemoryInfo = memory
pynvml.nvmlDeviceGetUUID = lambda handle: "GPU-0"
pynvml.nvmlDeviceGetName = lambda handle: "stub"
pynvml.nvmlDeviceGetUtilizationRates = lambda handle: SimpleNamespace(gpu=1, memory=0)
pynvml.nvmlDeviceGetMigMode = no_mig
from extproc.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _agent_page(script: str, ready: str, why: str) -> tuple[str, int, str]:
    """``kvgate agent`` run by ``script`` (NVML patched in it): its first ``/metrics`` page
    that contains ``ready``, then its exit status and output after SIGTERM."""
    import subprocess
    import sys

    import httpx

    from extproc.ports import free_port

    port = free_port()
    agent = subprocess.Popen([sys.executable, "-c", script, "agent", "--host",
                              "127.0.0.1", "--port", str(port)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
                if ready in page:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, why
            time.sleep(0.1)
        agent.terminate()
        output = agent.communicate(timeout=10)[0].decode()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.communicate()
    return page, agent.returncode, output


def test_kvgate_agent_exits_on_sigterm_while_an_nvml_read_hangs() -> None:
    """The agent serves "NVML did not answer" while a read hangs, and SIGTERM still ends it:
    the hung read's thread must not be one ``asyncio.run`` waits for at exit."""
    _page, status, output = _agent_page(HANGING_NVML, "did not answer",
                                        "the agent did not report the hung read")
    assert status == 0, output


SENTINEL_NVML = """
import sys
from types import SimpleNamespace
import pynvml

def no_mig(handle):
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
memory = {0: SimpleNamespace(used=5, total=100),  # GPU 1: NVML's "not available"
          1: SimpleNamespace(used=pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value, total=100)}
utilization = SimpleNamespace(gpu=pynvml.NVML_VALUE_NOT_AVAILABLE_uint.value, memory=0)
pynvml.nvmlInit = pynvml.nvmlShutdown = lambda: None
pynvml.nvmlDeviceGetCount = lambda: 2
pynvml.nvmlDeviceGetHandleByIndex = lambda index: index
pynvml.nvmlDeviceGetMemoryInfo = memory.__getitem__
pynvml.nvmlDeviceGetUUID = lambda handle: f"GPU-{handle}"
pynvml.nvmlDeviceGetName = lambda handle: "stub"
pynvml.nvmlDeviceGetUtilizationRates = lambda handle: utilization
pynvml.nvmlDeviceGetMigMode = no_mig
from extproc.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kvgate_agent_command_serves_no_nvml_sentinel() -> None:
    """What ``kvgate agent`` serves from NVML's "not available" answers: no utilization
    (it served a ratio of 42949672.95), and no reading for a GPU whose memory is unknown."""
    page, status, output = _agent_page(SENTINEL_NVML, "", "the agent did not start")
    assert status == 0, output
    assert f"{UTILIZATION}{{" not in page and "GPU-1" not in page, page
    assert parse_gpu_metrics(page) == [GpuReading(0, "GPU-0", "stub", 5, 100, None)]


async def test_a_read_cancelled_as_it_completes_stays_cancelled() -> None:
    """Cancelling a task inside ``AsyncGpuReader.read`` just as the read completes must
    cancel it: the agent's refresher is stopped that way, and a swallowed cancellation
    (Python 3.11's ``wait_for`` returns the result instead) leaves its stop hanging."""

    class Instant:
        def read(self) -> list:
            return []

    swallowed = 0
    for _ in range(200):
        reader = AsyncGpuReader(Instant())
        task = asyncio.create_task(reader.read(5.0))
        while reader._pending is None or not reader._pending.done():
            await asyncio.sleep(0)  # the thread's result arrives
        task.cancel()  # in the same loop turn as the result reaches the waiter
        try:
            await task
            swallowed += 1
        except asyncio.CancelledError:
            pass
    assert swallowed == 0
