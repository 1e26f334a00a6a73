"""Which Redis Cluster node serves each hash slot as primary, from one ``CLUSTER NODES``
reply (no I/O here: the Redis store asks, :class:`~limiter.stores.FailoverStore` compares).

After a failover the promoted replica may lack its old primary's last writes (replication is
asynchronous): the failover store watches this map and, where a slot's primary changed,
puts its own leases back and sends its recent releases again (see ``failover``).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

SLOTS = 16_384


@dataclasses.dataclass(frozen=True)
class SlotMap:
    """Slot ranges and the id of the node serving each as primary, as one node sees them.

    ``suspect``: that node flags a primary that serves slots as failing (``fail?``, not
    answering for the node timeout, or ``fail``): a failover may be on its way."""

    ranges: tuple[tuple[int, int, str], ...]  # (first slot, last slot, primary id), sorted
    suspect: bool = False

    def primary(self, slot: int) -> str | None:
        """The id of the node serving ``slot`` as primary (None: not covered)."""
        i = bisect.bisect_right(self.ranges, (slot, SLOTS, "")) - 1
        if i >= 0:
            first, last, node = self.ranges[i]
            if first <= slot <= last:
                return node
        return None


def parse_nodes(reply: Any) -> SlotMap:
    """A ``CLUSTER NODES`` reply: its text (bytes or str, one line per node), or the dict
    redis-py's own parser makes of it (address → fields)."""
    if isinstance(reply, Mapping):
        lines: Iterable[tuple[str, str, list[str]]] = (
            (str(n["node_id"]), str(n["flags"]),
             ["-".join(map(str, r)) for r in n.get("slots", ())]) for n in reply.values())
    else:
        text = reply.decode() if isinstance(reply, bytes) else str(reply)
        lines = ((f[0], f[2], f[8:]) for f in (line.split() for line in text.splitlines())
                 if len(f) >= 8)
    ranges: list[tuple[int, int, str]] = []
    suspect = False
    for node_id, flags, slots in lines:
        marks = set(flags.split(","))
        if "master" not in marks:
            continue
        served = [s for s in slots if not s.startswith("[")]  # (a slot being migrated)
        for spec in served:
            first, _, last = spec.partition("-")
            ranges.append((int(first), int(last or first), node_id))
        if served and marks & {"fail?", "fail"}:
            suspect = True
    ranges.sort()
    return SlotMap(tuple(ranges), suspect)
