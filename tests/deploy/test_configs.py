"""The configs inside deploy/'s ConfigMaps: kvgate's passes ``kvgate check`` and agrees with
the pod that runs it (ports, Services, Redis, replicas, probes); Envoy's bootstrap is exactly
what ``kvgate render-envoy`` makes of that config, committed and rendered alike, and passes
the real ``envoy --mode validate``."""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from extproc import cli
from extproc.config import Config, for_worker, load_config, parse_config
from extproc.envoy_config import render_yaml
from extproc.envoy_proc import validate
from tests.deploy.manifests import (
    DEPLOY,
    FOLDERS,
    Object,
    Pod,
    container_ports,
    each_folder,
    envoy_containers,
    kvgate_containers,
    named,
    option,
    pods,
    render,
    selects,
    workers,
)

# Every committed bootstrap, beside the kvgate config it is rendered from.
BOOTSTRAPS = sorted(DEPLOY.rglob("envoy.yaml"))
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def config_of(pod: Pod, container: Object, path: str, tmp_path: Path) -> tuple[Config, Path]:
    """The kvgate config a container runs, read from its ConfigMap as kvgate reads it."""
    file = tmp_path / f"{pod.owner['metadata']['name']}-{container['name']}.yaml"
    file.write_text(pod.mounted_file(container, path))
    return load_config(file), file


def test_there_are_bootstraps_and_configs() -> None:
    assert BOOTSTRAPS, "no envoy.yaml under deploy/"
    assert any(any(kvgate_containers(render(f))) for f in FOLDERS)


@pytest.mark.parametrize("bootstrap", BOOTSTRAPS, ids=[str(b.relative_to(DEPLOY))
                                                       for b in BOOTSTRAPS])
def test_committed_bootstrap_is_a_fresh_render(bootstrap: Path) -> None:
    """``kvgate render-envoy config/kvgate.yaml -o envoy.yaml`` (or ``kvgate.yaml`` beside
    it, in an overlay that deploys its own; deploy/README.md) run again gives the committed
    file byte for byte."""
    source = next(f for f in (bootstrap.parent / "config" / "kvgate.yaml",
                              bootstrap.parent / "kvgate.yaml") if f.exists())
    assert bootstrap.read_text() == render_yaml(load_config(source)), (
        f"{bootstrap} is stale: kvgate render-envoy {source} -o {bootstrap}")


# What of a kvgate config ``kvgate render-envoy`` writes into Envoy's bootstrap (README,
# *Envoy*): each pool is a cluster and a route, and the classification header is forwarded by
# name. A change to any of them needs a new render; tenants, tiers and redis: do not.
RENDERED = ("server:", "envoy:", "pools", "classification.header")


def _edited(edit: Callable[[dict[str, Any]], object]) -> str:
    """The render of base/gateway's config after ``edit`` changed it."""
    data = yaml.safe_load((DEPLOY / "base" / "gateway" / "config" / "kvgate.yaml").read_text())
    edit(data := copy.deepcopy(data))
    return render_yaml(parse_config(data))


def test_the_bootstrap_holds_the_pools_and_the_class_header() -> None:
    """Renaming a pool or moving its engines changes the bootstrap: Envoy running the old one
    answers that pool's every request 503 (no route, or no engine, for it)."""
    base = _edited(lambda d: None)
    assert _edited(lambda d: d["pools"][0].update(name="qwen")) != base
    assert _edited(lambda d: d["pools"][0]["dns"].update(hostname="vllm.ns.svc.cluster.local")
                   ) != base
    assert _edited(lambda d: d.update(classification={"header": "x-class"})) != base
    # what a render does not read
    assert _edited(lambda d: d["tenants"].pop()) == base
    assert _edited(lambda d: d["tiers"]["free"]["limits"].update(max_concurrency=9)) == base
    assert _edited(lambda d: d["redis"].update(url="redis://elsewhere:6379/0")) == base


def rerender_instructions() -> list[tuple[str, str]]:
    """(where, text) of every passage that says when to render Envoy's bootstrap again: the
    head comment of each config a committed bootstrap is rendered from, and each paragraph or
    list item of deploy/README.md that names render-envoy (or a re-render) and a section."""
    found = []
    for config in sorted(DEPLOY.rglob("kvgate.yaml")):
        lines = config.read_text().splitlines()
        head = "\n".join(itertools.takewhile(lambda line: line.startswith("#"), lines))
        if "render" in head:
            found.append((str(config.relative_to(DEPLOY)), " ".join(head.split())))
    readme = (DEPLOY / "README.md").read_text()
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:- |\d+\. ))", readme):
        text = " ".join(block.split())
        if re.search(r"render-envoy|re-render", text) and "`server:`" in text:
            found.append(("deploy/README.md", text))
    return found


