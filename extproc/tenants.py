"""Who is asking: tenants by API key (configured as sha256 hashes) and by name, and the
limiter policy each tenant's configured limits make."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from extproc.config import Config, Limits, Tenant
from extproc.openai import BadRequest
from limiter.decision import TenantPolicy
from limiter.rates import Rate

RECENT_KEYS = 4096  # authenticated Authorization values remembered
# … each at most this long: "Bearer", padding and a valid key is still that key, and one
# key holder sending 50 KB values would fill the cache with ~200 MB
MAX_CACHED_AUTHORIZATION = 256


def policy_from_limits(limits: Limits) -> TenantPolicy:
    window, shaping = limits.sliding_window, limits.shaping
    return TenantPolicy(
        request_rate=Rate.per_second(limits.requests_per_second)
        if limits.requests_per_second
        else None,
        request_burst=limits.effective_request_burst,
        token_rate=Rate.per_minute(limits.tokens_per_minute) if limits.tokens_per_minute else None,
        token_burst=limits.effective_token_burst,
        max_concurrency=limits.max_concurrency,
        max_context_tokens=limits.max_context_tokens,
        window_limit=window.requests if window else None,
        window_ms=window.window_ms if window else None,
        daily_token_quota=limits.daily_token_quota,
        monthly_token_quota=limits.monthly_token_quota,
        shaping_rate=Rate.per_second(shaping.requests_per_second) if shaping else None,
        shaping_backlog=shaping.effective_backlog if shaping else None,
    )


class Tenants:
    """The configured tenants. Built again on a reload, from the ``previous`` set: a tenant
    the reload removed (*retired*) can no longer authenticate, but keeps its last policy,
    weight and overflow for the requests it still has in flight or queued, until it is
    forgotten (:meth:`forget`, once nothing of it is left: ``Director.forget_retired``)."""

    def __init__(self, config: Config, previous: Tenants | None = None):
        self._by_key = {key: t for t in config.tenants for key in t.api_keys}
        self._by_name = {t.name: t for t in config.tenants}
        self._recent: dict[str, Tenant] = {}  # Authorization value → tenant
        self._policies = {t.name: policy_from_limits(config.limits_for(t))
                          for t in config.tenants}
        self._weights = {t.name: config.tiers[t.tier].weight for t in config.tenants}
        self._overflow = {t.name: config.overflow_for(t) for t in config.tenants}
        self._retired: set[str] = set()  # removed from the config, not forgotten yet
        if previous is not None:
            self.inherit(previous)

    def inherit(self, previous: Tenants) -> None:
        """Keep, as retired, the tenants ``previous`` has that this configuration removed.
        A reload builds the rest from its file in a worker thread (tens of thousands of
        tenants take a fraction of a second) and only this part, at the swap, on the event
        loop: ``previous`` is the live set, which requests change there."""
        for name, policy in previous._policies.items():
            if name not in self._policies:
                self._policies[name] = policy
                self._weights[name] = previous._weights[name]
                self._overflow[name] = previous._overflow[name]
                self._retired.add(name)

    @property
    def weights(self) -> dict[str, float]:
        """Tenant → tier weight, removed tenants with requests left included."""
        return dict(self._weights)

    def retired(self) -> list[str]:
        """Tenants removed from the configuration and not forgotten yet."""
        return sorted(self._retired)

    def forget(self, names: Iterable[str]) -> None:
        """Forget retired tenants (nothing of theirs is admitted, queued or owed any more):
        a request authenticated as one before it was removed is refused (:meth:`knows`)."""
        for name in names:
            if name in self._retired:
                self._retired.discard(name)
                del self._policies[name]
                del self._weights[name]
                del self._overflow[name]

    def knows(self, tenant: Tenant) -> bool:
        """Configured, or removed and not forgotten yet."""
        return tenant.name in self._policies

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant owning the request's API key. A key already seen skips the hash
        (OpenSSL's sha256 costs microseconds a call here)."""
        tenant = self._recent.get(authorization or "")
        if tenant is not None:
            return tenant
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise BadRequest(
                "missing API key: send 'Authorization: Bearer <key>'",
                status=401, code="invalid_api_key",
            )
        tenant = self._by_key.get("sha256:" + hashlib.sha256(key.encode()).hexdigest())
        if tenant is None:
            raise BadRequest("incorrect API key provided", status=401, code="invalid_api_key")
        if len(authorization or "") <= MAX_CACHED_AUTHORIZATION:
            if len(self._recent) >= RECENT_KEYS:
                self._recent.clear()  # bounded: a flood of distinct valid keys only re-hashes
            self._recent[authorization or ""] = tenant
        return tenant

    def get(self, name: str) -> Tenant | None:
        return self._by_name.get(name)

    def policy(self, tenant: Tenant) -> TenantPolicy:
        return self._policies[tenant.name]

    def weight(self, tenant: Tenant) -> float:
        """The tenant's tier weight: its share of a busy pool and of the fair queue."""
        return self._weights[tenant.name]

    def overflow(self, tenant: Tenant) -> str:
        """What a request of this tenant does when its busy pool cannot place it now:
        ``queue``, ``reject`` or ``degrade``."""
        return self._overflow[tenant.name]
