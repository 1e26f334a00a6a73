"""The herd-refunds benchmark runs the real limiter in virtual time and reports every variant
(short runs: the benchmark's own figures come from ``python -m bench.herd_refunds``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from bench import herd_refunds

ROOT = Path(__file__).resolve().parents[3]
PICK = "(= use|5x use), (lone|load 0.67)"


def _rows(out: Path) -> dict[tuple[str, str], dict]:
    recorded = json.loads(out.with_suffix(".json").read_text())
    return {(r["scenario"], r["variant"]): r for r in recorded["rows"]}


def test_a_lone_client_is_exact_and_without_refunds_the_schedule_is_fifo(
        tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "herd"
    monkeypatch.setattr(sys, "argv", ["x", "--seeds", "1", "--run-s", "60", "--warmup-s", "5",
                                      "--scenarios", PICK, "--variants", "shipped,exact,oracle",
                                      "--out", str(out)])
    herd_refunds.main()
    rows = _rows(out)
    assert {scenario for scenario, _ in rows} == {
        "reserve = use, lone client", "reserve 5x use, lone client",
        "reserve = use, load 0.67", "reserve 5x use, load 0.67"}
    for usage in ("reserve = use", "reserve 5x use"):
        lone = rows[(f"{usage}, lone client", "shipped")]
        assert lone["ra_x_exact"] == 1.0 and lone["retries_refused"] == 0.0
    # no refunds: each refused client's slot is its place in a FIFO queue, none too early
    same = rows[("reserve = use, load 0.67", "shipped")]
    assert same["retries_refused"] == 0.0
    assert same["mean_wait_s"] == rows[("reserve = use, load 0.67", "oracle")]["mean_wait_s"]
    # reserving 5x what it uses, the herd is told far later than a FIFO queue admits it
    refunds = rows[("reserve 5x use, load 0.67", "shipped")]
    assert refunds["mean_wait_s"] > 5 * rows[("reserve 5x use, load 0.67", "oracle")][
        "mean_wait_s"]
    assert rows[("reserve 5x use, load 0.67", "oracle")]["ra_p50_s"] is None
    text = out.with_suffix(".md").read_text()
    assert "python -m bench.herd_refunds --seeds 1" in text and "| expected" not in text


def test_the_expected_usage_experiment_runs_on_the_plain_limiter(tmp_path: Path) -> None:
    """The experiment subclasses and patches the limiter, so it runs uncompiled."""
    out = tmp_path / "herd"
    subprocess.run(
        [sys.executable, "-m", "bench.herd_refunds", "--seeds", "1", "--run-s", "60",
         "--warmup-s", "5", "--scenarios", "5x use, load 0.67",
         "--variants", "shipped,expected,expected+refunds", "--out", str(out)],
        cwd=ROOT, env={**os.environ, "KVGATE_NATIVE": "0"}, check=True, capture_output=True)
    rows = _rows(out)
    shipped = rows[("reserve 5x use, load 0.67", "shipped")]
    for variant in ("expected", "expected+refunds"):
        assert rows[("reserve 5x use, load 0.67", variant)]["mean_wait_s"] < \
            shipped["mean_wait_s"] / 2
    assert out.with_suffix(".md").read_text().count("KVGATE_NATIVE=0 python -m") == 1
