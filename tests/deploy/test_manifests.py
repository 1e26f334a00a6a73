"""deploy/'s Kubernetes manifests: every kustomization renders with the real ``kubectl
kustomize``, every object parses against the Kubernetes API models, and names, ports,
selectors and references agree across files.

Built-in kinds are read by the ``kubernetes`` client's own deserializer (its generated API
models, with required fields and enums checked) and must come back unchanged when written
out again: a field the API does not have — a typo — is dropped on the way and fails the
comparison. Custom resources (no models in that package) are checked against the fields of
their API listed in ``CRD_FIELDS``, taken from each project's published types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kubernetes import client

from tests.deploy.manifests import (
    DEPLOY,
    FOLDERS,
    Object,
    Pod,
    container_ports,
    each_folder,
    ident,
    kustomize,
    kvgate_containers,
    named,
    option,
    pods,
    render,
    selects,
)

GUARDRAILS = DEPLOY / "guardrails"
# Objects the operator creates by hand (deploy/README.md says how): referenced, not shipped.
EXTERNAL_SECRETS = {"kvgate-epp-tls"}

# The fields each custom resource kind may use, as nested dicts; "*" = any key (a map);
# a list value = a list of such dicts; None = a scalar or a free-form value.
_LABELS = {"matchLabels": {"*": None}}
_RESOURCES = {"*": None}
CRD_FIELDS: dict[tuple[str, str], dict[str, Any]] = {
    # kubernetes-sigs/gateway-api-inference-extension, api/v1/inferencepool_types.go (v1.0.0)
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "selector": _LABELS,
        "targetPorts": [{"number": None}],
        "endpointPickerRef": {"group": None, "kind": None, "name": None,
                              "port": {"number": None}, "failureMode": None},
    },
    # gateway.networking.k8s.io/v1 (Gateway API standard channel)
    ("gateway.networking.k8s.io/v1", "Gateway"): {
        "gatewayClassName": None,
        "listeners": [{"name": None, "hostname": None, "port": None, "protocol": None,
                       "tls": None, "allowedRoutes": None}],
        "addresses": None, "infrastructure": None,
    },
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "parentRefs": [{"group": None, "kind": None, "namespace": None, "name": None,
                        "sectionName": None, "port": None}],
        "hostnames": None,
        "rules": [{
            "name": None,
            "matches": [{"path": {"type": None, "value": None}, "headers": None,
                         "queryParams": None, "method": None}],
            "filters": None, "timeouts": {"request": None, "backendRequest": None},
            "backendRefs": [{"group": None, "kind": None, "name": None, "namespace": None,
                             "port": None, "weight": None, "filters": None}],
        }],
    },
    # prometheus-operator, monitoring.coreos.com/v1
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "selector": _LABELS, "namespaceSelector": {"any": None, "matchNames": None},
        "jobLabel": None,
        "endpoints": [{"port": None, "targetPort": None, "path": None, "scheme": None,
                       "interval": None, "scrapeTimeout": None, "honorLabels": None,
                       "relabelings": None, "metricRelabelings": None, "tlsConfig": None}],
    },
    ("monitoring.coreos.com/v1", "PrometheusRule"): {
        "groups": [{"name": None, "labels": {"*": None}, "interval": None, "query_offset": None,
                    "limit": None, "partial_response_strategy": None,
                    "rules": [{"record": None, "alert": None, "expr": None, "for": None,
                               "keep_firing_for": None, "labels": {"*": None},
                               "annotations": {"*": None}}]}],
    },
    # volcano-sh, scheduling.volcano.sh/v1beta1
    ("scheduling.volcano.sh/v1beta1", "Queue"): {
        "weight": None, "reclaimable": None, "capability": _RESOURCES,
        "deserved": _RESOURCES, "guarantee": {"resource": _RESOURCES}, "parent": None,
        "priority": None,
    },
}


def test_every_folder_with_manifests_is_a_kustomization() -> None:
    """A manifest folder without a kustomization.yaml would be skipped by every test here."""
    for manifest in DEPLOY.rglob("*.yaml"):
        folder = manifest.parent
        if folder not in FOLDERS:
            assert (folder.parent / "kustomization.yaml").exists(), manifest


@each_folder
def test_it_renders(folder: Path) -> None:
    objects = render(folder)
    assert objects, f"{folder} renders nothing"
    names = [f"{o.get('metadata', {}).get('namespace', '')}/{ident(o)}" for o in objects]
    assert len(names) == len(set(names)), "two objects of one kind share a name"


@each_folder
def test_it_renders_without_warnings(folder: Path) -> None:
    """kustomize v5 warns on the deprecated ``bases:`` and ``patchesStrategicMerge:`` (and
    ``kustomize edit fix`` would rewrite them): an operator should see no warning."""
    assert not kustomize(folder).stderr.strip(), kustomize(folder).stderr


@each_folder
def test_every_object_parses_against_the_api(folder: Path) -> None:
    api = client.ApiClient()
    for obj in render(folder):
        crd = CRD_FIELDS.get((obj["apiVersion"], obj["kind"]))
        if crd is not None:
            assert set(obj) <= {"apiVersion", "kind", "metadata", "spec"}, ident(obj)
            assert obj["metadata"]["name"], ident(obj)
            check_fields(obj["spec"], crd, f"{ident(obj)}.spec")
            continue
        model = model_name(obj)
        assert hasattr(client.models, model), f"{ident(obj)}: no API model {model}"
        parsed = api.deserialize(json.dumps(obj), model, "application/json")
        back = api.sanitize_for_serialization(parsed)
        assert back == obj, (f"{ident(obj)}: {difference(obj, back)} is not what the {model} "
                             "API has (an unknown field, or a value of the wrong type)")


def model_name(obj: Object) -> str:
    """``apps/v1`` ``Deployment`` → ``V1Deployment``, the client's class for it."""
    version = obj["apiVersion"].rpartition("/")[2]
    return version[0].upper() + version[1:] + obj["kind"]


