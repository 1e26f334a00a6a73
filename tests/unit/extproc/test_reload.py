"""Hot reload, without a server: what a new file changes, what waits for a restart, what is
refused; the file watch; a removed tenant's requests releasing under its last policy."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

import orjson
import pytest
import yaml

from extproc.config import ConfigError, hash_api_key, parse_config
from extproc.director import Admission
from extproc.openai import BadRequest, parse_body
from extproc.reload import ConfigFile, plan
from extproc.server import KvgateServer
from extproc.tenants import Tenants
from extproc.wiring import build_director
from limiter import Reject
from limiter.stores import MemoryFairness, MemoryStore


def data(concurrency: int = 5, tenants: tuple[str, ...] = ("acme", "gone")) -> dict:
    return {
        "tiers": {"gold": {"limits": {"max_concurrency": concurrency}}},
        "tenants": [{"name": name, "tier": "gold", "api_keys": [hash_api_key(f"sk-{name}")]}
                    for name in tenants],
        "pools": [{"name": "p", "models": ["m"], "endpoints": ["127.0.0.1:7001"],
                   "kv_aware": False}],
    }


def test_plan_names_tenants_added_removed_and_changed() -> None:
    running = parse_config(data())
    change = plan(running, parse_config(data(1, ("acme", "new"))))
    assert (change.added, change.removed, change.changed) == (["new"], ["gone"], ["acme"])
    assert change.restart == []
    assert change.config.limits_for(change.config.tenants[0]).max_concurrency == 1


def test_a_tiers_weight_or_overflow_changed_names_its_tenants_as_changed() -> None:
    """Applied live, but logged as "changed none" for the tier's tenants before."""
    running = parse_config(data())
    for tier in ({"weight": 4}, {"overflow": "reject"}, {"long_prompt_tokens": 100}):
        new = data()
        new["tiers"]["gold"] |= tier
        assert plan(running, parse_config(new)).changed == ["acme", "gone"], tier


def test_sections_that_cannot_change_live_keep_their_running_values() -> None:
    running = parse_config({**data(), "server": {"grpc_port": 9001}})
    new = parse_config({**data(), "server": {"grpc_port": 9100},
                        "redis": {"url": "redis://10.0.0.1:6379"}, "scrape": {"interval_s": 1}})
    change = plan(running, new)
    assert change.restart == ["redis", "scrape", "server"]
    assert change.config.server.grpc_port == 9001 and change.config.redis is None
    assert change.config.scrape == running.scrape


def test_the_class_header_waits_for_a_restart_the_rest_of_classification_does_not() -> None:
    """The rendered Envoy config forwards the class header by name: a reload that renamed
    it read a header Envoy no longer sends, and every client's class was ignored."""
    running = parse_config(data())
    new = parse_config({**data(), "classification": {
        "header": "x-class", "path_classes": {"/v1/embeddings": "interactive"}}})
    change = plan(running, new)
    assert change.restart == ["classification.header"]
    assert change.config.classification.header == "x-request-class"
    assert change.config.classification.path_classes == {"/v1/embeddings": "interactive"}


def test_live_sections_that_need_a_restart_only_section_are_refused() -> None:
    running = parse_config(data())
    new = data()
    new["classes"] = {"interactive": {"priority": 0}, "batch": {"priority": 1},
                      "gold-class": {"priority": 2}}
    new["tenants"][0]["default_class"] = "gold-class"
    with pytest.raises(ConfigError) as error:
        plan(running, parse_config(new), "kvgate.yaml")
    assert error.value.source == "kvgate.yaml"
    assert any("unknown class 'gold-class'" in p for p in error.value.problems)


def test_config_file_changes_only_when_its_content_does(tmp_path: Path) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data()))
    watched = ConfigFile(path)
    assert not watched.changed()
    os.utime(path, ns=(1, 1))  # touched, same bytes
    assert not watched.changed()
    path.write_text(yaml.safe_dump(data(3)))
    assert watched.changed()
    assert watched.load().tiers["gold"].limits.max_concurrency == 3
    assert not watched.changed()
    path.write_text("tiers: [")  # broken: reported by load, then no longer "changed"
    assert watched.changed()
    with pytest.raises(ConfigError):
        watched.load()
    assert not watched.changed()
    path.unlink()
    assert not watched.changed()


