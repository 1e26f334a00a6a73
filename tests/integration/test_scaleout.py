"""bench.scaleout end to end, briefly: every set-up admits, is charged CPU, and counts the
Redis commands per admission."""

from __future__ import annotations

import os

import pytest

from bench import scaleout

pytestmark = pytest.mark.redis


def test_family_finds_the_process_and_its_children():
    assert scaleout.family(os.getpid())[0] == os.getpid()


def test_every_setup_admits_and_is_measured(tmp_path):
    out = tmp_path / "scaleout.json"
    scaleout.main(["--duration", "0.6", "--rounds", "1", "--concurrency", "2",
                   "--out", str(out)])
    text = out.with_suffix(".md").read_text()
    for name in scaleout.SETUPS:
        assert f"| {name} |" in text
    import json

    rows = json.loads(out.read_text())["rows"]
    for row in rows:
        assert row["admitted"] > 0 and row["kvgate_cpu_us_per_admission"] > 0
        assert row["redis_cpu_us_per_admission"] >= 0
        assert 1.5 <= row["redis_commands_per_admission"] <= 3, row  # admit, release (+renew)
        assert row["redis_commands_run_per_admission"] > row["redis_commands_per_admission"]
