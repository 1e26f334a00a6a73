"""Reading a YAML file kvgate is given (a config, an envoyproxy/ratelimit file), bounded.

PyYAML alone trusts its input: it reads a file whole (``/dev/zero`` until memory runs out),
recurses once per nesting level (a few hundred ``[`` end in a RecursionError), shares an
aliased node where everything after it walks a tree (ten aliases of ten aliases … cost
exponential time in validation, and a hot reload stalls the event loop), and keeps the last
of two equal keys without a word. So a file is read up to :data:`MAX_BYTES`, composed at most
:data:`MAX_DEPTH` levels deep, and measured as a tree — memoised per node, so the measuring
is linear in the file — before anything is built from it; duplicate keys are returned as
problems beside the document, for the caller to report with the others.
"""

from __future__ import annotations

import errno
import os
import select
import stat
from pathlib import Path
from typing import Any

import yaml

from extproc.config_check import format_loc

MAX_BYTES = 8 * 1024 * 1024
"""A config is kilobytes (10,000 tenants are about 2 MB); a Kubernetes ConfigMap holds at
most 1 MiB."""
MAX_DEPTH = 100
"""Nesting levels: a config needs about 10 (ratelimit descriptors two per level); PyYAML's
composer runs out of stack near 490."""
MAX_VALUES = 1_000_000
"""Values (scalars, lists, mappings, keys) with every alias expanded. 40,000 tenants, 7.5 MB,
are 560,000: aliases may make a document about as costly to validate as the largest file
accepted, not more."""
FIFO_WAIT_S = 5.0
"""How long a FIFO (a named pipe, ``<(…)``, ``/dev/stdin`` piped) may stay silent before it is
refused: a named pipe nothing writes to blocked ``kvgate check`` forever."""
MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlInputError(ValueError):
    """A file refused before it is used (too large, nested too deeply, expanding too far);
    the message is one line, without the file's name."""


def read_capped(path: Path) -> bytes:
    """At most :data:`MAX_BYTES` + 1 bytes of the file, in one read: a device or a pipe
    that never ends (``/dev/zero``) costs that much, not all memory. Opened without
    blocking (opening a named pipe waits for a writer), and a pipe that has written
    nothing within :data:`FIFO_WAIT_S` is refused. Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with open(fd, "rb") as file:
        if stat.S_ISFIFO(os.fstat(fd).st_mode) and not _readable_within(fd, FIFO_WAIT_S):
            raise OSError(errno.ETIMEDOUT, f"a pipe nothing wrote to within {FIFO_WAIT_S:g} s",
                          str(path))
        os.set_blocking(fd, True)  # the writer's pace from here: it has started
        return file.read(MAX_BYTES + 1)


def _readable_within(fd: int, seconds: float) -> bool:
    """Whether ``fd`` has data, or its writer has come and gone (end of file), within
    ``seconds``. A named pipe no writer has opened yet is not readable (Linux)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(int(seconds * 1000)))


def read_text(path: Path) -> str:
    """The file's text; refused past :data:`MAX_BYTES` before anything is parsed. Raises
    OSError, UnicodeDecodeError, :class:`YamlInputError`."""
    raw = read_capped(path)
    if len(raw) > MAX_BYTES:
        raise YamlInputError(f"larger than {MAX_BYTES // 2**20} MiB, too large for a config")
    return raw.decode("utf-8")


class BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses a document nested past :data:`MAX_DEPTH` or expanding past
    :data:`MAX_VALUES`, and notes duplicate keys in :attr:`duplicates`."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0
        self.duplicates: list[str] = []

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        """Counted here because the composer recurses once per level."""
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise YamlInputError(f"{_at(self.peek_event())}: {_too_deep()}")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def get_single_data(self) -> Any:
        node = self.get_single_node()
        if node is None:
            return None
        self.duplicates = _Measure().walk(node)
        return self.construct_document(node)


def load(text: str, loader: type[BoundedLoader] = BoundedLoader) -> tuple[Any, list[str]]:
    """The document in ``text`` and its duplicate keys, each a problem with its path and
    line. Raises yaml.YAMLError and :class:`YamlInputError`."""
    reader = loader(text)
    try:
        return reader.get_single_data(), reader.duplicates
    finally:
        reader.dispose()


class _Measure:
    """One walk over the composed nodes: each node's size and height as a tree, memoised by
    id() (aliases share nodes), and each mapping's duplicate keys, once per mapping node."""

    def __init__(self) -> None:
        self.known: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height)
        self.duplicates: list[str] = []

    def walk(self, root: yaml.Node) -> list[str]:
        self._visit(root, 1, ())
        return self.duplicates

    def _visit(self, node: yaml.Node, depth: int, loc: tuple[Any, ...]) -> tuple[int, int]:
        known = self.known.get(id(node))
        if known is None:
            if depth > MAX_DEPTH:  # an alias of an alias of …: deep only once expanded
                raise YamlInputError(f"{_at(node)}: {_too_deep()} once aliases expand")
            known = self.known[id(node)] = self._size(node, depth, loc)
        if depth + known[1] - 1 > MAX_DEPTH:
            raise YamlInputError(f"{_at(node)}: {_too_deep()} once aliases expand")
        return known

    def _size(self, node: yaml.Node, depth: int, loc: tuple[Any, ...]) -> tuple[int, int]:
        values, height = 1, 1
        for child, where in self._children(node, loc):
            size, below = self._visit(child, depth + 1, where)
            values, height = values + size, max(height, below + 1)
            if values > MAX_VALUES:
                raise YamlInputError(
                    f"{_at(node)}: {format_loc(loc) or 'the document'} expands to more than "
                    f"{MAX_VALUES:,} values once aliases are expanded")
        return values, height

    def _children(self, node: yaml.Node, loc: tuple[Any, ...]) -> list[tuple[yaml.Node, tuple]]:
        if isinstance(node, yaml.SequenceNode):
            return [(item, (*loc, i)) for i, item in enumerate(node.value)]
        if not isinstance(node, yaml.MappingNode):
            return []
        self._duplicates(node, loc)
        return [(part, (*loc, _name(key))) for key, value in node.value for part in (key, value)]

    def _duplicates(self, node: yaml.MappingNode, loc: tuple[Any, ...]) -> None:
        first: dict[tuple[str, str], yaml.Node] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE_TAG:
                continue
            seen = first.setdefault((key.tag, key.value), key)
            if seen is not key:
                self.duplicates.append(
                    f"{format_loc((*loc, key.value))}: duplicate key at {_at(key)} (first at "
                    f"{_at(seen)}; YAML would keep only the last)")


def _name(key: yaml.Node) -> str:
    return key.value if isinstance(key, yaml.ScalarNode) else "?"


def _at(where: yaml.Node | yaml.Event) -> str:
    mark = where.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _too_deep() -> str:
    return f"nested too deeply (more than {MAX_DEPTH} levels)"