def rejected(server: KvgateServer) -> float:
    value = server.metrics.registry.get_sample_value("kvgate_config_reloads_total",
                                                      {"result": "rejected"})
    assert value is not None
    return value


async def poll_for(server: KvgateServer, seconds: float, every_s: float = 0.05) -> float:
    """Run the config poll for ``seconds`` beside a 10 ms ticker; the longest the loop
    went without ticking."""
    gaps: list[float] = []

    async def tick() -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    poller = asyncio.create_task(server._poll_config(every_s))
    await asyncio.sleep(seconds)
    for task in (poller, ticker):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    while server._reloads:
        await asyncio.gather(*server._reloads)
    return max(gaps)


async def test_the_poll_hashes_a_changed_file_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed stat made the poll read and hash the file on the loop that serves every
    admission (milliseconds for a large file)."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data()))
    server = KvgateServer(parse_config(data()), config_path=path)
    path.write_text(yaml.safe_dump(data(concurrency=1)))
    import hashlib
    import types

    import extproc.reload as reload_module

    on_loop: list[bool] = []

    def slow(content: bytes):  # a large file, a slow disk
        on_loop.append(threading.current_thread() is threading.main_thread())
        time.sleep(0.3)
        return hashlib.sha256(content)

    monkeypatch.setattr(reload_module, "hashlib", types.SimpleNamespace(sha256=slow))
    gap = await poll_for(server, 1.2)
    assert on_loop and not any(on_loop), on_loop
    assert gap < 0.2, gap  # the loop kept ticking through the 0.3 s reads
    assert server.config.tiers["gold"].limits.max_concurrency == 1


