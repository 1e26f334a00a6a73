"""Model pools and the endpoint picker.

For now the picker is least-in-flight over each pool's static endpoints, with a random
tie-break so equal endpoints share load; GPU-aware scoring replaces ``pick`` later without
changing its callers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from extproc.config import Config, Model, Pool


@dataclass
class EndpointPool:
    config: Pool
    in_flight: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.in_flight = {endpoint: 0 for endpoint in self.config.endpoints}

    @property
    def name(self) -> str:
        return self.config.name

    def pick(self, rng: random.Random) -> list[str]:
        """Endpoints best first: the first is used, the rest are Envoy's retry fallbacks."""
        order = list(self.in_flight)
        rng.shuffle(order)
        return sorted(order, key=self.in_flight.__getitem__)

    def acquire(self, endpoint: str) -> None:
        self.in_flight[endpoint] += 1

    def release(self, endpoint: str) -> None:
        self.in_flight[endpoint] = max(0, self.in_flight[endpoint] - 1)


class PoolDirectory:
    """Which pool (and model settings) serves a model name."""

    def __init__(self, config: Config):
        self.pools = [EndpointPool(p) for p in config.pools]
        self._by_model: dict[str, tuple[EndpointPool, Model]] = {
            model.name: (pool, model) for pool in self.pools for model in pool.config.models
        }
        self.default = self.pools[0]

    def for_model(self, name: str) -> tuple[EndpointPool, Model] | None:
        return self._by_model.get(name)

    @property
    def model_names(self) -> list[str]:
        return sorted(self._by_model)
