"""deploy/Dockerfile against the rest of the repository (no Docker engine here: the image is
not built; ``tests/integration/test_image.py`` installs what it copies): the files it copies
exist, it compiles the hot path the way ``make native`` does, and it runs as the manifests
expect (user, config path, ports)."""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from pathlib import Path

from tests.deploy.manifests import DEPLOY, each_folder, kvgate_containers, render, workers
from tests.integration.test_image import context_copies
from tests.paths import REPO

DOCKERFILE = DEPLOY / "Dockerfile"


def instructions() -> list[tuple[str, list[str]]]:
    """(INSTRUCTION, words) per Dockerfile line, continuation lines joined."""
    found = []
    for line in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            found.append((words[0].upper(), words[1:]))
    return found


def last(instruction: str) -> list[str]:
    (*_, words) = [w for i, w in instructions() if i == instruction]
    return words


def exec_form(instruction: str) -> list[str]:
    """The JSON array of the last ``ENTRYPOINT [...]`` / ``CMD [...]``."""
    (*_, line) = [line for line in DOCKERFILE.read_text().splitlines()
                  if line.startswith(f"{instruction} ")]
    return json.loads(line.removeprefix(instruction))


def env() -> dict[str, str]:
    """Every ENV key=value of the final stage (the last FROM onwards)."""
    stages = instructions()
    final = max(i for i, (instruction, _) in enumerate(stages) if instruction == "FROM")
    return {k: v for instruction, words in stages[final:] if instruction == "ENV"
            for k, _, v in (w.partition("=") for w in words)}


def test_every_copied_path_exists() -> None:
    for source in context_copies(DOCKERFILE):
        assert (REPO / source).exists(), f"COPY {source}: not in the repository"


def test_it_compiles_the_hot_path_as_make_native_does() -> None:
    makefile = (REPO / "Makefile").read_text()
    (recipe,) = re.findall(r"^\$\(NATIVE\):.*\n\t(.+)$", makefile, re.MULTILINE)
    module = recipe.split(" -m ", 1)[1].split()[0]  # $(BIN)/python -m kvgate_native
    runs = [" ".join(words) for instruction, words in instructions() if instruction == "RUN"]
    assert any(re.search(rf"/python -m {module}\b", run) for run in runs), (
        f"no RUN of `python -m {module}` (what `make native` runs)")
    # it installs the extra that carries the compiler, as the Makefile does
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(d.startswith("mypy") for d in extras["native"])
    assert "native" in re.search(r"pip install .*'\.\[([\w,]+)\]'", makefile).group(1)
    assert any(".[native]" in run.split() for run in runs)
    # the runtime stage's loader looks where the build stage compiled to
    build_env = {k: v for instruction, words in instructions() if instruction == "ENV"
                 for k, _, v in (w.partition("=") for w in words)}
    assert env()["KVGATE_NATIVE_DIR"] == build_env["KVGATE_NATIVE_DIR"]
    assert "KVGATE_NATIVE" not in env()  # 0 would turn the compiled path off


@each_folder
def test_the_manifests_run_the_image_as_it_is_built(folder: Path) -> None:
    (user,) = last("USER")
    entrypoint, command = exec_form("ENTRYPOINT"), exec_form("CMD")
    exposed = {int(port) for port in last("EXPOSE")}
    for pod, container, _ in kvgate_containers(render(folder)):
        assert entrypoint == ["kvgate"] and "command" not in container
        n = workers(container)
        more = ["--workers", str(n)] if n > 1 else []
        assert container["args"] == [*command, *more], "the image's own CMD, spelled out"
        run_as = {**pod.spec.get("securityContext", {}), **container.get("securityContext", {})}
        assert run_as.get("runAsUser") == int(user)
        assert run_as.get("runAsNonRoot") is True
        for port in container.get("ports", []):
            # with --workers the admin and report ports are ranges the config places (the
            # example moves report_port past them), not the image's defaults
            if n == 1 or port.get("name") == "grpc":
                assert port["containerPort"] in exposed, port


def test_the_image_and_the_tests_install_the_pinned_versions() -> None:
    """An image built later must run what the tests ran: the Dockerfile and ``make``
    install with deploy/constraints.txt, which pins every dependency kvgate installs (with
    its build stage's mypyc), and this venv holds exactly those versions."""
    from deploy.constraints import closure

    pinned = {}
    for line in (DEPLOY / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pinned[name] = version
    assert closure() == pinned, "regenerate: python deploy/constraints.py > deploy/constraints.txt"
    runs = " ".join(" ".join(words) for instruction, words in instructions()
                    if instruction == "RUN")
    assert "-c constraints.txt" in runs and "deploy/constraints.txt" in context_copies(DOCKERFILE)
    assert "-c deploy/constraints.txt" in (REPO / "Makefile").read_text()