async def test_a_fifo_at_the_config_path_is_refused_unopened_and_reported_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO put where the config was: the poll saw its stat change and opened it on the
    event loop, which then waited for a writer (up to ``FIFO_WAIT_S``; a slow writer held
    it for as long as it wrote) — every admission stalled — and said nothing of it."""
    monkeypatch.setattr("extproc.yaml_input.FIFO_WAIT_S", 1.0)
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data()))
    server = KvgateServer(parse_config(data()), config_path=path)
    path.unlink()
    os.mkfifo(path)
    with caplog.at_level("INFO", logger="extproc.server"):
        gap = await poll_for(server, 0.6)
    assert gap < 0.2, gap
    [warning] = [r for r in caplog.records if r.levelname == "WARNING"]
    assert "a FIFO, not a regular file" in warning.getMessage()
    assert "the running config stays" in warning.getMessage()
    assert rejected(server) == 1
    assert server.config.tiers["gold"].limits.max_concurrency == 5
    # a SIGHUP refuses it without opening it either
    assert await asyncio.wait_for(server.reload_in_thread("SIGHUP"), 0.5) is False
    # a regular file again: read, applied, and said
    caplog.clear()
    path.unlink()
    path.write_text(yaml.safe_dump(data(concurrency=2)))
    with caplog.at_level("INFO", logger="extproc.server"):
        await poll_for(server, 0.3)
    assert server.config.tiers["gold"].limits.max_concurrency == 2
    assert any("is readable again" in r.getMessage() for r in caplog.records)


async def test_a_deleted_config_file_is_reported_once_and_the_running_config_stays(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A deleted file was silent: the poll found no stat and said nothing, poll after
    poll, while the running config quietly outlived its file."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data()))
    server = KvgateServer(parse_config(data()), config_path=path)
    path.unlink()
    with caplog.at_level("WARNING", logger="extproc.server"):
        await poll_for(server, 0.5)  # ~10 polls
    [warning] = caplog.records
    assert f"config file {path} cannot be read (No such file or directory)" in (
        warning.getMessage())
    assert rejected(server) == 1
    assert server.config.tiers["gold"].limits.max_concurrency == 5
    path.write_text(yaml.safe_dump(data(concurrency=3)))
    await poll_for(server, 0.3)
    assert server.config.tiers["gold"].limits.max_concurrency == 3
    caplog.clear()
    path.unlink()  # gone again: said again, once
    with caplog.at_level("WARNING", logger="extproc.server"):
        await poll_for(server, 0.3)
    assert len(caplog.records) == 1 and rejected(server) == 2


async def test_a_configmap_symlink_swap_is_picked_up(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """The kubelet's layout: ``kvgate.yaml -> ..data/kvgate.yaml``, ``..data -> ..<ts>``,
    updated by pointing ``..data`` at a new directory in one rename. The file is followed
    through its links (a regular file), and the swap is neither a deletion nor a FIFO."""
    def version(name: str, concurrency: int) -> None:
        (tmp_path / name).mkdir()
        (tmp_path / name / "kvgate.yaml").write_text(yaml.safe_dump(data(concurrency)))
        (tmp_path / "..data_tmp").symlink_to(name)
        os.replace(tmp_path / "..data_tmp", tmp_path / "..data")

    version("..2024_01_01", 5)
    path = tmp_path / "kvgate.yaml"
    path.symlink_to("..data/kvgate.yaml")
    server = KvgateServer(parse_config(data()), config_path=path)
    version("..2024_01_02", 2)
    for old in (tmp_path / "..2024_01_01").iterdir():
        old.unlink()
    (tmp_path / "..2024_01_01").rmdir()
    with caplog.at_level("WARNING", logger="extproc.server"):
        await poll_for(server, 0.3)
    assert server.config.tiers["gold"].limits.max_concurrency == 2
    assert caplog.records == [] and rejected(server) == 0


def test_removed_tenants_keep_their_policy_but_cannot_authenticate() -> None:
    before = Tenants(parse_config(data()))
    gone = before.get("gone")
    assert gone is not None
    after = Tenants(parse_config(data(2, ("acme",))), previous=before)
    assert after.policy(gone) == before.policy(gone)
    assert after.weight(gone) == before.weight(gone)
    # its overflow too: a shaped tenant's requests waking from their pacing slot looked it
    # up (KeyError: 503 internal_error for each, after the reload removed the tenant)
    assert after.overflow(gone) == before.overflow(gone)
    with pytest.raises(BadRequest):
        after.authenticate("Bearer sk-gone")
    assert after.authenticate("Bearer sk-acme").name == "acme"


def test_director_reconfigure_applies_new_limits_and_releases_removed_tenants() -> None:
    async def run() -> None:
        store = MemoryStore()
        running = parse_config(data())
        director = build_director(running, store)
        gone = director.authenticate("Bearer sk-gone")
        held = await director.admit_request_only(gone, "/v1/models")
        change = plan(running, parse_config(data(1, ("acme",))))
        director.reconfigure(change.config)
        with pytest.raises(BadRequest):
            director.authenticate("Bearer sk-gone")
        acme = director.authenticate("Bearer sk-acme")
        first = await director.admit_request_only(acme, "/v1/models")
        second = await director.admit_request_only(acme, "/v1/models")
        assert type(second).__name__ == "Reject"  # concurrency is now 1
        await director.release(held, 0)  # type: ignore[arg-type]
        await director.release(first, 0)  # type: ignore[arg-type]
        assert director.active == {}
        assert await store.in_flight("gone") == 0

    asyncio.run(run())


def test_a_reload_refuses_a_hostile_file_in_one_short_line_and_keeps_running(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data()))
    server = KvgateServer(parse_config(data()), config_path=path)
    bomb = ["tiers:", "  - &l0 [" + ", ".join(["x"] * 10) + "]"]
    bomb += [f"  - &l{n} [{', '.join([f'*l{n - 1}'] * 10)}]" for n in range(1, 8)]
    for text, problem in [
        ("tiers: " + "[" * 500 + "]" * 500, "nested too deeply (more than 100 levels)"),
        ("\n".join(bomb), "expands to more than 1,000,000 values"),
        ("tiers: {}\ntiers: {}\n", "tiers: duplicate key at line 2"),
        (yaml.safe_dump({**data(), "tenants": [{"name": f"t{i}", "tier": f"{i}{'x' * 3000}"}
                                               for i in range(1000)]}),
         "more (`kvgate check` lists them all)"),
    ]:
        caplog.clear()
        path.write_text(text)
        assert server.config_file is not None and server.config_file.changed()
        with caplog.at_level("ERROR"):
            assert server.reload("file changed") is False
        [record] = caplog.records
        assert "rejected, the running config stays" in record.message
        assert problem in record.message and len(record.message) < 4000
        assert server.config.tiers["gold"].limits.max_concurrency == 5


def test_a_reload_reads_the_file_off_the_event_loop(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGHUP and the file poll read and validate in a worker thread: a config of tens of
    thousands of tenants takes seconds to parse, which stalled every request on the loop.
    The swap stays on the loop, one reload at a time."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data()))
    server = KvgateServer(parse_config(data()), config_path=path)
    path.write_text(yaml.safe_dump(data(concurrency=1)))
    slow_load = ConfigFile.load

    def load(self: ConfigFile):  # a large file
        import time
        time.sleep(0.3)
        return slow_load(self)

    monkeypatch.setattr(ConfigFile, "load", load)

    async def run() -> tuple[int, list[bool]]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        results = await asyncio.gather(server.reload_in_thread("SIGHUP"),
                                       server.reload_in_thread("file changed"))
        ticker.cancel()
        return ticks, results

    ticks, results = asyncio.run(run())
    assert ticks >= 20, ticks  # the loop ran throughout the 0.6 s of reading
    assert results == [True, True]
    assert server.config.tiers["gold"].limits.max_concurrency == 1


def test_a_reload_plans_and_builds_the_tenants_off_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the swap runs on the loop: comparing the configs and building the tenants of a
    file of 10,000 held it ~0.3 s, every tenant's admissions with it."""
    import extproc.server as server_module

    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data()))
    server = KvgateServer(parse_config(data()), config_path=path)
    path.write_text(yaml.safe_dump(data(concurrency=1, tenants=("acme",))))
    threads = []

    def recorded(fn):
        def wrapper(*args):
            threads.append((fn.__name__, threading.current_thread() is threading.main_thread()))
            return fn(*args)
        return wrapper

    monkeypatch.setattr(server_module, "plan", recorded(server_module.plan))
    monkeypatch.setattr(server_module, "prepare", recorded(server_module.prepare))
    assert asyncio.run(server.reload_in_thread("SIGHUP"))
    assert threads == [("plan", False), ("prepare", False)]
    assert server.config.tiers["gold"].limits.max_concurrency == 1


