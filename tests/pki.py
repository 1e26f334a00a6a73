"""Throwaway certificates for TLS tests, made with the ``openssl`` CLI: a CA, a server
certificate for ``localhost`` (and 127.0.0.1), a client certificate for ``envoy``."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest


def openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def issue(folder: Path, name: str, ca: str = "ca") -> None:
    """``name.key`` and ``name.pem`` (SAN: DNS ``name``, IP 127.0.0.1) signed by ``ca``."""
    key, csr, cert = (folder / f"{name}.{ext}" for ext in ("key", "csr", "pem"))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
            "-subj", f"/CN={name}")
    extensions = folder / f"{name}.ext"
    extensions.write_text(f"subjectAltName=DNS:{name},IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", csr, "-CA", folder / f"{ca}.pem", "-CAkey",
            folder / f"{ca}.key", "-CAcreateserial", "-days", "1", "-out", cert,
            "-extfile", extensions)


def make_pki(folder: Path) -> Path:
    if shutil.which("openssl") is None:  # .ci/run installs it: absent there is a broken setup
        message = "the openssl CLI is not installed (apt-get install openssl)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            "/CN=kvgate-test-ca", "-keyout", folder / "ca.key", "-out", folder / "ca.pem")
    issue(folder, "localhost")
    issue(folder, "envoy")
    return folder
