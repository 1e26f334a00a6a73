"""Hot reload: a changed config file (or SIGHUP) applied to the running process.

A reload validates the whole new file first (exactly as ``kvgate check`` does), then swaps
in one step between two awaits, so a request sees the old configuration or the new one,
never a mix. Only the sections in :data:`LIVE` take effect at once: they are read per
request. The rest (ports, TLS, Redis, pools and their endpoints, classes, queue, scrape)
shape objects built at start — sockets, connections, schedulers holding reservations — and
changing them under requests in flight could lose what those hold, so a change there is
reported as waiting for a restart and the running values stay.

Tenants a reload removes: their keys are gone, so new requests get 401; requests already
admitted or queued finish, and release, under the tenant's last limits. Once nothing of
theirs is left (admitted, queued, or owed to Redis), they are forgotten
(``Director.forget_retired``, at the reload and every few seconds): a config that renames
its tenants every day no longer grows kvgate by every tenant it ever had.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from extproc.config import Config, ConfigError, load_config
from extproc.yaml_input import read_capped

LIVE = ("tiers", "tenants", "classification")
"""The sections a reload applies to a running process — but ``classification.header``: the
rendered Envoy config names the header it forwards to kvgate, so a new name takes a new
render and a restart (a reload would read a header Envoy no longer sends)."""


@dataclass(frozen=True)
class Reload:
    config: Config  # what runs from now: the file's live sections, the running rest
    restart: list[str]  # sections the file changed that wait for a restart
    added: list[str]  # tenants
    removed: list[str]
    changed: list[str]  # tenants whose limits, tier (or its settings), keys or classes changed


def plan(running: Config, new: Config, source: str = "<config>") -> Reload:
    """What applying ``new`` to a process running ``running`` does; :class:`ConfigError` if
    the new live sections do not fit the running rest (a tenant naming a class that only a
    restart would bring)."""
    fixed = {name: getattr(running, name) for name in Config.model_fields if name not in LIVE}
    merged = new.model_copy(update=fixed)
    header = running.classification.header
    if new.classification.header != header:  # Envoy forwards the header by its old name
        merged = merged.model_copy(update={
            "classification": new.classification.model_copy(update={"header": header})})
    problems = list(merged._reference_errors())
    if problems:
        raise ConfigError(source, [*problems, "(these sections change only on restart: "
                                   f"{', '.join(sorted(fixed))})"])
    before = {t.name: t for t in running.tenants}
    after = {t.name: t for t in new.tenants}
    return Reload(
        config=merged,
        restart=sorted([name for name, value in fixed.items() if getattr(new, name) != value]
                       + ["classification.header"] * (new.classification.header != header)),
        added=sorted(after.keys() - before.keys()),
        removed=sorted(before.keys() - after.keys()),
        changed=sorted(name for name in after.keys() & before.keys()
                       if after[name] != before[name]
                       or running.tiers.get(before[name].tier) != new.tiers.get(after[name].tier)
                       or running.limits_for(before[name]) != new.limits_for(after[name])),
    )


class ConfigFile:
    """The file the running configuration came from: whether it has changed since it was
    last read (its size and mtime first; a content hash decides, so a touch or a rewrite
    with the same bytes is no change)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._stat = self._stat_key()
        self.digest = self._digest()

    def _stat_key(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def _digest(self) -> str | None:
        try:
            return hashlib.sha256(read_capped(self.path)).hexdigest()
        except OSError:
            return None

    def changed(self) -> bool:
        """Whether the content differs from the last read; a missing file is no change (an
        editor replacing it, or a ConfigMap's symlink swap, shows up on a later poll)."""
        stat = self._stat_key()
        if stat is None or stat == self._stat:
            return False
        self._stat = stat
        digest = self._digest()
        return digest is not None and digest != self.digest

    def load(self) -> Config:
        """Read and validate the file; it counts as read whether or not it is valid (a
        broken file is reported once, not on every poll)."""
        self._stat, self.digest = self._stat_key(), self._digest()
        return load_config(self.path)