def test_a_burst_of_sighups_reloads_twice_not_once_each(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """50 SIGHUPs in a second each read, validated and swapped the whole file in turn: with
    10,000 tenants (~5 s a reload on a busy machine) kvgate reloaded for four minutes, its
    requests' p99 latency ten times its usual meanwhile. Those that come while one waits for
    its turn join it; one that comes while a read is under way gets one more read after it,
    so the last file written is the one that runs."""
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(data()))
    server = KvgateServer(parse_config(data()), config_path=path)
    reads, burst_over = 0, threading.Event()
    slow_load = ConfigFile.load

    def load(self: ConfigFile):  # a large file: read for as long as the burst lasts
        nonlocal reads
        reads += 1
        burst_over.wait(10)
        return slow_load(self)

    monkeypatch.setattr(ConfigFile, "load", load)

    async def storm() -> None:
        for n in range(50):
            if n == 25:
                path.write_text(yaml.safe_dump(data(concurrency=1)))
            server._on_sighup()
            await asyncio.sleep(0.002)
        burst_over.set()
        while server._reloads:
            await asyncio.gather(*server._reloads)

    asyncio.run(storm())
    assert reads == 2, reads
    assert server.config.tiers["gold"].limits.max_concurrency == 1


def test_long_authorization_values_are_never_remembered() -> None:
    """Padding a valid key ("Bearer" + spaces + key) made a new cache entry per request:
    one key holder sending 50 KB values grew kvgate by ~200 MB."""
    tenants = Tenants(parse_config(data()))
    for i in range(20):
        assert tenants.authenticate("Bearer" + " " * (300 + i) + "sk-acme").name == "acme"
    assert tenants.authenticate("Bearer sk-acme").name == "acme"
    assert list(tenants._recent) == ["Bearer sk-acme"]


