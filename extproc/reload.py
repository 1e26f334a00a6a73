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

import contextlib
import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from extproc.config import Config, ConfigError, load_config
from extproc.yaml_input import MAX_BYTES

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


def _kind(mode: int) -> str:
    """What a file that is not a regular file is, for a log line."""
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


@dataclass(frozen=True)
class Polled:
    """What one look at the config file found."""

    changed: bool  # its content differs from the last read
    problem: str | None = None  # why it cannot be read now (gone, not a regular file)


class ConfigFile:
    """The file the running configuration came from: whether it has changed since it was
    last read (its identity, size and mtime first; a content hash decides, so a touch or a
    rewrite with the same bytes is no change).

    Only a regular file is read (a symlink to one, as a ConfigMap's ``..data`` layout, is
    followed): a FIFO, device or directory at the path is refused from its ``stat`` without
    being opened, since reading a FIFO waits for a writer and a device may never end.
    :meth:`check` and :meth:`load` read the file: call them off the event loop."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._stat: tuple[int, int, int, int] | None = None
        self.digest: str | None = None
        with contextlib.suppress(OSError):
            self._stat, self.digest = self._read_key()

    def _regular_stat(self) -> os.stat_result:
        """The file's stat; OSError if it is gone or not a regular file (not opened)."""
        st = os.stat(self.path)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{_kind(st.st_mode)}, not a regular file",
                          str(self.path))
        return st

    @staticmethod
    def _key(st: os.stat_result) -> tuple[int, int, int, int]:
        # the inode too: a file replaced by rename (an editor, a ConfigMap's symlink swap)
        # with the same size in the same nanosecond is still a new file
        return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size

    def _read_key(self) -> tuple[tuple[int, int, int, int], str]:
        """The file's stat key and content hash; OSError if it is not a regular file. The
        open does not block and is checked again: a FIFO swapped in after the stat is
        refused, not waited on."""
        key = self._key(self._regular_stat())
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(errno.EINVAL, f"{_kind(st.st_mode)}, not a regular file",
                              str(self.path))
            return key, hashlib.sha256(file.read(MAX_BYTES + 1)).hexdigest()

    def check(self) -> Polled:
        """Whether the content differs from the last read, or why the file cannot be read
        now. A file gone or not regular is no change (the running config stays; an editor
        replacing it, or a ConfigMap's symlink swap, shows up on a later check)."""
        try:
            key = self._key(self._regular_stat())
            if key == self._stat:
                return Polled(False)
            key, digest = self._read_key()
        except OSError as error:
            return Polled(False, error.strerror or str(error))
        self._stat = key
        return Polled(digest != self.digest)

    def changed(self) -> bool:
        """:meth:`check`'s verdict alone."""
        return self.check().changed

    def load(self) -> Config:
        """Read and validate the file; it counts as read whether or not it is valid (a
        broken file is reported once, not on every poll). A file that is not regular is
        refused without being opened."""
        try:
            self._stat, self.digest = self._read_key()
        except OSError as error:
            self._stat, self.digest = None, None
            raise ConfigError(str(self.path), [f"cannot read: {error.strerror}"]) from None
        return load_config(self.path)
