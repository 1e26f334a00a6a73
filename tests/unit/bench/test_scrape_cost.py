"""``bench.scrape_cost``'s split of a round's CPU into a fixed part and a part per endpoint."""

from __future__ import annotations

import pytest

from bench.scrape_cost import split_costs


def _row(page: str, endpoints: int, fixed_us: float, per_endpoint_us: float) -> dict:
    return {"page": page, "endpoints": endpoints,
            "us_per_scrape": (fixed_us + endpoints * per_endpoint_us) / endpoints}


def test_the_two_largest_counts_give_the_fixed_and_per_endpoint_parts():
    rows = [_row("a", n, 1500, 600) for n in (1, 4, 16)] + [_row("b", 4, 900, 300)]
    split = split_costs(rows)
    assert split["a"] == pytest.approx((1500, 600))
    assert "b" not in split  # one count: nothing to split
