"""Which class a request belongs to: its queue band and its vLLM priority.

The client may ask (``x-request-class``) where its tenant allows, paths have defaults
(embeddings are batch work), and long prompts drop one class so a 30K-token document never
blocks short chats. A client can lower its priority, never raise it above its tenant's
``max_class``.
"""

from __future__ import annotations

from dataclasses import dataclass

from extproc.config import Config, Tenant
from extproc.openai import BadRequest


@dataclass(frozen=True)
class RequestClass:
    name: str
    band: int  # 0 = most important; the fair queue's strict priority band
    priority: int  # what vLLM's priority scheduler gets (lower runs first)


class Classifier:
    def __init__(self, config: Config):
        self.config = config
        self.order = config.class_order
        self.rules = config.classification

    def classify(
        self, tenant: Tenant, *, requested: str | None, path: str, prompt_tokens: int
    ) -> RequestClass:
        rank = self.order.index(self._asked(tenant, requested, path))
        ceiling = self.order.index(tenant.max_class or tenant.default_class)
        rank = max(rank, ceiling)
        long_prompt = self.rules.long_prompt_tokens
        if long_prompt is not None and prompt_tokens > long_prompt:
            rank = min(rank + 1, len(self.order) - 1)
        name = self.order[rank]
        return RequestClass(name, rank, self.config.classes[name].priority)

    def _asked(self, tenant: Tenant, requested: str | None, path: str) -> str:
        if requested and tenant.class_header:
            if requested not in self.config.classes:
                raise BadRequest(
                    f"unknown request class {requested!r} in {self.rules.header} "
                    f"(known: {', '.join(self.order)})",
                    param=self.rules.header,
                    code="invalid_request_class",
                )
            return requested
        return self.rules.path_classes.get(path, tenant.default_class)