def test_a_worker_reloads_the_file_as_it_runs_it(tmp_path: Path) -> None:
    """Worker i runs the file's ports + i: comparing those with the file's own made every
    reload of worker 1 warn that `server` changed and waits for a restart."""
    import logging

    from extproc.config import for_worker

    cfg = {**data(), "server": {"grpc_port": 0, "admin_port": 19_500, "report_port": 19_600}}
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    server = KvgateServer(for_worker(parse_config(cfg), 1), config_path=path, worker=1)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("extproc.server").addHandler(handler)
    try:
        assert server.reload("SIGHUP")
    finally:
        logging.getLogger("extproc.server").removeHandler(handler)
    assert not [r for r in records if "take effect only after a restart" in r.getMessage()]
    assert server.config.server.admin_port == 19_501


# -- removed tenants are forgotten once nothing of theirs is left ---------------------------

ENDPOINT = "127.0.0.1:7001"


def churn_data(names: list[str], **limits: object) -> dict:
    return {
        "tiers": {"gold": {"limits": {"max_concurrency": 5, **limits}}},
        "queue": {"aging_s": None},
        "tenants": [{"name": name, "tier": "gold", "api_keys": [hash_api_key(f"sk-{name}")]}
                    for name in names],
        "pools": [{"name": "p", "models": ["m"], "endpoints": [ENDPOINT]}],
    }


class Churn:
    """An in-process kvgate (no ports) reloading a file, with requests sent as a stream
    sends them: counted in the metrics, released with their usage."""

    def __init__(self, path: Path, names: list[str], **limits: object):
        self.path, self.limits = path, limits
        path.write_text(yaml.safe_dump(churn_data(names, **limits)))
        self.server = KvgateServer(parse_config(churn_data(names, **limits)), config_path=path)
        self.director, self.metrics = self.server.director, self.server.metrics

    async def start(self) -> Churn:
        await self.server.endpoints.set_endpoints("p", [ENDPOINT])
        await self.usage(0.1)
        self.director.flows["p"].start()
        return self

    async def usage(self, usage: float) -> None:
        from extproc.datalayer.endpoints import ScrapeResult
        from extproc.datalayer.metrics import EngineMetrics

        metrics = EngineMetrics(kv_cache_usage=usage, kv_capacity_tokens=1000)
        await self.server.endpoints.apply([ScrapeResult(ENDPOINT, time.monotonic(), metrics)])
        self.director.kick()

    def reload(self, names: list[str]) -> None:
        self.path.write_text(yaml.safe_dump(churn_data(names, **self.limits)))
        assert self.server.reload("test")

    async def admit(self, name: str) -> Admission | Reject:
        body = orjson.dumps({"model": "m", "max_tokens": 100,
                             "messages": [{"role": "user", "content": "x" * 40}]})
        tenant = self.director.authenticate(f"Bearer sk-{name}")
        outcome = await self.director.admit(tenant, parse_body("/v1/chat/completions", body))
        if isinstance(outcome, Admission):
            self.metrics.admitted(name, "m", outcome.request_class, outcome.cost.tokens)
        return outcome

    async def release(self, admission: Admission | Reject) -> None:
        assert isinstance(admission, Admission), admission
        name = admission.tenant.name
        self.metrics.finished(name, "m", admission.cost.tokens, 150, 40, "usage")
        await self.director.release(admission, 150, 40)

    async def traffic(self, names: list[str]) -> None:
        """Per tenant, a request placed at once and one that waits in the fair queue."""
        for name in names:
            await self.release(await self.admit(name))
        await self.usage(0.99)
        queued = [asyncio.create_task(self.admit(name)) for name in names]
        await asyncio.sleep(0.02)
        await self.usage(0.1)
        for task in asyncio.as_completed(queued):
            await self.release(await task)

    def sizes(self) -> dict[str, int]:
        """Every map a tenant's requests leave an entry in."""
        fairness = self.director.flows["p"].fairness
        store = self.director.store
        assert isinstance(store, MemoryStore) and isinstance(fairness, MemoryFairness)
        return {"policies": len(self.director.tenants._policies),
                "weights": len(self.director.schedulers["p"].weights),
                "limiters": len(store._tenants) - len(getattr(store, "_fading", ())),
                "fair_counters": len(fairness.core._counters),
                "metric_names": len(self.metrics.tenants),
                "metric_series": sum(len(t.values) for t in (
                    self.metrics.requests, self.metrics.tokens_reserved,
                    self.metrics.tokens_used, self.metrics.in_flight))}

    def exported(self, tenant: str) -> bool:
        from prometheus_client import generate_latest

        return f'tenant="{tenant}"' in generate_latest(self.metrics.registry).decode()

    async def stop(self) -> None:
        await self.director.flows["p"].stop()


