"""Which class a request belongs to: its queue band and its vLLM priority.

The client may ask (``x-request-class``) where its tenant allows, paths have defaults
(embeddings are batch work), and long prompts drop one class so a 30K-token document never
blocks short chats (the threshold is per tier: a free tier may set a lower one). A client
can lower its priority, never raise it above its tenant's ``max_class``.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.config import Config, Tenant
from extproc.openai import BadRequest, shown


@dataclass(frozen=True)
class RequestClass:
    name: str
    band: int  # 0 = most important; the class order inside a tenant's work in the fair queue
    priority: int  # what vLLM's priority scheduler gets (lower runs first)


class Classifier:
    def __init__(self, config: Config):
        self.config = config
        self.order = config.class_order
        self.rules = config.classification
        self._rank = {name: rank for rank, name in enumerate(self.order)}
        self._classes = [RequestClass(name, rank, config.classes[name].priority)
                         for rank, name in enumerate(self.order)]
        self._long_prompt = {tier: config.long_prompt_tokens(tier) for tier in config.tiers}

    def classify(
        self, tenant: Tenant, *, requested: str | None, path: str, prompt_tokens: int
    ) -> RequestClass:
        rank = max(self._rank[self._asked(tenant, requested, path)],
                   self._rank[tenant.max_class or tenant.default_class])
        long_prompt = self._long_prompt[tenant.tier]
        if long_prompt is not None and prompt_tokens > long_prompt:
            rank = min(rank + 1, len(self.order) - 1)
        return self._classes[rank]

    def _asked(self, tenant: Tenant, requested: str | None, path: str) -> str:
        if requested and tenant.class_header:
            if requested not in self.config.classes:
                raise BadRequest(
                    f"unknown request class {shown(requested)!r} in {self.rules.header} "
                    f"(known: {', '.join(self.order)})",
                    param=self.rules.header,
                    code="invalid_request_class",
                )
            return requested
        return self.rules.path_classes.get(path, tenant.default_class)
