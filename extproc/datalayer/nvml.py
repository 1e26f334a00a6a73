"""The NVML seam: GPU memory and utilization, read in-process or served by ``kvgate agent``.

Everything above this module sees GPUs only as ``GpuReader.read() -> list[GpuReading]``;
tests inject their own reader there. ``open_gpu_reader()`` is the one place that touches the
NVML library, and it turns "no NVML here" (a CPU-only host, a container without the driver
mounted) into ``None`` and one log line, because a gateway must start on such a host.

NVML calls block (a utilization query can take milliseconds, a sick driver forever), so
async callers go through ``AsyncGpuReader``: a worker thread and a timeout. NVML itself is
thread-safe.

A gateway-mode kvgate cannot call NVML on the GPU nodes, so ``kvgate agent`` runs there and
serves ``render_gpu_metrics()`` as Prometheus text, which ``parse_gpu_metrics()`` reads back.
Labels: ``gpu`` is the physical GPU's NVML index (also on MIG instances),
``mig_instance`` the MIG slot index ("" on a whole GPU), ``uuid`` and ``name`` NVML's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import pynvml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from extproc.datalayer.metrics import read_samples

log = logging.getLogger(__name__)

MEMORY_USED = "kvgate_gpu_memory_used_bytes"
MEMORY_TOTAL = "kvgate_gpu_memory_total_bytes"
UTILIZATION = "kvgate_gpu_utilization_ratio"
LABELS = ("gpu", "uuid", "name", "mig_instance")
# NVML's start (``nvmlInit`` and a first read) on a healthy node takes well under a second,
# several seconds on many GPUs without the persistence daemon; past this it is taken as hung
OPEN_TIMEOUT_S = 30.0
# NVML's "not available" (NVML_VALUE_NOT_AVAILABLE_ulonglong): all 64 bits set. A memory
# figure this large, or the float it becomes in Prometheus text (2**64), is that sentinel
NOT_AVAILABLE_BYTES = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class GpuReading:
    """One GPU, or one MIG instance of a GPU (``mig=True``, ``parent_index`` set).

    ``index`` is NVML's device index for a whole GPU and the MIG slot index within the parent
    for an instance. ``utilization_pct`` is None where NVML does not support it (MIG), or
    answers a figure outside 0–100 (:func:`checked`).
    """

    index: int
    uuid: str
    name: str
    memory_used_bytes: int
    memory_total_bytes: int
    utilization_pct: float | None = None
    mig: bool = False
    parent_index: int | None = None

    @property
    def key(self) -> str:
        """``"0"`` for GPU 0, ``"0:2"`` for MIG slot 2 on GPU 0; what source filters match."""
        return f"{self.parent_index}:{self.index}" if self.mig else str(self.index)

    @property
    def memory_used_ratio(self) -> float | None:
        if self.memory_total_bytes <= 0:
            return None
        return self.memory_used_bytes / self.memory_total_bytes


class GpuReader(Protocol):
    """Something that reports the GPUs it sees; blocking, so call it off the event loop."""

    def read(self) -> list[GpuReading]: ...


class AsyncGpuReader:
    """A ``GpuReader`` read from async code: in a worker thread, with a timeout.

    A driver in trouble can make an NVML call hang. The caller gets ``TimeoutError`` after
    ``timeout_s`` and moves on, while the hung read keeps its thread; the next call waits on
    that same read instead of starting another, so hung reads never pile up threads.
    The thread is a daemon of its own, not the event loop's executor: ``asyncio.run`` waits
    for the executor's threads as it ends, so a read hung in the driver kept ``kvgate serve``
    and ``kvgate agent`` from exiting after SIGTERM until they were killed.
    """

    def __init__(self, reader: GpuReader):
        self.reader = reader
        self._pending: asyncio.Future[list[GpuReading]] | None = None

    async def read(self, timeout_s: float) -> list[GpuReading]:
        if self._pending is None or self._pending.done():
            self._pending = self._start()
            self._pending.add_done_callback(_retrieve)
        # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a cancellation
        # that lands as the read completes, and the task that awaited it then never stops
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(self._pending)

    def _start(self) -> asyncio.Future[list[GpuReading]]:
        """One read in a daemon thread; its outcome settles the returned future."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[GpuReading]] = loop.create_future()

        def run() -> None:
            try:
                outcome: list[GpuReading] | Exception = self.reader.read()
            except Exception as exc:
                outcome = exc
            with contextlib.suppress(RuntimeError):  # the loop closed while the read hung
                loop.call_soon_threadsafe(_settle, future, outcome)

        threading.Thread(target=run, name="kvgate-gpu-read", daemon=True).start()
        return future


