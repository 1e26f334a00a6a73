"""The compiled hot path's loader: a build is used only when it matches the sources beside it,
and the build refuses coroutines (python/mypy#12867). Each case runs in a fresh interpreter:
the choice is made once, when ``extproc`` and ``limiter`` are first imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvgate_native

PROBE = ("import kvgate_native, extproc.scheduler, limiter.decision, extproc.stream; "
         "print(kvgate_native.status()); print(extproc.scheduler.__file__); "
         "print(limiter.decision.__file__); print(extproc.stream.__file__)")


def probe(**env: str) -> list[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("KVGATE_NATIVE")}
    done = subprocess.run([sys.executable, "-W", "always", "-c", PROBE], capture_output=True,
                          text=True, check=True, env={**environment, **env},
                          cwd=kvgate_native.ROOT)
    return [*done.stdout.splitlines(), done.stderr]


def test_no_build_runs_pure_python(tmp_path: Path):
    status, scheduler, decision, _stream, _ = probe(KVGATE_NATIVE_DIR=str(tmp_path / "none"))
    assert status.startswith("pure Python (no compiled build")
    assert scheduler.endswith("scheduler.py") and decision.endswith("decision.py")


def test_compiled_modules_never_include_a_coroutine():
    for module in kvgate_native.MODULES:
        assert not kvgate_native._COROUTINE.search(kvgate_native.source(module).read_text())
    assert "extproc.stream" not in kvgate_native.MODULES  # async: stays plain Python


def test_the_build_refuses_a_coroutine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(kvgate_native, "MODULES", ("extproc.stream",))
    with pytest.raises(SystemExit, match="12867"):
        kvgate_native.build(tmp_path / "out")
    assert not (tmp_path / "out").exists()


built = pytest.mark.skipif(kvgate_native.usable_build() is None,
                           reason="no up-to-date compiled build (make native)")


@built
def test_a_current_build_is_loaded_for_the_sync_modules_only():
    status, scheduler, decision, stream, _ = probe()
    assert status.startswith("compiled (mypyc")
    build = str(kvgate_native.build_dir())
    assert scheduler.startswith(build) and scheduler.endswith(".so")
    assert decision.startswith(build) and decision.endswith(".so")
    assert stream.endswith("extproc/stream.py")


@built
def test_kvgate_native_0_forces_pure_python():
    status, scheduler, *_ = probe(KVGATE_NATIVE="0")
    assert status == "pure Python (KVGATE_NATIVE=0)" and scheduler.endswith(".py")


@built
def test_a_stale_build_is_ignored_with_a_warning(tmp_path: Path):
    stale = tmp_path / "native"
    shutil.copytree(kvgate_native.build_dir(), stale)
    manifest = json.loads((stale / kvgate_native.MANIFEST).read_text())
    manifest["sources"]["extproc.scheduler"] = "0" * 64  # as if scheduler.py was edited since
    (stale / kvgate_native.MANIFEST).write_text(json.dumps(manifest))
    status, scheduler, _decision, _stream, stderr = probe(KVGATE_NATIVE_DIR=str(stale))
    assert "stale" in status and scheduler.endswith("scheduler.py")
    assert "RuntimeWarning" in stderr and "make native" in stderr
