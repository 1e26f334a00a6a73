"""The NVML path on a real GPU, end to end: ``kvgate agent`` → scraper → scheduler.

Everything else tests NVML through a fake reader at one seam (``GpuReader``); this script
is for a machine with a GPU and its driver. It

1. reads the GPUs in-process (``open_gpu_reader()``, what ``gpu_source: local`` uses), and
   times 200 such reads;
2. starts the real ``kvgate agent`` CLI as a subprocess and reads its Prometheus page;
3. points a scraper at a simulated engine with that agent as its GPU source, and asks the
   scheduler to place a request: it must be placed;
4. fills the GPU's memory past ``watermarks.gpu_memory_critical`` with PyTorch allocations,
   and asks again once the agent has refreshed: the endpoint must be held (``engine_full``);
5. frees the memory and asks again: placed.

``python -m bench.nvml_proof --out bench/results/nvml-proof.json`` (``--dry-run``: a
synthetic GPU instead of NVML and PyTorch, to check the script on a machine without one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

from extproc.config import Pool
from extproc.datalayer.endpoints import EndpointStore
from extproc.datalayer.nvml import GpuReading, open_gpu_reader, parse_gpu_metrics
from extproc.datalayer.scraper import Scraper
from extproc.engine.server import start_engine
from extproc.ports import free_port
from extproc.scheduler import Placement, PoolScheduler


class SyntheticGpu:
    """--dry-run: one 100 GiB GPU whose used memory the "load" step sets."""

    def __init__(self) -> None:
        self.used = 1 << 30

    def read(self) -> list[GpuReading]:
        return [GpuReading(0, "GPU-dry-run", "synthetic", self.used, 100 << 30, 0.0)]


class TorchLoad:
    """Fills GPU 0's memory past a ratio with 1 GiB tensors, and frees it."""

    def __init__(self) -> None:
        import torch

        self.torch, self.blocks = torch, []

    def fill(self, ratio: float) -> None:
        free, total = self.torch.cuda.mem_get_info(0)
        while (total - free) / total < ratio:
            self.blocks.append(self.torch.empty(1 << 30, dtype=self.torch.uint8, device="cuda"))
            free, total = self.torch.cuda.mem_get_info(0)

    def free(self) -> None:
        self.blocks.clear()
        self.torch.cuda.empty_cache()


def read_times_ms(reader: Any, reads: int = 200) -> dict[str, float]:
    """What one in-process read costs (NVML calls block: the agent and ``gpu_source: local``
    run them in a worker thread)."""
    times = []
    for _ in range(reads):
        started = time.perf_counter()
        reader.read()
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    return {"reads": reads, "p50": times[reads // 2], "p99": times[int(reads * 0.99)],
            "max": times[-1]}


def agent_page(port: int, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return r.read().decode()
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def decide(scraper: Scraper, scheduler: PoolScheduler, endpoint: str) -> dict[str, Any]:
    snapshot = await scraper.scrape_once()
    state = snapshot.get("chat", endpoint)
    placed = scheduler.place("t", 100, snapshot, time.monotonic(), random.Random(0), band=1)
    return {"gpu_memory_used_ratio": state.gpu_memory_used_ratio,
            "gpus": [asdict(g) for g in state.gpus],
            "placed": isinstance(placed, Placement),
            "answer": placed.endpoints if isinstance(placed, Placement) else placed.reason,
            "holds": dict(scheduler.holds)}


async def prove(dry_run: bool, agent_port: int) -> dict[str, Any]:
    synthetic = SyntheticGpu() if dry_run else None
    reader = synthetic or open_gpu_reader()
    if reader is None:
        raise SystemExit("no NVML here: run with --dry-run, or on a machine with a GPU")
    result: dict[str, Any] = {"in_process": [asdict(g) for g in reader.read()],
                              "read_ms": read_times_ms(reader)}
    agent = None
    if dry_run:
        from extproc.datalayer.agent import start_agent

        handle = await start_agent(port=agent_port, reader=synthetic, interval_s=0.2)
    else:
        agent = subprocess.Popen([sys.executable, "-c", "import sys; from extproc.cli import main;"
                                  " sys.exit(main(sys.argv[1:]))", "agent", "--host",
                                  "127.0.0.1", "--port", str(agent_port)])
    load = None if dry_run else TorchLoad()
    engine = await start_engine(port=0)
    endpoint = f"{engine.host}:{engine.port}"
    store = EndpointStore()
    await store.set_endpoints("chat", [endpoint])
    scraper = Scraper(store, gpu_sources={endpoint: f"http://127.0.0.1:{agent_port}/metrics"})
    pool = Pool.model_validate({"name": "chat", "models": ["m"], "endpoints": [endpoint]})
    scheduler = PoolScheduler(pool, {"t": 1.0})
    try:
        page = await asyncio.to_thread(agent_page, agent_port)
        result["agent_page"] = page
        result["agent_readings"] = [asdict(g) for g in parse_gpu_metrics(page)]
        result["idle"] = await decide(scraper, scheduler, endpoint)
        target = pool.watermarks.gpu_memory_critical + 0.005
        if synthetic is not None:
            synthetic.used = int(target * (100 << 30)) + 1
        else:
            await asyncio.to_thread(load.fill, target)
        await asyncio.sleep(2.5)  # the agent refreshes every second
        result["filled"] = await decide(scraper, scheduler, endpoint)
        if synthetic is not None:
            synthetic.used = 1 << 30
        else:
            await asyncio.to_thread(load.free)
        await asyncio.sleep(2.5)
        result["freed"] = await decide(scraper, scheduler, endpoint)
    finally:
        await scraper.stop()
        await engine.stop()
        if agent is not None:
            agent.terminate()
            result["agent_exit"] = agent.wait(timeout=10)
        else:
            await handle.stop()
    result["gpu_memory_critical"] = pool.watermarks.gpu_memory_critical
    result["proved"] = (result["idle"]["placed"] and not result["filled"]["placed"]
                        and result["filled"]["holds"].get("engine_full") == 1
                        and result["freed"]["placed"])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, help="write the readings and decisions as JSON")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    result = asyncio.run(prove(args.dry_run, free_port()))
    for step in ("idle", "filled", "freed"):
        r = result[step]
        print(f"{step:7} GPU memory used {r['gpu_memory_used_ratio']:.4f}  "
              f"placed {r['placed']}  ({r['answer']}; holds {r['holds']})")
    print("in-process:", result["in_process"])
    print("in-process read, ms:", result["read_ms"])
    print("proved:", result["proved"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["proved"] else 1


if __name__ == "__main__":
    sys.exit(main())