def test_rerender_instructions_name_every_section_the_bootstrap_holds() -> None:
    """deploy/ said the bootstrap depended only on server: and envoy:, so an operator who
    added or renamed a pool in the overlay's config deployed the base's bootstrap, and
    Envoy answered that pool's every request 503 no healthy upstream."""
    passages = rerender_instructions()
    assert len(passages) >= 4
    for where, text in passages:
        missing = [s for s in RENDERED if s.rstrip(":") not in text]
        assert not missing, f"{where}: says when to re-render but not for {missing}: {text}"


@pytest.mark.parametrize("bootstrap", BOOTSTRAPS, ids=[str(b.relative_to(DEPLOY))
                                                       for b in BOOTSTRAPS])
def test_committed_bootstrap_is_deployed(bootstrap: Path) -> None:
    """A bootstrap no kustomization generates a ConfigMap from is kept fresh by the test
    above and deployed nowhere: the one to edit looks like another."""
    kustomization = yaml.safe_load((bootstrap.parent / "kustomization.yaml").read_text())
    generated = [file for generator in kustomization.get("configMapGenerator", [])
                 for file in generator.get("files", [])]
    assert bootstrap.name in generated, f"{bootstrap}: no configMapGenerator names it"


@each_folder
def test_kvgate_configs_pass_kvgate_check(folder: Path, tmp_path: Path) -> None:
    for pod, container, path in kvgate_containers(render(folder)):
        file = tmp_path / "kvgate.yaml"
        file.write_text(pod.mounted_file(container, path))
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            # the paths it names (TLS files, tokenizers) exist in the pod, not here
            status = cli.main(["check", "--skip-files", str(file)])
        assert status == 0, f"{folder}: {pod.owner['metadata']['name']}: {err.getvalue()}"


@each_folder
def test_each_envoy_runs_the_render_of_its_kvgate_config(folder: Path, tmp_path: Path) -> None:
    objects = render(folder)
    configs = [config_of(*found, tmp_path)[0] for found in kvgate_containers(objects)]
    for pod, container, path in envoy_containers(objects):
        bootstrap = pod.mounted_file(container, path)
        mine = [c for c in configs if render_yaml(c) == bootstrap]
        assert mine, (f"{folder}: {pod.owner['metadata']['name']}'s Envoy bootstrap is not "
                      "the render of a kvgate config beside it")
        assert mine[0].envoy.listen_port in container_ports(container).values()


@each_folder
def test_each_envoys_heap_cap_fits_its_memory_limit(folder: Path, tmp_path: Path) -> None:
    """Past 95% of ``envoy.max_heap_mb`` Envoy sheds load; a cap near or above its container's
    memory limit would let the kernel kill it first."""
    objects = render(folder)
    configs = [config_of(*found, tmp_path)[0] for found in kvgate_containers(objects)]
    for pod, container, path in envoy_containers(objects):
        bootstrap = pod.mounted_file(container, path)
        (config,) = [c for c in configs if render_yaml(c) == bootstrap]
        limit = mebibytes(container["resources"]["limits"]["memory"])
        assert config.envoy.max_heap_mb <= 0.8 * limit, (
            f"{folder}: {pod.owner['metadata']['name']}'s Envoy may use {limit} MiB; set "
            f"envoy.max_heap_mb to about 75% of it, not {config.envoy.max_heap_mb}")


def mebibytes(quantity: str) -> float:
    units = {"Ki": 2**-10, "Mi": 1, "Gi": 2**10, "K": 1e3 / 2**20, "M": 1e6 / 2**20,
             "G": 1e9 / 2**20}
    for suffix in sorted(units, key=len, reverse=True):
        if quantity.endswith(suffix):
            return float(quantity.removesuffix(suffix)) * units[suffix]
    return float(quantity) / 2**20


@pytest.mark.e2e
@each_folder
def test_envoy_bootstraps_pass_envoy_validate(folder: Path) -> None:
    for pod, container, path in envoy_containers(render(folder)):
        validate(pod.mounted_file(container, path))