async def test_tenants_renamed_at_every_reload_leave_nothing_behind(tmp_path: Path) -> None:
    """A platform that rotates tenant names (keys added and removed every day, a config
    generator) grew kvgate by every tenant it ever had: policies, the schedulers' weights,
    the limits store, the fair queue's counters and the metrics' series (~3.5 KB and ~370
    bytes of /metrics each; `python -m bench.reload_churn` measures it)."""
    churn = await Churn(tmp_path / "kvgate.yaml", ["r0-0", "r0-1"]).start()
    try:
        await churn.traffic(["r0-0", "r0-1"])
        one_round = churn.sizes()
        assert one_round["fair_counters"] == 2 and one_round["limiters"] == 2
        for n in range(1, 30):
            names = [f"r{n}-0", f"r{n}-1"]
            churn.reload(names)
            await churn.traffic(names)
        assert churn.sizes() == one_round
        assert not churn.exported("r0-0") and churn.exported("r29-0")
    finally:
        await churn.stop()


async def test_a_removed_tenant_is_kept_until_its_admitted_and_queued_requests_end(
        tmp_path: Path) -> None:
    churn = await Churn(tmp_path / "kvgate.yaml", ["acme", "gone"]).start()
    try:
        admitted = await churn.admit("gone")
        await churn.usage(0.99)
        queued = asyncio.create_task(churn.admit("gone"))
        await asyncio.sleep(0.02)
        assert len(churn.director.flows["p"].queue) == 1
        churn.reload(["acme"])
        assert churn.server.forget_retired() == []
        assert churn.director.tenants.retired() == ["gone"]
        await churn.release(admitted)  # under its last limits: one request still queued
        assert churn.server.forget_retired() == [] and churn.exported("gone")
        await churn.usage(0.1)
        await churn.release(await asyncio.wait_for(queued, 2))
        assert churn.server.forget_retired() == ["gone"]
        assert churn.director.tenants.retired() == [] and not churn.exported("gone")
        assert "gone" not in churn.director.schedulers["p"].weights
        assert await churn.director.store.in_flight("gone") == 0
    finally:
        await churn.stop()


async def test_a_request_whose_tenant_was_forgotten_meanwhile_gets_401(tmp_path: Path) -> None:
    """Authenticated before the reload removed its key, its body came after the tenant,
    with nothing else left, was forgotten: refused as its key now is, not a 500."""
    churn = await Churn(tmp_path / "kvgate.yaml", ["acme", "gone"]).start()
    try:
        tenant = churn.director.authenticate("Bearer sk-gone")
        churn.reload(["acme"])  # nothing in flight: forgotten at once
        with pytest.raises(BadRequest) as refused:
            await churn.director.precheck(tenant)
        assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
        with pytest.raises(BadRequest):
            await churn.admit("gone")
        assert "gone" not in churn.director.tenants._policies
    finally:
        await churn.stop()