def difference(ours: Any, back: Any, where: str = "") -> str:
    """The path of the first value that did not survive the API model's round trip."""
    if isinstance(ours, dict) and isinstance(back, dict):
        for key in ours:
            if key not in back or ours[key] != back[key]:
                return difference(ours[key], back.get(key), f"{where}.{key}")
    if isinstance(ours, list) and isinstance(back, list) and len(ours) == len(back):
        for i, (item, returned) in enumerate(zip(ours, back, strict=True)):
            if item != returned:
                return difference(item, returned, f"{where}[{i}]")
    return where.lstrip(".") or "the object"


def check_fields(value: Any, allowed: Any, where: str) -> None:
    if allowed is None:
        return
    if isinstance(allowed, list):
        assert isinstance(value, list), f"{where}: a list expected"
        for i, item in enumerate(value):
            check_fields(item, allowed[0], f"{where}[{i}]")
        return
    assert isinstance(value, dict), f"{where}: a mapping expected"
    for key, item in value.items():
        assert key in allowed or "*" in allowed, f"{where}.{key}: no such field"
        check_fields(item, allowed.get(key, allowed.get("*")), f"{where}.{key}")


# -- names, ports and references agree ----------------------------------------------------


@each_folder
def test_what_an_operator_applies_pulls_a_pushed_kvgate_image(folder: Path) -> None:
    """A folder whose kvgate pods land in a namespace is one to ``kubectl apply -k``: its
    kvgate image must be set (``images:``) to a registry's, like the overlays'. The bare
    ``kvgate:0.1.0`` of the bases is pulled from Docker Hub's library, which has no such
    image: deploy/gateway-api shipped without ``images:``, and its pods never started."""
    for pod, container, _ in kvgate_containers(render(folder)):
        if pod.owner["metadata"].get("namespace"):
            assert "/" in container["image"], (
                f"{folder.name}: {ident(pod.owner)} runs {container['image']}: set images:")


