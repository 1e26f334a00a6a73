"""MIG slices as endpoints: each endpoint names the GPU or MIG slice it runs on
(``endpoint_gpus``), so the NVML memory watermark is that endpoint's own.

The README's worked example, through the NVML seam (``StubNvml`` stands in for ``pynvml``,
answering the same MIG calls a real A100 would): GPU 0 is an A100 80GB cut into 3g.40gb +
2 × 2g.20gb, one vLLM per slice; GPU 1 is a whole GPU two small vLLMs share. Config →
``gpu_sources`` → scraper → endpoint states → picker, read locally and through
``kvgate agent``.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest

from extproc.config import Config, ConfigError, hash_api_key, parse_config
from extproc.datalayer.agent import start_agent
from extproc.datalayer.endpoints import EndpointStore, StoreSnapshot
from extproc.datalayer.nvml import NvmlReader
from extproc.datalayer.scraper import Scraper
from extproc.engine.server import EngineHandle, start_engine
from extproc.scheduler import PoolScheduler
from extproc.server import gpu_sources
from limiter import Reject
from tests.unit.extproc.datalayer.test_nvml import StubNvml

MiB = 1 << 20
A100 = "NVIDIA A100-SXM4-80GB"
SLICES = {"3g": "MIG-1b2c3d4e-0000-5000-8000-000000000003",
          "2g-a": "MIG-1b2c3d4e-0000-5000-8000-000000000021",
          "2g-b": "MIG-1b2c3d4e-0000-5000-8000-000000000022"}


class A100Node(StubNvml):
    """GPU 0: A100 80GB in MIG mode, slots 0-2 = 3g.40gb, 2g.20gb, 2g.20gb. GPU 1: whole.

    ``listings`` counts device enumerations: one per read, however many endpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.listings = 0
        mig = {"util": None, "mig": None}
        self.devices = {
            ("gpu", 0): dict(uuid="GPU-a100", name=A100, used=61_000 * MiB, total=81_920 * MiB,
                             util=None, mig=self.NVML_DEVICE_MIG_ENABLE),
            ("mig", 0, 0): dict(uuid=SLICES["3g"], name=f"{A100} MIG 3g.40gb",
                                used=30_000 * MiB, total=40_192 * MiB, **mig),
            ("mig", 0, 1): dict(uuid=SLICES["2g-a"], name=f"{A100} MIG 2g.20gb",
                                used=12_000 * MiB, total=19_968 * MiB, **mig),
            ("mig", 0, 2): dict(uuid=SLICES["2g-b"], name=f"{A100} MIG 2g.20gb",
                                used=15_000 * MiB, total=19_968 * MiB, **mig),
            ("gpu", 1): dict(uuid="GPU-whole", name="NVIDIA L40S", used=20_000 * MiB,
                             total=46_068 * MiB, util=30, mig=None),
        }

    def nvmlDeviceGetCount(self) -> int:
        self.listings += 1
        return 2

    def fill(self, handle: tuple, ratio: float) -> None:
        self.devices[handle]["used"] = int(self.devices[handle]["total"] * ratio)


@pytest.fixture
async def engines() -> AsyncIterator[dict[str, EngineHandle]]:
    """One simulated vLLM per slice, and two sharing GPU 1."""
    handles = {name: await start_engine(port=0, ms_per_token=1, kv_blocks=100)
               for name in ("3g", "2g-a", "2g-b", "shared-1", "shared-2")}
    yield handles
    for handle in handles.values():
        await handle.stop()


def address(handle: EngineHandle) -> str:
    return f"{handle.host}:{handle.port}"


def config(engines: dict[str, EngineHandle], gpu_source: str, **pool: object) -> Config:
    """The worked example's pool; ``pool`` overrides its fields."""
    a = {name: address(handle) for name, handle in engines.items()}
    endpoint_gpus = {
        a["3g"]: "0:0",               # by index key: GPU 0, MIG slot 0
        a["2g-a"]: SLICES["2g-a"],    # by the slice's own UUID
        a["2g-b"]: ["0:2"],
        a["shared-1"]: "1", a["shared-2"]: "GPU-whole",  # one GPU, two vLLMs
    }
    return parse_config({
        "tiers": {"t": {}},
        "tenants": [{"name": "x", "tier": "t", "api_keys": [hash_api_key("k")]}],
        "pools": [{"name": "chat", "models": ["tiny-llama"], "endpoints": list(a.values()),
                   "gpu_source": gpu_source, "endpoint_gpus": endpoint_gpus, **pool}],
    })