@each_folder
def test_kvgate_config_agrees_with_its_pod(folder: Path, tmp_path: Path) -> None:
    objects = render(folder)
    services = named(objects, "Service")
    for pod, container, path in kvgate_containers(objects):
        config, _ = config_of(pod, container, path, tmp_path)
        server, where = config.server, f"{folder.name}: {pod.owner['metadata']['name']}"
        ports, n = pod.ports(), workers(container)
        # what must be reachable from outside the pod is a declared container port: every
        # worker's admin and report port (admin_port + i, report_port + i), named admin-i
        if server.host not in LOOPBACK:
            assert ports.get("grpc") == server.grpc_port, where
        if server.admin_host not in LOOPBACK:
            admin = [p["containerPort"] for p in container["ports"] if "admin" in p["name"]]
            assert admin == [admin_port(config, i) for i in range(n)], where
        if server.report_host not in (None, *LOOPBACK):
            for i in range(n):
                assert ports.get(worker_port_name("report", i)) == report_port(config, i), where
        mine = [port for i in range(n) for port in (admin_port(config, i),
                                                    report_port(config, i)) if port]
        assert len(set(mine)) == len(mine) and server.grpc_port not in mine, (
            f"{where}: --workers {n}: admin_port + i and report_port + i meet")
        probes = {name: container[name]["httpGet"] for name in ("livenessProbe",
                                                                 "readinessProbe")}
        assert probes["livenessProbe"]["path"] == "/healthz", where
        assert probes["readinessProbe"]["path"] == "/readyz", where
        for probe in probes.values():
            assert container_ports(container)[probe["port"]] == server.admin_port, where
        # the replicas sharing Redis are the ones that run this config
        if config.redis is not None:
            assert config.redis.replicas == pod.replicas * n, (
                f"{where}: redis.replicas {config.redis.replicas}, {pod.replicas} replicas "
                f"× {n} workers")
            url = urlsplit(config.redis.url)
            assert_service(services, url.hostname, url.port or 6379, where)
        # Envoy reaches kvgate through a headless Service of exactly these pods
        if config.envoy.ext_proc_host not in LOOPBACK and any(envoy_containers(objects)):
            service = assert_service(services, config.envoy.ext_proc_host, server.grpc_port,
                                     where)
            assert service["spec"].get("clusterIP") == "None", "headless: one address a pod"
            assert service["spec"]["selector"].items() <= pod.labels.items(), where
        for pool in config.pools:
            if pool.dns is not None and pool.dns.hostname in services:
                assert_service(services, pool.dns.hostname, pool.dns.port, where)


def admin_port(config: Config, worker: int) -> int | None:
    return for_worker(config, worker).server.admin_port


def report_port(config: Config, worker: int) -> int:
    return for_worker(config, worker).server.report_port


def worker_port_name(name: str, worker: int) -> str:
    """The name of worker i's port: ``admin`` for worker 0, ``admin-1``, ``admin-2``, ..."""
    return f"{name}-{worker}" if worker else name


@each_folder
def test_every_workers_metrics_are_scraped(folder: Path, tmp_path: Path) -> None:
    """``kvgate serve --workers N``: worker i serves its own /metrics on admin_port + i,
    counting only the requests it admitted. A ServiceMonitor that scraped the port named
    ``admin`` alone collected worker 0's, and N-1 workers' requests, tokens and errors were
    missing from every sum. Every worker's admin port must be behind a Service the
    ServiceMonitor selects, under a port name one of its endpoints scrapes."""
    (monitor,) = named(render(DEPLOY / "monitoring"), "ServiceMonitor").values()
    selector = monitor["spec"]["selector"]["matchLabels"]
    endpoints = {e["port"] for e in monitor["spec"]["endpoints"]}
    objects = render(folder)
    for pod, container, path in kvgate_containers(objects):
        config, _ = config_of(pod, container, path, tmp_path)
        if config.server.admin_host in LOOPBACK or config.server.admin_port is None:
            continue  # nothing to scrape from outside the pod
        scraped = {
            pod.ports().get(port.get("targetPort", port["port"]))
            for service in named(objects, "Service").values()
            if selects(selector, service["metadata"].get("labels", {}))
            and selects(service["spec"]["selector"], pod.labels)
            for port in service["spec"]["ports"] if port.get("name") in endpoints
        }
        wanted = {admin_port(config, i) for i in range(workers(container))}
        assert wanted <= scraped, (
            f"{folder.name}: {pod.owner['metadata']['name']}: --workers "
            f"{workers(container)}: admin ports {sorted(wanted - scraped)} never scraped")


def test_the_monitor_scrapes_up_to_eight_workers_alike() -> None:
    """One ServiceMonitor endpoint per worker's port name (``admin``, ``admin-1``, ...,
    ``admin-7``): a port a Service does not have gives no target, so pods with fewer workers
    need no other monitor. The endpoints differ in nothing but the port."""
    (monitor,) = named(render(DEPLOY / "monitoring"), "ServiceMonitor").values()
    endpoints = monitor["spec"]["endpoints"]
    assert [e["port"] for e in endpoints] == [worker_port_name("admin", i) for i in range(8)]
    assert all({**e, "port": None} == {**endpoints[0], "port": None} for e in endpoints)


def test_an_example_runs_more_than_one_worker() -> None:
    """The tests above check the worker ports of a rendered pod: one must have several."""
    assert any(workers(container) > 1 for folder in FOLDERS
               for _, container, _ in kvgate_containers(render(folder)))


