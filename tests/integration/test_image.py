"""deploy/Dockerfile: the distribution built from exactly what the image copies starts.

No Docker engine here: the test reads the Dockerfile's build-context ``COPY`` lines, copies
those paths into a scratch folder, installs from there the way the image does (``pip install
.``, without dependencies: the venv has them) and runs the installed ``kvgate --help``. The
interpreter runs with ``-S`` and the venv's site-packages as a plain path entry, so that the
editable install of this checkout (a ``.pth`` hook) cannot supply a module the image lacks.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from tests.paths import REPO

DOCKERFILE = REPO / "deploy" / "Dockerfile"


def context_copies(dockerfile: Path) -> list[str]:
    """The build-context paths of every ``COPY`` (not ``COPY --from=stage``)."""
    sources = []
    for line in dockerfile.read_text().replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words or words[0].upper() != "COPY":
            continue
        args = words[1:]
        if any(a.startswith("--from") for a in args):
            continue
        sources += [a for a in args[:-1] if not a.startswith("--")]
    return sources


def test_the_image_contents_install_and_start(tmp_path: Path) -> None:
    context, site = tmp_path / "context", tmp_path / "site"
    for source in context_copies(DOCKERFILE):
        origin, target = REPO / source, context / source
        if origin.is_dir():
            shutil.copytree(origin, target, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, target)
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
           "--no-build-isolation", "--target", str(site), str(context)]
    installed = subprocess.run(pip, capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr

    started = run_from(site, str(site / "bin" / "kvgate"), "--help", cwd=tmp_path)
    assert started.returncode == 0, started.stderr
    assert "serve" in started.stdout
    assert not (site / "bench").exists()  # benchmarks are not part of the distribution
    # the image compiles the hot path from the source tree: the installed loader accepts
    # that build only if both trees hash the same
    hashes = "import json, kvgate_native; print(json.dumps(kvgate_native.source_hashes()))"
    installed, source = (run_from(root, "-c", hashes, cwd=tmp_path) for root in (site, context))
    assert installed.returncode == source.returncode == 0, installed.stderr + source.stderr
    assert json.loads(installed.stdout) == json.loads(source.stdout)


def run_from(root: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The venv's interpreter with ``root`` first and none of this checkout's hooks."""
    path = os.pathsep.join([str(root), sysconfig.get_paths()["purelib"]])
    env = {**os.environ, "PYTHONPATH": path, "KVGATE_NATIVE": "0"}
    return subprocess.run([sys.executable, "-S", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=60)