async def test_a_tenant_removed_and_added_again_keeps_its_rate_limit(tmp_path: Path) -> None:
    """In memory as with Redis: removing a key and adding it back a moment later does not
    refill its buckets (the store keeps a forgotten tenant's limits until they are back to a
    new tenant's state, as Redis's key TTLs do)."""
    churn = await Churn(tmp_path / "kvgate.yaml", ["acme", "gone"],
                        requests_per_second=0.01, request_burst=1).start()
    try:
        await churn.release(await churn.admit("gone"))
        churn.reload(["acme"])
        assert "gone" not in churn.director.tenants._policies  # forgotten (but its limits)
        churn.reload(["acme", "gone"])
        refused = await churn.admit("gone")
        assert isinstance(refused, Reject) and refused.reason == "requests"
    finally:
        await churn.stop()


@pytest.mark.parametrize("waits", ["queued", "shaped"])
async def test_a_request_leaving_its_wait_after_a_reload_gives_back_under_the_new_limits(
        tmp_path: Path, waits: str) -> None:
    """A request waiting in the fair queue (or for its shaper's slot) when a reload added a
    token rate, whose client then left, gave its limits back under the policy read before
    the reload: the limits store took that as a change back, dropped the new token bucket,
    and the next admission started it again full (312 tokens free through Envoy, with
    Redis as in memory)."""
    shaping = {"shaping": {"requests_per_second": 1, "backlog": 5}} if waits == "shaped" else {}
    churn = await Churn(tmp_path / "kvgate.yaml", ["acme"], **shaping).start()
    try:
        if waits == "shaped":
            await churn.release(await churn.admit("acme"))  # the next one waits ~1 s
        else:
            await churn.usage(0.99)  # the pool is full: the next one queues
        left = asyncio.create_task(churn.admit("acme"))
        await asyncio.sleep(0.02)
        assert not left.done()
        churn.limits = {**shaping, "tokens_per_minute": 60, "token_burst": 1000}
        churn.reload(["acme"])
        spent = asyncio.create_task(churn.admit("acme"))  # reserves from the new bucket
        await asyncio.sleep(0.02)
        available = (await churn.director.usage("acme"))["tokens"]["available"]
        assert available < 1000
        left.cancel()  # its client went away
        with pytest.raises(asyncio.CancelledError):
            await left
        assert (await churn.director.usage("acme"))["tokens"]["available"] == available
        spent.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await spent
    finally:
        await churn.stop()


async def test_a_file_changed_while_the_server_starts_is_applied_once_it_serves(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGHUP while kvgate starts is ignored ("the file is read as it starts anyway"),
    but the file was read at the start of a start that can take seconds (discovery, the
    first scrape, a tokenizer): a ConfigMap updated meanwhile, and its SIGHUP, were lost
    with ``reload_poll_s: 0`` — the process ran the old file until the next SIGHUP."""
    import gc
    import signal

    cfg = {**data(), "server": {"grpc_port": 0, "admin_port": None, "report_port": 0,
                                "reload_poll_s": 0}}
    path = tmp_path / "kvgate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    server = KvgateServer(parse_config(cfg), config_path=path)
    scrape_once = server.scraper.scrape_once

    async def updated_while_starting() -> None:
        if not rounds:  # the first round only: the scrape loop's later rounds come here too,
            # and a rewrite there could meet the reload reading the file half written
            path.write_text(yaml.safe_dump({**cfg, "tenants": cfg["tenants"][:1]}))
        rounds.append(None)
        await scrape_once()  # (a SIGHUP sent now is ignored: no handler yet)

    rounds: list[None] = []

    monkeypatch.setattr(server.scraper, "scrape_once", updated_while_starting)
    monkeypatch.setattr(gc, "freeze", lambda: None)
    serving = asyncio.create_task(server.serve_forever())
    try:
        deadline = time.monotonic() + 10
        while [t.name for t in server.config.tenants] != ["acme"]:
            assert time.monotonic() < deadline and not serving.done(), (
                [t.name for t in server.config.tenants])
            await asyncio.sleep(0.05)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(serving, 10)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(sig)
