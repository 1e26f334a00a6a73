"""The inflated-max_tokens benchmark runs and reports every scenario (a short run: the
benchmark's own figures come from ``python -m bench.inflated_max_tokens``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import inflated_max_tokens


def test_it_writes_a_row_per_scenario_and_seed(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "inflated"
    monkeypatch.setattr(sys, "argv", ["x", "--seeds", "1", "--duration", "20",
                                      "--out", str(out)])
    inflated_max_tokens.main()
    rows = json.loads(out.with_suffix(".json").read_text())
    assert [r["scenario"] for r in rows] == list(inflated_max_tokens.SCENARIOS)
    assert all(r["victim_interactive"] > 0 and 0 < r["victim_share"] < 1 for r in rows)
    assert "inflated 30,000" in out.with_suffix(".md").read_text()