@each_folder
def test_services_select_pods_and_target_their_ports(folder: Path) -> None:
    objects = render(folder)
    workloads = list(pods(objects))
    for service in named(objects, "Service").values():
        matched = [p for p in workloads if selects(service["spec"]["selector"], p.labels)]
        assert matched, f"Service {service['metadata']['name']} selects no pod here"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            for pod in matched:
                assert target in pod.ports(), (
                    f"Service {service['metadata']['name']} port {port['name']}: "
                    f"{pod.owner['metadata']['name']} has no container port {target!r}")


@each_folder
def test_disruption_budgets_select_a_workload(folder: Path) -> None:
    objects = render(folder)
    for budget in named(objects, "PodDisruptionBudget").values():
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(selects(selector, p.labels) for p in pods(objects)), ident(budget)


@each_folder
def test_network_policies_open_ports_their_pods_have(folder: Path) -> None:
    objects = render(folder)
    for policy in named(objects, "NetworkPolicy").values():
        selector = policy["spec"]["podSelector"]["matchLabels"]
        matched = [p for p in pods(objects) if selects(selector, p.labels)]
        assert matched, f"{ident(policy)} selects no pod here"
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert all(port["port"] in p.ports() for p in matched), (ident(policy), port)
            # a peer is a pod rendered beside the policy (base/redis alone has none: its
            # clients are the kvgate pods of the modes that include it)
            others = [p for p in pods(objects) if p not in matched]
            for peer in rule.get("from", []):
                if "podSelector" in peer and others:
                    assert any(selects(peer["podSelector"]["matchLabels"], p.labels)
                               for p in others), (ident(policy), peer)