async def scrape(cfg: Config, nvml: StubNvml | None = None) -> StoreSnapshot:
    store = EndpointStore()
    await store.set_endpoints("chat", cfg.pools[0].endpoints)
    reader = None if nvml is None else NvmlReader(nvml)
    # a generous timeout: a loaded CI machine must not turn a slow scrape into no reading
    scraper = Scraper(store, timeout_s=5, gpu_sources=gpu_sources(cfg),
                      gpu_reader=reader)
    try:
        snapshot = await scraper.scrape_once()
    finally:
        await scraper.stop()
    assert all(s.healthy for s in snapshot.states()), [s.last_error for s in snapshot.states()]
    return snapshot


def ratios(engines: dict[str, EngineHandle], snapshot: StoreSnapshot) -> dict[str, float]:
    return {name: round(snapshot.get("chat", address(h)).gpu_memory_used_ratio, 3)
            for name, h in engines.items()}


def placed(cfg: Config, snapshot: StoreSnapshot, engines: dict[str, EngineHandle]) -> set[str]:
    """The endpoints the picker uses for a small request (idle engines tie, and ties break
    at random: over many draws every eligible one comes up), by engine name."""
    names = {address(h): name for name, h in engines.items()}
    now = max(s.scraped_at for s in snapshot.states())
    scheduler = PoolScheduler(cfg.pools[0], {"x": 1.0})
    used: set[str] = set()
    for seed in range(64):
        placement = scheduler.place("x", 10, snapshot, now, random.Random(seed))
        if isinstance(placement, Reject):
            assert placement.reason == "pool_saturated"
            return used
        used |= {names[a] for a in placement.endpoints}
    return used


EXPECTED = {"3g": round(30_000 / 40_192, 3), "2g-a": round(12_000 / 19_968, 3),
            "2g-b": round(15_000 / 19_968, 3), "shared-1": round(20_000 / 46_068, 3),
            "shared-2": round(20_000 / 46_068, 3)}


async def test_each_endpoint_reads_only_its_own_slice(engines) -> None:
    nvml = A100Node()
    cfg = config(engines, "local")
    snapshot = await scrape(cfg, nvml)
    assert ratios(engines, snapshot) == EXPECTED
    own = {name: [g.uuid for g in snapshot.get("chat", address(h)).gpus]
           for name, h in engines.items()}
    assert own == {"3g": [SLICES["3g"]], "2g-a": [SLICES["2g-a"]], "2g-b": [SLICES["2g-b"]],
                   "shared-1": ["GPU-whole"], "shared-2": ["GPU-whole"]}
    shared = [snapshot.get("chat", address(engines[n])).gpus for n in ("shared-1", "shared-2")]
    assert shared[0] == shared[1]  # several endpoints on one GPU share its reading
    assert nvml.listings == 1  # ... taken once per round for all five endpoints


async def test_a_full_slice_stops_only_its_own_endpoint(engines) -> None:
    nvml = A100Node()
    nvml.fill(("mig", 0, 2), 0.99)  # above gpu_memory_critical (0.98)
    cfg = config(engines, "local")
    assert placed(cfg, await scrape(cfg, nvml), engines) == set(engines) - {"2g-b"}
    nvml.fill(("gpu", 1), 0.99)  # the shared GPU: both of its endpoints stop
    assert placed(cfg, await scrape(cfg, nvml), engines) == {"3g", "2g-a"}


