"""deploy/'s kustomizations, rendered by the real ``kubectl kustomize``, and what the tests
read out of them: pods, their containers, ports and mounted files."""

from __future__ import annotations

import functools
import posixpath
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import need_binary
from tests.paths import REPO

DEPLOY = REPO / "deploy"
KUBECTL = shutil.which("kubectl")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")

Object = dict[str, Any]


def kustomizations() -> list[Path]:
    """Every folder under deploy/ that kustomize can build, bases and overlays alike."""
    return sorted(p.parent for p in DEPLOY.rglob("kustomization.yaml"))


FOLDERS = kustomizations()
# @each_folder: a test run once per kustomization, named by its folder under deploy/
each_folder = pytest.mark.parametrize(
    "folder", FOLDERS, ids=[str(f.relative_to(DEPLOY)) for f in FOLDERS])


def need_kubectl() -> str:
    return need_binary(KUBECTL, "kubectl", "kubernetes-client")


@functools.cache
def kustomize(folder: Path) -> subprocess.CompletedProcess[str]:
    """``kubectl kustomize folder``, run once per folder: its YAML and its warnings."""
    done = subprocess.run([need_kubectl(), "kustomize", str(folder)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, (f"kubectl kustomize {folder} (needs kubectl 1.21 or later, "
                                  f"deploy/README.md):\n{done.stderr}")
    return done


def render(folder: Path) -> tuple[Object, ...]:
    """The objects ``kubectl kustomize folder`` would apply (kustomize v4 and later)."""
    return tuple(doc for doc in yaml.safe_load_all(kustomize(folder).stdout) if doc)


def named(objects: tuple[Object, ...], kind: str) -> dict[str, Object]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def ident(obj: Object) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


@dataclass(frozen=True)
class Pod:
    """A workload's pod template, with the objects rendered beside it."""

    owner: Object
    objects: tuple[Object, ...]

    @property
    def spec(self) -> Object:
        return self.owner["spec"]["template"]["spec"]

    @property
    def labels(self) -> dict[str, str]:
        return self.owner["spec"]["template"]["metadata"].get("labels", {})

    @property
    def replicas(self) -> int:
        return self.owner["spec"].get("replicas", 1)

    def containers(self) -> list[Object]:
        return [*self.spec.get("initContainers", []), *self.spec["containers"]]

    def container(self, name: str) -> Object:
        (found,) = [c for c in self.containers() if c["name"] == name]
        return found

    def ports(self) -> dict[str | int, int]:
        """Every container port of the pod, by name and by number."""
        return {k: v for c in self.containers() for k, v in container_ports(c).items()}

    def mounted_file(self, container: Object, path: str) -> str:
        """The text of the ConfigMap key mounted at ``path`` in ``container``."""
        folder, key = posixpath.split(path)
        (mount,) = [m for m in container.get("volumeMounts", []) if m["mountPath"] == folder]
        (volume,) = [v for v in self.spec["volumes"] if v["name"] == mount["name"]]
        config_map = named(self.objects, "ConfigMap")[volume["configMap"]["name"]]
        return config_map["data"][key]


def container_ports(container: Object) -> dict[str | int, int]:
    """A container's ports, by name and by number (what probes and Services may name)."""
    found: dict[str | int, int] = {}
    for port in container.get("ports", []):
        found[port["containerPort"]] = port["containerPort"]
        if "name" in port:
            found[port["name"]] = port["containerPort"]
    return found


def pods(objects: tuple[Object, ...]) -> Iterator[Pod]:
    for obj in objects:
        if obj["kind"] in WORKLOADS:
            yield Pod(obj, objects)


def option(container: Object, *flags: str) -> str | None:
    """The value of a command-line option (``--config P``, ``-c P``) in a container's args."""
    words = [*container.get("command", []), *container.get("args", [])]
    for i, word in enumerate(words):
        if word in flags and i + 1 < len(words):
            return words[i + 1]
        for flag in flags:
            if word.startswith(f"{flag}="):
                return word.split("=", 1)[1]
    return None


def workers(container: Object) -> int:
    """How many kvgate processes a ``kvgate serve`` container runs (``--workers N``)."""
    return int(option(container, "--workers") or 1)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


def kvgate_containers(objects: tuple[Object, ...]) -> Iterator[tuple[Pod, Object, str]]:
    """(pod, container, config path) of every ``kvgate serve --config PATH``."""
    for pod in pods(objects):
        for container in pod.containers():
            if "serve" in container.get("args", []) and (path := option(container, "--config")):
                yield pod, container, path


def envoy_containers(objects: tuple[Object, ...]) -> Iterator[tuple[Pod, Object, str]]:
    """(pod, container, bootstrap path) of every Envoy."""
    for pod in pods(objects):
        for container in pod.containers():
            if container["image"].startswith("envoyproxy/envoy") and (
                    path := option(container, "-c", "--config-path")):
                yield pod, container, path

