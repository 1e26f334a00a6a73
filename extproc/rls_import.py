"""``kvgate import-ratelimit``: envoyproxy/ratelimit config files → kvgate's ``ratelimit:``.

Each file holds one domain (``domain``, nested ``descriptors``); the fields mean the same in
kvgate, so the conversion mostly copies. What it changes: every limit gets an explicit
``algorithm`` (``fixed_window`` by default: the same decisions as that service), units are
lower-cased. Metrics-only fields (``detailed_metric``, ``value_to_metric``) and response
``metadata`` are dropped with a note; fields that would change decisions and that kvgate does
not have (``quota_mode``, ``share_threshold``) are errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from extproc.config import RateLimitSettings
from extproc.config_check import format_loc
from extproc.yaml_input import BoundedLoader, YamlInputError, load, read_text

DROPPED = ("detailed_metric", "value_to_metric", "metadata")
UNSUPPORTED = ("quota_mode", "share_threshold")
DESCRIPTOR_KEYS = ("key", "value", "rate_limit", "descriptors", "shadow_mode")
LIMIT_KEYS = ("unit", "requests_per_unit", "unlimited", "name", "replaces")
STRING_KEYS = ("domain", "key", "value", "name")  # kept as written (see _Loader)
BOOL_KEYS = ("shadow_mode", "unlimited")  # Go bools: anything else is an error


class _Loader(BoundedLoader):
    """envoyproxy/ratelimit reads ``domain``, ``key``, ``value`` and a limit's ``name`` (its
    own and those in ``replaces``) into Go strings, which keep a scalar's text as written
    (``true``, ``010``): so does this loader, where PyYAML would make them ``True`` and ``8``
    and an Envoy descriptor value would never match (and ``name: 2024``, valid there, an
    int that kvgate's config refused)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        mapping = super().construct_mapping(node, deep)
        for key_node, value_node in node.value:
            if (isinstance(key_node, yaml.ScalarNode) and key_node.value in STRING_KEYS
                    and isinstance(value_node, yaml.ScalarNode)
                    and value_node.tag != "tag:yaml.org,2002:null"):
                mapping[key_node.value] = value_node.value
        return mapping


class RatelimitImportError(ValueError):
    """A file that cannot be converted; the message is one line."""


def convert(document: Any, algorithm: str, notes: list[str]) -> dict[str, Any]:
    """One envoyproxy/ratelimit document as a kvgate ``domains`` entry."""
    if not isinstance(document, dict) or not isinstance(document.get("domain"), str):
        raise RatelimitImportError("not an envoyproxy/ratelimit config: expected a mapping with a "
                           "'domain' string")
    unknown = set(document) - {"domain", "descriptors"}
    if unknown:
        raise RatelimitImportError(f"unknown key {sorted(unknown)[0]!r} at the top level")
    return {"domain": document["domain"],
            "descriptors": _descriptors(document.get("descriptors") or [], "descriptors",
                                        algorithm, notes)}


def _descriptors(items: Any, where: str, algorithm: str, notes: list[str]) -> list[dict]:
    if not isinstance(items, list):
        raise RatelimitImportError(f"{where}: expected a list")
    return [_descriptor(item, f"{where}[{i}]", algorithm, notes) for i, item in enumerate(items)]


def _descriptor(item: Any, where: str, algorithm: str, notes: list[str]) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise RatelimitImportError(f"{where}: expected a mapping")
    for key in item:
        _boolean(item, key, where)
        if key in UNSUPPORTED and item[key]:
            raise RatelimitImportError(
                f"{where}.{key}: not supported by kvgate (it changes decisions)")
        if key in DROPPED:
            notes.append(f"{where}.{key}: dropped (metrics or response metadata only)")
        elif key not in DESCRIPTOR_KEYS and key not in UNSUPPORTED:
            raise RatelimitImportError(f"{where}: unknown key {key!r}")
    out: dict[str, Any] = {"key": item.get("key")}
    _scalar(item, "value", where)
    if item.get("value") not in (None, ""):
        out["value"] = str(item["value"])
        if "*" in out["value"][:-1]:
            # there a '*' is a wildcard only at the end (a prefix), elsewhere a character;
            # kvgate reads every '*' as a wildcard and has no literal one
            raise RatelimitImportError(
                f"{where}.value: {out['value']!r}: envoyproxy/ratelimit reads a '*' before the "
                "end as a plain character, which kvgate cannot express (its '*' matches "
                "anywhere)")
    if item.get("rate_limit") is not None:
        out["rate_limit"] = _limit(item["rate_limit"], f"{where}.rate_limit", algorithm)
    if item.get("shadow_mode"):
        out["shadow_mode"] = True
    if item.get("descriptors"):
        out["descriptors"] = _descriptors(item["descriptors"], f"{where}.descriptors",
                                          algorithm, notes)
    return out


def _limit(spec: Any, where: str, algorithm: str) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise RatelimitImportError(f"{where}: expected a mapping")
    unknown = set(spec) - set(LIMIT_KEYS)
    if unknown:
        raise RatelimitImportError(f"{where}: unknown key {sorted(unknown)[0]!r}")
    for key in spec:
        _boolean(spec, key, where)
    # absent and Go's zero values are left out, but requests_per_unit 0 (refuse every hit)
    # is a limit: `0 in (False, …)` must not drop it
    out = {k: v for k in LIMIT_KEYS
           if (v := spec.get(k)) is not None and v is not False and v != "" and v != []}
    if "unit" in out:
        out["unit"] = str(out["unit"]).lower()
    if not out.get("unlimited"):
        out["algorithm"] = algorithm
    return out


def _scalar(spec: dict[str, Any], key: str, where: str) -> None:
    """A list or mapping where a Go string goes is an error there (that service refuses the
    file); ``str()`` made ``value: [a, b]`` the value ``"['a', 'b']"``, which no descriptor
    Envoy sends matches: the limit silently never applied."""
    if isinstance(spec.get(key), list | dict):
        kind = "a list" if isinstance(spec[key], list) else "a mapping"
        raise RatelimitImportError(f"{where}.{key}: expected a string, got {kind}")


def _boolean(spec: dict[str, Any], key: str, where: str) -> None:
    """``shadow_mode: "yes"`` is an error there (a string into a Go bool), not a truthy value."""
    if key in BOOL_KEYS and spec[key] is not None and not isinstance(spec[key], bool):
        raise RatelimitImportError(f"{where}.{key}: expected true or false, got {spec[key]!r}")


def import_files(paths: list[Path], algorithm: str = "fixed_window") -> tuple[str, list[str]]:
    """The ``ratelimit:`` section for ``paths`` as YAML, and notes on what was dropped.
    Raises :class:`RatelimitImportError` naming the file."""
    domains, notes = [], []
    seen: dict[str, Path] = {}
    for path in paths:
        try:
            document, duplicates = load(read_text(path), _Loader)
            if duplicates:  # that service's yaml.v2 Unmarshal keeps the last one silently
                raise RatelimitImportError(duplicates[0])
            file_notes: list[str] = []
            domain = convert(document, algorithm, file_notes)
            if domain["domain"] in seen:
                raise RatelimitImportError(
                    f"domain {domain['domain']!r} is already in {seen[domain['domain']]}")
            seen[domain["domain"]] = path
            domains.append(domain)
            notes += [f"{path}: {note}" for note in file_notes]
        except OSError as exc:
            raise RatelimitImportError(f"{path}: cannot read: {exc.strerror}") from None
        except UnicodeDecodeError as exc:
            raise RatelimitImportError(
                f"{path}: cannot read: not UTF-8 text (byte {exc.start})") from None
        except YamlInputError as exc:
            raise RatelimitImportError(f"{path}: {exc}") from None
        except yaml.YAMLError as exc:
            raise RatelimitImportError(f"{path}: not valid YAML: {_one_line(str(exc))}") from None
        except RatelimitImportError as exc:
            raise RatelimitImportError(f"{path}: {exc}") from None
    section = {"domains": domains}
    _validate(section, paths)
    return yaml.safe_dump({"ratelimit": section}, sort_keys=False), notes


def _validate(section: dict[str, Any], paths: list[Path]) -> None:
    """The converted section must load as kvgate config (same checks as ``kvgate check``)."""
    from pydantic import ValidationError

    try:
        RateLimitSettings.model_validate(section)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        where = paths[loc[1]] if len(loc) > 1 and isinstance(loc[1], int) else paths[0]
        message = err["msg"].removeprefix("Value error, ")
        inside = format_loc(loc[2:])
        raise RatelimitImportError(f"{where}: {inside}: {message}" if inside
                                   else f"{where}: {message}") from None


def _one_line(text: str) -> str:
    return " ".join(text.split())