async def test_per_pool_gpus_made_every_slice_share_the_fullest_reading(engines) -> None:
    """What endpoint_gpus fixes: without it, each endpoint of the pool reads every GPU the
    pool names, and one full slice (here 2g-b) takes the whole pool out."""
    nvml = A100Node()
    nvml.fill(("mig", 0, 2), 0.99)
    cfg = config(engines, "local", gpus=["0:0", "0:1", "0:2", "1"], endpoint_gpus={})
    snapshot = await scrape(cfg, nvml)
    assert set(ratios(engines, snapshot).values()) == {0.99}
    assert placed(cfg, snapshot, engines) == set()


async def test_slices_read_through_kvgate_agent(engines) -> None:
    """Gateway mode: the node's ``kvgate agent`` serves every slice; each endpoint still
    keeps only its own (the MIG slot and parent GPU survive the Prometheus round trip)."""
    nvml = A100Node()
    agent = await start_agent(reader=NvmlReader(nvml), interval_s=0.05)
    try:
        cfg = config(engines, f"http://{{ip}}:{agent.port}")
        snapshot = await scrape(cfg)
    finally:
        await agent.stop()
    assert ratios(engines, snapshot) == EXPECTED
    [slice_2g] = snapshot.get("chat", address(engines["2g-b"])).gpus
    assert (slice_2g.mig, slice_2g.parent_index, slice_2g.index, slice_2g.key) == (
        True, 0, 2, "0:2")


def test_endpoint_gpus_are_checked() -> None:
    pool = {"name": "p", "models": ["m"], "endpoints": ["10.0.0.5:8000"],
            "endpoint_gpus": {"10.0.0.5:8001": "0:1", "10.0.0.5:8000": ["gpu0", "MIG-x"]}}
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": {"t": {}}, "pools": [pool],
                      "tenants": [{"name": "x", "tier": "t", "api_keys": [hash_api_key("k")]}]})
    [problem] = info.value.problems
    assert problem.startswith("pools[0]: ")
    assert "endpoint_gpus: '10.0.0.5:8001' is not one of the endpoints" in problem
    assert "'gpu0' is neither a GPU/MIG UUID nor a 'gpu' or 'gpu:mig' index key" in problem
    assert "endpoint_gpus: set gpu_source ('local' or a kvgate agent URL)" in problem


@pytest.mark.parametrize("source", ["ftp://10.0.0.5:9400", "http://", "Local", "10.0.0.5:9400"])
def test_a_gpu_source_serve_cannot_read_is_refused_by_the_config(source: str) -> None:
    # `kvgate check` passed these and `kvgate serve` then died in GpuSource.parse
    pool = {"name": "p", "models": ["m"], "endpoints": ["10.0.0.5:8000"],
            "gpu_source": source}
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": {"t": {}}, "pools": [pool],
                      "tenants": [{"name": "x", "tier": "t", "api_keys": [hash_api_key("k")]}]})
    assert info.value.problems == [
        f"pools[0].gpu_source: {source!r} is neither 'local' nor an http(s) URL "
        "(a kvgate agent's, e.g. 'http://{ip}:9400')"]


def test_pool_gpus_are_checked_like_endpoint_gpus() -> None:
    # a misspelt key matched no reading: the memory watermark silently never applied
    pool = {"name": "p", "models": ["m"], "endpoints": ["10.0.0.5:8000"],
            "gpu_source": "local", "gpus": ["gpu0", "0:1", "MIG-x"]}
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": {"t": {}}, "pools": [pool],
                      "tenants": [{"name": "x", "tier": "t", "api_keys": [hash_api_key("k")]}]})
    assert info.value.problems == [
        "pools[0]: gpus: 'gpu0' is neither a GPU/MIG UUID nor a 'gpu' or 'gpu:mig' index key"]


@pytest.mark.parametrize("source", ["local", "http://10.0.0.5:9400", "https://{ip}:9400/m"])
def test_every_gpu_source_the_config_accepts_serve_reads(source: str) -> None:
    pool = {"name": "p", "models": ["m"], "endpoints": ["10.0.0.5:8000"], "gpu_source": source}
    cfg = parse_config({"tiers": {"t": {}}, "pools": [pool],
                        "tenants": [{"name": "x", "tier": "t", "api_keys": [hash_api_key("k")]}]})
    assert gpu_sources(cfg)