def assert_service(services: dict[str, Object], host: str | None, port: int,
                   where: str) -> Object:
    """The Service a config names by its short name (same namespace), with that port."""
    assert host in services, f"{where}: no Service {host!r}"
    service = services[host]
    assert port in [p["port"] for p in service["spec"]["ports"]], f"{where}: {host}:{port}"
    return service


@each_folder
def test_pools_name_the_engines_that_serve_them(folder: Path, tmp_path: Path) -> None:
    """Where the engines are rendered too: each pool reaches pods whose vLLM serves its
    models on the pool's port, with priority scheduling when the pool says so."""
    objects = render(folder)
    services = named(objects, "Service")
    for pod, container, path in kvgate_containers(objects):
        config, _ = config_of(pod, container, path, tmp_path)
        for pool in config.pools:
            if pool.dns is not None and pool.dns.hostname in services:
                service = services[pool.dns.hostname]
                engines = [p for p in pods(objects)
                           if service["spec"]["selector"].items() <= p.labels.items()]
                (port,) = [p for p in service["spec"]["ports"] if p["port"] == pool.dns.port]
                target = port.get("targetPort", port["port"])
                ports = {engine.ports()[target] for engine in engines}
            elif pool.endpoints and all(e.rpartition(":")[0] in LOOPBACK for e in pool.endpoints):
                engines, ports = [pod], {int(e.rpartition(":")[2]) for e in pool.endpoints}
            else:
                continue  # engines outside this kustomization
            assert engines, f"{folder.name}: pool {pool.name} reaches no pod here"
            for engine in engines:
                (vllm,) = [c for c in engine.containers() if c["image"].startswith("vllm/")]
                served = (option(vllm, "--served-model-name") or option(vllm, "--model") or "")
                for model in pool.models:
                    assert model.name in served.split(","), (pool.name, model.name, served)
                assert {int(option(vllm, "--port") or 8000)} == ports, pool.name
                if pool.priority_scheduling:
                    assert option(vllm, "--scheduling-policy") == "priority", pool.name


@each_folder
def test_inference_pools_pick_with_kvgate(folder: Path, tmp_path: Path) -> None:
    """An InferencePool selects the engines kvgate routes to, on their port, and its
    endpoint picker is a Service of kvgate's pods on kvgate's gRPC port."""
    objects = render(folder)
    services = named(objects, "Service")
    for pool in named(objects, "InferencePool").values():
        spec = pool["spec"]
        engines = [p for p in pods(objects)
                   if spec["selector"]["matchLabels"].items() <= p.labels.items()]
        assert engines, "the pool selects no pod"
        (target,) = spec["targetPorts"]
        assert all(target["number"] in e.ports().values() for e in engines)
        picker = spec["endpointPickerRef"]
        service = services[picker["name"]]
        (port,) = [p for p in service["spec"]["ports"] if p["port"] == picker["port"]["number"]]
        pickers = [(p, c, path) for p, c, path in kvgate_containers(objects)
                   if service["spec"]["selector"].items() <= p.labels.items()]
        assert pickers, "the picker Service selects no kvgate"
        for pod, container, path in pickers:
            config, _ = config_of(pod, container, path, tmp_path)
            assert pod.ports()[port.get("targetPort", port["port"])] == config.server.grpc_port
            assert config.server.tls is not None, "Inference Extension gateways dial TLS"


# Time a pod needs past kvgate's drain and grace: to release leases, settle tokens, close
# the store (Redis round trips) and exit before the kubelet's SIGKILL.
SHUTDOWN_MARGIN_S = 5


@each_folder
def test_pods_outlast_kvgates_drain_and_grace(folder: Path, tmp_path: Path) -> None:
    """A kvgate without a drain delay refuses new streams the instant SIGTERM arrives, before
    Envoy or the Service have stopped sending to it (503s on a rolling update); a pod whose
    ``terminationGracePeriodSeconds`` (default 30) ends inside the drain and the grace is
    killed with streams open and leases held."""
    for pod, container, path in kvgate_containers(render(folder)):
        server = config_of(pod, container, path, tmp_path)[0].server
        where = f"{folder.name}: {pod.owner['metadata']['name']}"
        assert server.drain_delay_s > 0, f"{where}: set server.drain_delay_s"
        period = pod.spec.get("terminationGracePeriodSeconds", 30)
        needed = server.drain_delay_s + server.shutdown_grace_s + SHUTDOWN_MARGIN_S
        assert period >= needed, (
            f"{where}: terminationGracePeriodSeconds {period} < drain_delay_s "
            f"{server.drain_delay_s} + shutdown_grace_s {server.shutdown_grace_s} + "
            f"{SHUTDOWN_MARGIN_S}")