@each_folder
def test_pods_reference_what_exists(folder: Path) -> None:
    """ConfigMaps, Secrets, volumes, probe ports and PriorityClasses a pod names exist."""
    objects = render(folder)
    config_maps, secrets = named(objects, "ConfigMap"), named(objects, "Secret")
    priority_classes = named(render(GUARDRAILS), "PriorityClass")
    for pod in pods(objects):
        owner = pod.owner["metadata"]["name"]
        volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
        claims = {c["metadata"]["name"] for c in pod.owner["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, (owner, volume)
            if "secret" in volume:
                secret = volume["secret"]["secretName"]
                assert secret in secrets or secret in EXTERNAL_SECRETS, (owner, volume)
        if "priorityClassName" in pod.spec:
            assert pod.spec["priorityClassName"] in priority_classes, owner
        for container in pod.containers():
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes.keys() | claims, (owner, container["name"], mount)
            for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
                probe = container.get(probe_name, {})
                for handler in ("httpGet", "tcpSocket", "grpc"):
                    if handler in probe:
                        port = probe[handler]["port"]
                        assert port in container_ports(container), (
                            f"{owner}/{container['name']} {probe_name}: no port {port!r}")


@each_folder
def test_kvgates_admin_port_is_closed_to_outside_the_cluster(folder: Path) -> None:
    """The admin port's pages are unauthenticated (tenants' names and usage, the queues):
    a kvgate that listens on more than loopback has a NetworkPolicy over its pod, and every
    rule opening the port names in-cluster peers (pods, namespaces), not every address."""
    objects = render(folder)
    policies = named(objects, "NetworkPolicy").values()
    for pod, container, _ in kvgate_containers(objects):
        where = f"{folder.name}: {ident(pod.owner)}"
        admin = {(p.get("name"), p["containerPort"]) for p in container.get("ports", [])
                 if "admin" in p.get("name", "")}
        if not admin:
            continue  # a loopback admin port (test_kvgate_config_agrees_with_its_pod)
        guards = [p for p in policies
                  if selects(p["spec"]["podSelector"]["matchLabels"], pod.labels)
                  and "Ingress" in p["spec"]["policyTypes"]]
        assert guards, f"{where}: no NetworkPolicy covers its admin port"
        for policy in guards:
            for rule in policy["spec"].get("ingress", []):
                ports = {port["port"] for port in rule.get("ports", [])}
                if rule.get("ports") and not ports & {n for pair in admin for n in pair}:
                    continue
                assert rule.get("from"), f"{where}: {ident(policy)} opens it to every address"
                for peer in rule["from"]:
                    assert "ipBlock" not in peer, f"{where}: {ident(policy)}: {peer}"


def redis_pods(objects: tuple[Object, ...]) -> list[Pod]:
    return [p for p in pods(objects) if any(c["image"].startswith("redis")
                                            for c in p.containers())]


def admitted(policy: Object, pod: Pod) -> bool:
    """A pod of the policy's namespace its ingress rules let in (by pod label only)."""
    return any(selects(peer["podSelector"]["matchLabels"], pod.labels)
               for rule in policy["spec"]["ingress"] for peer in rule.get("from", [])
               if set(peer) == {"podSelector"})


@each_folder
def test_only_kvgate_reaches_redis(folder: Path) -> None:
    """Redis has no password here: a NetworkPolicy selects its pods and lets in the pods
    that run kvgate and no other — not Envoy, not the engines — nor any namespace, address
    or everyone (a rule without ``from``)."""
    objects = render(folder)
    for redis in redis_pods(objects):
        guards = [p for p in named(objects, "NetworkPolicy").values()
                  if selects(p["spec"]["podSelector"]["matchLabels"], redis.labels)]
        assert guards, f"{folder.name}: no NetworkPolicy selects {ident(redis.owner)}"
        for policy in guards:
            assert "Ingress" in policy["spec"]["policyTypes"], ident(policy)
            for rule in policy["spec"]["ingress"]:
                assert rule.get("from"), f"{ident(policy)}: a rule open to every pod"
                for peer in rule["from"]:
                    assert set(peer) == {"podSelector"}, f"{ident(policy)}: {peer}"
        clients = {ident(pod.owner) for pod, _, _ in kvgate_containers(objects)}
        for pod in pods(objects):
            if pod.owner is redis.owner:
                continue
            let_in = any(admitted(policy, pod) for policy in guards)
            assert let_in == (ident(pod.owner) in clients), (
                f"{folder.name}: {ident(pod.owner)} "
                f"{'reaches Redis without kvgate' if let_in else 'runs kvgate, cut off Redis'}")


@each_folder
def test_redis_refuses_writes_before_its_memory_limit(folder: Path) -> None:
    """``--maxmemory`` under the container's limit, with ``noeviction``: a full Redis answers
    errors (kvgate's failure policy decides) instead of the kernel killing it, and never
    evicts a tenant's quota."""
    for pod in redis_pods(render(folder)):
        (redis,) = [c for c in pod.containers() if c["image"].startswith("redis")]
        assert option(redis, "--maxmemory-policy") == "noeviction", ident(pod.owner)
        cap = option(redis, "--maxmemory")
        assert cap is not None, f"{ident(pod.owner)}: no --maxmemory"
        limit = redis["resources"]["limits"]["memory"]
        assert redis_bytes(cap) <= 0.8 * kubernetes_bytes(limit), (ident(pod.owner), cap, limit)


def redis_bytes(size: str) -> float:
    """Redis's memory units: 1k = 1000 bytes, 1kb = 1024 (and m/mb, g/gb)."""
    units = {"kb": 2**10, "mb": 2**20, "gb": 2**30, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1}
    size = size.lower()
    for suffix in sorted(units, key=len, reverse=True):
        if size.endswith(suffix):
            return float(size.removesuffix(suffix)) * units[suffix]
    return float(size)


def kubernetes_bytes(quantity: str) -> float:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "K": 1e3, "M": 1e6, "G": 1e9}
    for suffix in sorted(units, key=len, reverse=True):
        if quantity.endswith(suffix):
            return float(quantity.removesuffix(suffix)) * units[suffix]
    return float(quantity)
