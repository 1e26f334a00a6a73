"""``bench.nvml_proof`` on a synthetic GPU: the script that checks the NVML path on a real
one must itself work (the agent → scraper → scheduler chain, and its verdict)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.nvml_proof import main


def test_a_dry_run_places_holds_past_the_gpu_memory_watermark_and_places_again(
        tmp_path: Path) -> None:
    out = tmp_path / "proof.json"
    assert main(["--dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [result[step]["placed"] for step in ("idle", "filled", "freed")] == [
        True, False, True]
    assert result["filled"]["gpu_memory_used_ratio"] > result["gpu_memory_critical"]
    assert result["agent_readings"] == result["in_process"]
