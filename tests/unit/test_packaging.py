"""The installable package: built without setuptools warnings (a data folder not declared
as a package prints ~40 lines on first install), and carrying its data files — the bundled
config, the Lua meter, the status page."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ("extproc/examples/kvgate.yaml", "extproc/meter.lua", "extproc/status.html")


def test_the_wheel_builds_quietly_with_its_data_files(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "SetuptoolsDeprecationWarning" not in output and "absent from the" not in output
    [wheel] = tmp_path.glob("kvgate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(DATA) <= names
