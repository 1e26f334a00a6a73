"""The virtual-time policy benchmark (bench.sim, bench.policy_sim): small, deterministic runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import policy_sim
from bench.sim import Fifo, Simulation, jain, summarize, workload

SMALL = {"requests": 500, "rate": 9.0, "seed": 3, "engines": 2}  # ~1.1x two engines' capacity
CONTENTION_RATE = SMALL["rate"] * policy_sim.CONTENTION_FACTOR  # every tenant backlogged


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    out = {}  # (d) is kvgate on its shipped defaults
    for policy in policy_sim.policies(SMALL["seed"]):
        out[policy.name], _ = policy_sim.run_policy(policy, SMALL["requests"], SMALL["rate"],
                                                    SMALL["seed"], SMALL["engines"])
    return out


def test_every_policy_reports_every_metric(rows: dict[str, dict]) -> None:
    assert list(rows) == ["fifo", "strict-priority", "wfq", "kvgate"]
    for row in rows.values():
        for key in ("interactive_ttft_p50_s", "interactive_ttft_p99_s",
                    "interactive_timeout_rate", "batch_throughput_tok_s", "jain",
                    "weighted_share_error"):
            assert isinstance(row[key], float) and not math.isnan(row[key]), key
        assert 0 < row["jain"] <= 1
        assert 0 <= row["interactive_timeout_rate"] <= 1
        assert row["batch_throughput_tok_s"] > 0


def test_kvgate_cuts_the_interactive_tail_under_contention(rows: dict[str, dict]) -> None:
    assert rows["kvgate"]["interactive_ttft_p99_s"] < rows["fifo"]["interactive_ttft_p99_s"]


@pytest.fixture(scope="module")
def contention() -> dict[str, dict]:
    out = {}
    for policy in policy_sim.policies(SMALL["seed"]):
        out[policy.name], _ = policy_sim.run_policy(policy, SMALL["requests"], CONTENTION_RATE,
                                                    SMALL["seed"], SMALL["engines"])
    return out


def test_kvgate_shares_by_weight_under_contention(contention: dict[str, dict]) -> None:
    fifo, kvgate = contention["fifo"], contention["kvgate"]
    assert fifo["contended_tokens"] > 0 and kvgate["contended_tokens"] > 0
    # FIFO serves equal demand equally: the 1-weight tenants get ~2.5x their weight share.
    assert fifo["weighted_share_error"] > 0.5
    assert kvgate["weighted_share_error"] < 0.25 * fifo["weighted_share_error"]
    assert kvgate["jain"] > fifo["jain"]


def test_same_seed_same_numbers() -> None:
    def once() -> dict:
        return summarize(Simulation(workload(200, 9.0, 5), Fifo(), engines=2).run())

    assert once() == once()


def test_a_workload_asking_its_class_ceiling_gets_the_same_answers() -> None:
    """``--asks ceiling``: one fixed ``max_tokens`` per class, the answers as drawn."""
    used, ceiling = workload(300, 9.0, 5), workload(300, 9.0, 5, asks="ceiling")
    assert [(j.tenant, j.klass, j.arrival, j.prompt, j.produces) for j in used] == [
        (j.tenant, j.klass, j.arrival, j.prompt, j.produces) for j in ceiling]
    assert {j.max_tokens for j in ceiling} == {300, 1000}
    assert all(j.produces <= j.max_tokens for j in ceiling)
    assert any(j.produces < j.max_tokens for j in ceiling)


def test_jain_index_bounds() -> None:
    assert jain([1, 1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0, 0, 0]) == pytest.approx(0.25)
    assert 0 < jain([0.5, 2.0, 1.0]) <= 1


def test_cli_writes_the_report(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    report = policy_sim.main(["--requests", "200", "--rate", "9", "--engines", "2",
                              "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["command"].startswith("python -m bench.policy_sim --requests 200")
    assert set(saved["policies"]) == set(report["policies"])
    assert set(saved["check"]["pass"]) == {"p99_vs_fifo", "p99_vs_strict", "share_error", "jain",
                                           "interactive_timeout_rate", "batch_vs_fifo"}
    assert set(saved["contention"]["policies"]) == set(report["policies"])
    assert saved["contention"]["rate_req_s"] == pytest.approx(9 * policy_sim.CONTENTION_FACTOR)


def test_the_contention_scenario_stays_contended_at_low_loads() -> None:
    """A latency scenario far below the knee still measures shares where every tenant asks
    for more than its weighted share: at least 3.2x the knee."""
    knee = 12.0
    assert policy_sim.contention_rate(0.3 * knee, knee) == pytest.approx(3.2 * knee)
    assert policy_sim.contention_rate(1.0 * knee, knee) == pytest.approx(4 * knee)
    assert policy_sim.contention_rate(0.8 * knee, knee) == pytest.approx(3.2 * knee)
    assert policy_sim.contention_rate(3.0, None) == pytest.approx(12.0)  # --rate: no knee


def test_the_knee_sweep_scales_with_the_pool() -> None:
    """The sweep starts at 1.5 req/s per engine and ends at the first rate where FIFO's tail
    is contended (or at its top, flagged)."""
    for engines in (2, 8):
        rate, sweep = policy_sim.find_load(150, 1, engines, quiet=True)
        assert sweep[0]["rate"] == pytest.approx(1.5 * engines)
        assert rate in {s["rate"] for s in sweep} and rate <= 15 * engines
        assert all(not s["knee"] for s in sweep[:-1])


def test_the_matrix_reports_every_cell_and_its_bounds(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    report = policy_sim.main(["--matrix", "--requests", "150", "--engines", "2", "--seeds",
                              "1", "--loads", "1.0", "--mixes", "0.7,0.5", "--jobs", "1",
                              "--out", str(out)])
    saved = json.loads(out.read_text())
    assert len(saved["cells"]) == 2 == report["summary"]["cells"]
    for cell in saved["cells"]:
        assert cell["contention_req_s"] == pytest.approx(
            policy_sim.contention_rate(cell["rate_req_s"], cell["knee_req_s"]))
    assert {c["mix"] for c in saved["cells"]} == {0.7, 0.5}
    assert set(saved["cells"][0]["policies"]) == {"fifo", "strict-priority", "wfq", "kvgate"}
    assert "p99_vs_strict_worst" in saved["summary"]["targets"]
    assert out.with_suffix(".md").read_text().startswith("# python -m bench.policy_sim --matrix")

    # a variant with no settings reruns kvgate as shipped: the recorded checks, exactly
    rerun = policy_sim.main(["--variant", "{}", "--against", str(out), "--jobs", "1",
                             "--out", str(tmp_path / "v.json")])
    assert [c["check"] for c in rerun["cells"]] == [c["check"] for c in saved["cells"]]
    changed = policy_sim.main(["--variant", '{"prefill_clear_share": 0.5}', "--against",
                               str(out), "--jobs", "1", "--out", str(tmp_path / "v2.json")])
    assert changed["variant"] == {"prefill_clear_share": 0.5}
    assert [c["policies"]["fifo"] for c in changed["cells"]] == [
        c["policies"]["fifo"] for c in saved["cells"]]  # only kvgate runs again
    assert (tmp_path / "v2.md").read_text().startswith("# python -m bench.policy_sim --variant")

    # kvgate's contention scenario again at other lengths; the matrix's own is the recorded
    longer = policy_sim.main(["--against", str(out), "--share-lengths", "2,3", "--jobs", "1",
                              "--out", str(tmp_path / "s.json")])
    for cell, recorded in zip(longer["cells"], saved["cells"], strict=True):
        assert set(cell["lengths"]) == {"2", "3"}
        assert cell["lengths"]["2"]["share_error"] == (
            recorded["contention"]["kvgate"]["weighted_share_error"])
    assert "×3 the latency scenario's requests" in (tmp_path / "s.md").read_text()


def test_the_matrix_plot_draws_every_cell_at_any_mix_and_load(tmp_path: Path) -> None:
    """``--mixes``/``--loads`` off the matrix's own (0.65, 1.35…) are plotted too: the plot
    once drew only the matrix's mixes and loads, and such runs came out empty."""
    cells = [{"seed": seed, "mix": mix, "load": load,
              "check": {"p99_vs_fifo": seed / 100, "p99_vs_strict": seed / 10}}
             for seed in (81, 82) for mix in (0.55, 0.75) for load in (0.85, 1.35)]
    series = policy_sim.matrix_series(cells, "p99_vs_fifo")
    assert sorted((s, r) for *_, seeds, ratios in series for s, r in zip(seeds, ratios,
                                                                        strict=True)) == \
        sorted((c["seed"], c["check"]["p99_vs_fifo"]) for c in cells)
    assert len({(marker, color) for _, marker, color, *_ in series}) == 4  # told apart
    assert "75% interactive, 1.35× knee" in [label for label, *_ in series]
    recorded = tmp_path / "m.json"
    recorded.write_text(json.dumps({"cells": cells}))
    policy_sim.main(["--replot", str(recorded)])  # a recorded matrix, drawn again
    assert recorded.with_suffix(".png").stat().st_size > 0


def test_a_variant_needs_a_recorded_matrix() -> None:
    with pytest.raises(SystemExit):
        policy_sim.main(["--variant", '{"prefill_clear_hold_s": 1}'])
    with pytest.raises(SystemExit):
        policy_sim.main(["--share-lengths", "4"])
    with pytest.raises(SystemExit):
        policy_sim.main(["--against", "m.json"])
