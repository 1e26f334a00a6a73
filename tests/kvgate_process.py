"""A ``kvgate serve`` subprocess for tests that need several replicas or must kill one."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from extproc.config import Config
from extproc.processes import stop_process


class KvgateProcess:
    def __init__(self, config: Config, workdir: Path, name: str = "kvgate", workers: int = 1):
        self.config = config
        self.path = workdir / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(config.model_dump(mode="json", exclude_none=True)))
        self.workers = workers
        self.process: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the process)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.config.server.grpc_port}"

    def start(self, timeout: float = 20) -> KvgateProcess:
        command = [sys.executable, "-m", "extproc.cli", "serve", "-c", str(self.path),
                   "--workers", str(self.workers)]
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        admin = f"http://127.0.0.1:{self.config.server.admin_port}/healthz"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvgate exited {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(admin, timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"kvgate did not become healthy:\n{self.log()}")

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-4000:]

    def kill(self) -> None:
        """SIGKILL: a crashed replica that releases nothing."""
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)

    def stop(self) -> None:
        stop_process(self.process)

    def __enter__(self) -> KvgateProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
