"""What the limiter tests share: assertions, the one Hypothesis strategy for policies, and the
one for fair-queue selector calls (memory and Redis run the same steps)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from limiter import Admit, Cost, QueuedRequest, Rate, Reject, TenantLimiter, TenantPolicy
from limiter.fairqueue import Offer
from limiter.stores import Fairness

slow_rates = st.builds(Rate, st.integers(1, 5), st.integers(50, 5000))
token_rates = st.one_of(
    st.builds(Rate, st.integers(1, 50), st.integers(1, 5000)),
    st.builds(Rate.per_minute, st.integers(1, 10**6)),
)
small_windows = st.tuples(st.integers(1, 5), st.integers(1, 3000))


@st.composite
def policies(
    draw: st.DrawFn, *, concurrency: bool | None = None, quotas: bool = False
) -> TenantPolicy:
    """Every dimension optional; ``concurrency`` True/False forces a concurrency limit on or
    off; ``quotas`` adds daily/monthly token quotas small enough to be spent in one example."""
    request = draw(st.one_of(st.none(), st.tuples(slow_rates, st.integers(1, 5))))
    token = draw(st.one_of(st.none(), st.tuples(token_rates, st.integers(1, 3000))))
    window = draw(st.one_of(st.none(), small_windows))
    budget = token[1] if token else 3000
    quota = (st.one_of(st.none(), st.integers(budget, 4 * budget), st.integers(1, 20_000))
             if quotas else st.none())
    if concurrency is None:
        max_concurrency = draw(st.one_of(st.none(), st.integers(1, 4)))
    else:
        max_concurrency = draw(st.integers(1, 4)) if concurrency else None
    shaping = draw(st.one_of(st.none(), st.tuples(slow_rates, st.integers(0, 4))))
    return TenantPolicy(
        shaping_rate=shaping and shaping[0],
        shaping_backlog=shaping and shaping[1],
        request_rate=request and request[0],
        request_burst=request and request[1],
        token_rate=token and token[0],
        token_burst=token and token[1],
        window_limit=window and window[0],
        window_ms=window and window[1],
        max_concurrency=max_concurrency,
        max_context_tokens=draw(st.one_of(st.none(), st.none(), st.integers(1, 3000))),
        concurrency_retry_ms=draw(st.integers(1, 2000)),
        daily_token_quota=draw(quota),
        monthly_token_quota=draw(quota),
    )


def assert_never_faster(sends: list[int], rate: Rate) -> None:
    """A shaper's promise: in any window [t, t + T) of T ms, at most ceil(T × rate) of
    ``sends`` (ms) fall."""
    sends = sorted(sends)
    for i in range(len(sends)):
        for j in range(i + 1, len(sends)):
            span = sends[j] - sends[i] + 1  # the shortest window holding sends i..j
            most = -(-span * rate.amount // rate.period_ms)
            assert j - i + 1 <= most, (sends[i], sends[j], rate)


def admit_ok(limiter: TenantLimiter, cost: Cost, lease: str, now: int) -> Admit:
    result = limiter.admit(cost, lease, now)
    assert isinstance(result, Admit), result
    return result


def admit_rejected(limiter: TenantLimiter, cost: Cost, lease: str, now: int) -> Reject:
    result = limiter.admit(cost, lease, now)
    assert isinstance(result, Reject), result
    return result


# --- fair-queue selectors -------------------------------------------------------------------

FAIR_TENANTS = "ABCDE"
fair_weights = st.sampled_from([0.5, 1, 3, 5, 7.5])
fair_tokens = st.one_of(st.integers(0, 5000), st.integers(10**8, 5 * 10**8))
"""Prices: ordinary ones, and ones near ``MAX_CHARGE`` that force rebases at the smallest
allowed ``rebase_at`` (``2 * MAX_CHARGE``)."""


def fairness_steps(*, unfit: bool = True, corrections: bool = True) -> st.SearchStrategy:
    """Sequences of ``("activate", tenant)``, ``("choose", [(tenant, price, weight,
    enqueued_ms, band, fits), ...])`` (duplicate tenants, equal counters and enqueue times
    included) and ``("correct", tenant, tokens, weight, band0)``. ``unfit=False``: every offer
    fits; ``corrections=False``: no corrections."""
    tenants = st.sampled_from(FAIR_TENANTS)
    offer = st.tuples(tenants, fair_tokens, fair_weights, st.integers(0, 3), st.integers(0, 2),
                      st.booleans() if unfit else st.just(True))
    steps = [st.tuples(st.just("activate"), tenants),
             st.tuples(st.just("choose"), st.lists(offer, min_size=1, max_size=5))]
    if corrections:
        refund = st.one_of(st.integers(-6000, 6000), st.integers(-5 * 10**8, 5 * 10**8))
        steps.append(st.tuples(st.just("correct"), tenants, refund, fair_weights,
                               st.booleans()))
    return st.lists(st.one_of(*steps), max_size=40)


def fair_offers(n: int, specs: list[tuple]) -> list[Offer]:
    """A ``choose`` step's offers; ids ``{n}.{i}``."""
    return [Offer(QueuedRequest(f"{n}.{i}", tenant, band, price, weight, at, 10**15), band, fits)
            for i, (tenant, price, weight, at, band, fits) in enumerate(specs)]


async def fairness_step(fair: Fairness, n: int, step: tuple) -> str | None:
    """Run one step; for ``choose`` the chosen id (None: wait), else None."""
    if step[0] == "activate":
        await fair.activate(step[1])
    elif step[0] == "correct":
        await fair.correct(step[1], step[2], step[3], band0=step[4])
    else:
        chosen = await fair.choose(fair_offers(n, step[1]))
        return None if chosen is None else chosen.id
    return None


def one_pool_fairness(redis: dict[str, Any]) -> tuple[Fairness, Any]:
    """Pool ``one``'s fair order as kvgate wires it from a config with these ``redis``
    settings (one tenant, ``A``), and the ``Metrics`` it reports to."""
    from extproc.config import hash_api_key, parse_config
    from extproc.metrics import Metrics
    from extproc.wiring import build_fairness

    config = parse_config({
        "redis": redis,
        "tiers": {"t": {}},
        "tenants": [{"name": "A", "tier": "t", "api_keys": [hash_api_key("sk-a")]}],
        "pools": [{"name": "one", "models": [{"name": "m"}], "endpoints": ["127.0.0.1:1"]}],
    })
    metrics = Metrics()
    return build_fairness(config, "one", metrics), metrics