def _settle(future: asyncio.Future[list[GpuReading]],
            outcome: list[GpuReading] | Exception) -> None:
    if future.done():
        return
    if isinstance(outcome, Exception):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _retrieve(future: asyncio.Future[list[GpuReading]]) -> None:
    """Mark a read's error as seen: one that finished after its caller gave up is not news."""
    if not future.cancelled():
        future.exception()


# -- NVML ----------------------------------------------------------------------------------


class NvmlReader:
    """GPUs and their MIG instances through NVML (``nvidia-ml-py``).

    Devices are enumerated on every ``read()``: MIG instances can be created and destroyed
    while kvgate runs, and enumeration costs a few microseconds per device. A device that
    fails to answer is left out of that reading (and logged at debug) rather than hiding
    the others. ``nvml`` is the ``pynvml`` module; it is a parameter only so the MIG paths
    can be exercised on hosts without a GPU.
    """

    def __init__(self, nvml: Any = pynvml):
        self.nvml = nvml

    def read(self) -> list[GpuReading]:
        nvml = self.nvml
        readings: list[GpuReading] = []
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
            except nvml.NVMLError as exc:
                log.debug("NVML: GPU %d did not answer: %s", index, exc)
                continue
            try:
                reading = self._reading(handle, index)
            except nvml.NVMLError as exc:
                # its slices are read all the same: in a container, NVML refuses a MIG
                # GPU's own memory query (Insufficient Permissions) while each slice answers
                log.debug("NVML: GPU %d did not answer: %s", index, exc)
                reading = None
            if reading is not None:
                readings.append(reading)
            readings.extend(self._mig_readings(handle, index))
        return readings

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.debug("NVML shutdown: %s", exc)

    def _mig_readings(self, handle: Any, parent: int) -> Iterator[GpuReading]:
        nvml = self.nvml
        try:
            current_mode, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError:
            return  # not MIG-capable
        if current_mode != nvml.NVML_DEVICE_MIG_ENABLE:
            return
        try:
            slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nvml.NVMLError as exc:
            log.debug("NVML: GPU %d's MIG slots did not answer: %s", parent, exc)
            return
        for slot in range(slots):
            try:
                mig_handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except nvml.NVMLError:
                continue  # an empty slot answers NVML_ERROR_NOT_FOUND
            try:
                reading = self._reading(mig_handle, slot, parent)
            except nvml.NVMLError as exc:
                # a slice destroyed mid-read, or one sick: only it is left out, not the
                # slices after it (their endpoints would lose their own watermark)
                log.debug("NVML: MIG slot %d of GPU %d did not answer: %s", slot, parent, exc)
                continue
            if reading is not None:
                yield reading

    def _reading(self, handle: Any, index: int, parent: int | None = None
                 ) -> GpuReading | None:
        """The device's reading, checked (:func:`checked`): None when its memory figures
        are NVML's "not available" or impossible."""
        nvml = self.nvml
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        reading = checked(GpuReading(
            index=index,
            uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
            name=_text(nvml.nvmlDeviceGetName(handle)),
            memory_used_bytes=int(memory.used),
            memory_total_bytes=int(memory.total),
            utilization_pct=self._utilization(handle),
            mig=parent is not None,
            parent_index=parent,
        ))
        if reading is None:
            log.debug("NVML: %s reported memory used %d of %d bytes: taken as unknown",
                      f"MIG slot {index} of GPU {parent}" if parent is not None
                      else f"GPU {index}", memory.used, memory.total)
        return reading

    def _utilization(self, handle: Any) -> float | None:
        try:
            return float(self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except self.nvml.NVMLError:
            return None  # MIG instances, and whole GPUs in MIG mode, do not report it


def checked(reading: GpuReading) -> GpuReading | None:
    """``reading`` with NVML's "not available" sentinels and impossible figures taken as
    unknown, never passed on.

    A utilization outside 0–100 becomes None, as on MIG: some devices and drivers answer
    0xFFFFFFFF, which was served as a ratio of 4.3e7. Memory figures no GPU can have (no
    total, the all-ones sentinel, more used than there is) leave the reading out (None),
    as a memory query that fails does: a watermark read from them would hold an endpoint
    for good, or send work to a full GPU.
    """
    used, total = reading.memory_used_bytes, reading.memory_total_bytes
    if not (0 < total < NOT_AVAILABLE_BYTES and 0 <= used <= total):
        return None
    pct = reading.utilization_pct
    if pct is not None and not 0 <= pct <= 100:  # NaN included
        return replace(reading, utilization_pct=None)
    return reading


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def open_gpu_reader(nvml: Any = pynvml, timeout_s: float = OPEN_TIMEOUT_S
                    ) -> NvmlReader | None:
    """An ``NvmlReader`` if NVML works and sees a GPU, else ``None`` and one log line.

    Never raises: a host without GPUs is a supported configuration (gateway mode reads GPUs
    through agents), so the line is a warning that says what is off, not an error. Nor
    hangs: NVML is opened in a daemon thread, and one that has not answered in ``timeout_s``
    is left there, as no NVML (a sick driver held ``kvgate serve`` with a local GPU source,
    and ``kvgate agent``, before their ports ever opened).
    """
    opened: queue.SimpleQueue[NvmlReader | None] = queue.SimpleQueue()
    threading.Thread(target=lambda: opened.put(_open(nvml)), name="kvgate-nvml-open",
                     daemon=True).start()
    try:
        return opened.get(timeout=timeout_s)
    except queue.Empty:
        log.warning("NVML did not answer within %gs: no local GPU readings on this host",
                    timeout_s)
        return None


def _open(nvml: Any) -> NvmlReader | None:
    try:
        nvml.nvmlInit()
    except Exception as exc:
        log.warning("NVML unavailable (%s): no local GPU readings on this host", exc)
        return None
    reader = NvmlReader(nvml)
    try:
        count = len(reader.read())
    except Exception as exc:
        reader.close()
        log.warning("NVML loaded but reading GPUs failed (%s): no local GPU readings", exc)
        return None
    if count == 0:
        reader.close()
        log.warning("NVML loaded but reports no GPUs: no local GPU readings on this host")
        return None
    log.info("NVML: reading %d GPU device(s) and MIG instance(s)", count)
    return reader


# -- Prometheus text, both ways ------------------------------------------------------------


def render_gpu_metrics(readings: Iterable[GpuReading]) -> str:
    """Prometheus text exposition of the readings (what ``kvgate agent`` serves)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_GpuCollector(list(readings)))
    return generate_latest(registry).decode()


class _GpuCollector:
    def __init__(self, readings: list[GpuReading]):
        self.readings = readings

    def collect(self) -> list[Metric]:
        used = GaugeMetricFamily(MEMORY_USED, "GPU memory in use, bytes (NVML).", labels=LABELS)
        total = GaugeMetricFamily(MEMORY_TOTAL, "GPU memory size, bytes (NVML).", labels=LABELS)
        util = GaugeMetricFamily(UTILIZATION, "GPU busy fraction over NVML's sample period.",
                                 labels=LABELS)
        for reading in self.readings:
            labels = _labels(reading)
            used.add_metric(labels, reading.memory_used_bytes)
            total.add_metric(labels, reading.memory_total_bytes)
            if reading.utilization_pct is not None:
                util.add_metric(labels, reading.utilization_pct / 100)
        return [used, total, util]


def _labels(reading: GpuReading) -> list[str]:
    if reading.mig:
        return [str(reading.parent_index), reading.uuid, reading.name, str(reading.index)]
    return [str(reading.index), reading.uuid, reading.name, ""]


def parse_gpu_metrics(text: str) -> list[GpuReading]:
    """The readings in ``render_gpu_metrics`` text; incomplete or malformed ones are skipped.

    A GPU is identified by its UUID; one without both memory figures is left out (a reading
    that cannot give a memory ratio is no watermark). Figures no GPU can have are checked
    as NVML's own are (:func:`checked`): an agent from before that check (a rolling
    upgrade), or another exporter, may serve NVML's sentinels. Order follows first
    appearance.
    """
    samples, problems = read_samples(text, (MEMORY_USED, MEMORY_TOTAL, UTILIZATION))
    for problem in problems:
        log.debug("GPU metrics: %s", problem)
    rows: dict[str, dict[str, Any]] = {}
    for sample in samples:
        uuid = sample.labels.get("uuid", "")
        row = rows.setdefault(uuid, {"labels": sample.labels})
        row[sample.name] = sample.value
    readings = []
    for uuid, row in rows.items():
        reading = _reading_from_row(uuid, row)
        if reading is not None:
            readings.append(reading)
    return readings


def _reading_from_row(uuid: str, row: dict[str, Any]) -> GpuReading | None:
    labels = row["labels"]
    if not uuid or MEMORY_USED not in row or MEMORY_TOTAL not in row:
        return None
    try:
        gpu = int(labels.get("gpu", ""))
        mig_instance = int(labels["mig_instance"]) if labels.get("mig_instance") else None
    except ValueError:
        return None
    ratio = row.get(UTILIZATION)
    return checked(GpuReading(
        index=gpu if mig_instance is None else mig_instance,
        uuid=uuid,
        name=labels.get("name", ""),
        memory_used_bytes=int(row[MEMORY_USED]),
        memory_total_bytes=int(row[MEMORY_TOTAL]),
        utilization_pct=None if ratio is None else round(ratio * 100, 6),
        mig=mig_instance is not None,
        parent_index=gpu if mig_instance is not None else None,
    ))
