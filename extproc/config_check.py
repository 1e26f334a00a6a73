"""Every problem in a config file, in one run.

pydantic stops where a layer fails: field errors hide the cross-references (an unknown
tier is only checked once every field is valid), and an unknown key says "Extra inputs are
not permitted". A config mistake costs a deploy cycle, so ``kvgate check`` (and a failing
``kvgate serve``) reports it all at once: each field error with its path, an unknown key
with the closest known one, the cross-references — checked on a copy with the broken
values taken out, so they need not wait for the fields — and the files the config names.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import re
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

ROUNDS = 8  # of taking out broken values before the cross-references are given up on
TOP_LISTS = ("tenants", "pools")  # problems cite their entries by index
_GONE = object()
STAND_INS: dict[str, Callable[[str], Any]] = {  # valid, unique, and referring to nothing
    "name": lambda where: f"<{where}>",
    "api_keys": lambda where: ["sha256:" + hashlib.sha256(where.encode()).hexdigest()],
    "models": lambda where: [{"name": f"<{where}>"}],
}


def explain(data: Any, error: ValidationError, root: type[BaseModel]) -> list[str]:
    """``error``'s field problems, then the cross-reference problems of ``data``."""
    found = _field_problems(error, root)
    for problem in [*_reference_problems(data, error, root), *_duplicate_descriptors(data),
                    *_duplicate_pools(data)]:
        if problem not in found:
            found.append(problem)
    return found


def _duplicate_pools(data: Any) -> list[str]:
    """Pool names and models given twice, read from the file as written: a pool whose own
    check fails (no endpoints, an engine that takes no priority) is taken out before the
    cross-references, so a second pool of its name, or serving its model, was reported
    only once it was fixed."""
    found: list[str] = []
    names: set[str] = set()
    owners: dict[str, str] = {}
    for p, pool in _items(data.get("pools") if isinstance(data, dict) else None):
        name = pool.get("name")
        if not isinstance(name, str) or not name:
            continue
        if name in names:
            found.append(f"pools[{p}].name: duplicate pool {name!r}")
        names.add(name)
        models = pool.get("models")  # not a list (a bare name, a number): a field error
        for m, model in enumerate(models if isinstance(models, list) else []):
            model = model.get("name") if isinstance(model, dict) else model
            if not isinstance(model, str) or not model:
                continue
            if model in owners:
                found.append(f"pools[{p}].models[{m}]: {model!r} already served by "
                             f"{owners[model]!r}")
            owners[model] = name  # as Config's own check names the owner
    return found


def _duplicate_descriptors(data: Any) -> list[str]:
    """The ``ratelimit:`` section's duplicates, read from the file as written: pydantic
    checks a descriptor list only once each of its entries is valid, so a duplicate beside a
    broken sibling was reported only after that was fixed."""
    found: list[str] = []
    section = data.get("ratelimit") if isinstance(data, dict) else None
    domains = section.get("domains") if isinstance(section, dict) else None
    if not isinstance(domains, list):
        return found
    names = [d.get("domain") for d in domains if isinstance(d, dict)]
    for name in dict.fromkeys(n for n in names if isinstance(n, str) and names.count(n) > 1):
        found.append(f"ratelimit.domains: duplicate domain {name!r}")

    def level(items: Any, where: str) -> None:
        if not isinstance(items, list):
            return
        seen = set()
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                continue
            key, value = item.get("key"), item.get("value")
            if isinstance(key, str) and (value is None or isinstance(value, str)):
                if (key, value) in seen:
                    what = "any value" if value is None else f"value {value!r}"
                    found.append(f"{where}: duplicate descriptor: key {key!r} with {what}")
                seen.add((key, value))
            level(item.get("descriptors"), f"{where}[{i}].descriptors")

    for d, domain in enumerate(domains):
        if isinstance(domain, dict):
            level(domain.get("descriptors"), f"ratelimit.domains[{d}].descriptors")
    return found


def _field_problems(error: ValidationError, root: type[BaseModel]) -> list[str]:
    found: list[str] = []
    for err in error.errors():
        loc = _clean(err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error" and not loc:
            found.extend(message.split("; "))
        elif err["type"] == "extra_forbidden":
            found.append(f"{format_loc(loc)}: {_unknown_key(loc, root)}")
        else:
            found.append(f"{format_loc(loc) or '<root>'}: {message}")
    return found


def format_loc(loc: Iterable[Any]) -> str:
    """``('pools', 0, 'endpoints')`` → ``pools[0].endpoints``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else ("." if path else "") + str(part)
    return path


def _clean(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Without pydantic's validator tags (``function-after[...]``)."""
    return tuple(p for p in loc if not (isinstance(p, str) and p.startswith("function-")))


# -- unknown keys: did you mean ---------------------------------------------------------------


def _unknown_key(loc: tuple[Any, ...], root: type[BaseModel]) -> str:
    key = str(loc[-1])
    model = _model_at(loc[:-1], root)
    if model is None:
        return f"unknown key {key!r}"
    removed = getattr(model, "REMOVED", {})
    if key in removed:
        return f"removed, {removed[key]}"
    known = sorted(model.model_fields)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"unknown key {key!r}: did you mean {close[0]!r}?"
    return f"unknown key {key!r} (known: {', '.join(known)})"


def _model_at(loc: tuple[Any, ...], root: type[BaseModel]) -> type[BaseModel] | None:
    """The model whose fields the value at ``loc`` holds (a list index or a dict key — a
    tier's name — steps over the container, not into a field)."""
    model, in_container = root, False
    for part in loc:
        if in_container:
            in_container = False
            continue
        field = model.model_fields.get(part) if isinstance(part, str) else None
        inner = None if field is None else _model_in(field.annotation)
        if field is None or inner is None:
            return None
        model, in_container = inner, _is_container(field.annotation)
    return None if in_container else model


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if (found := _model_in(arg)) is not None:
            return found
    return None


def _is_container(annotation: Any) -> bool:
    origin = get_origin(annotation)
    if origin in (list, dict):
        return True
    if origin in (Union, types.UnionType):
        return any(_is_container(a) for a in get_args(annotation))
    return False


# -- cross-references, past the field errors --------------------------------------------------


def _reference_problems(data: Any, error: ValidationError,
                        root: type[BaseModel]) -> list[str]:
    """The model-level problems (cross-references) of ``data`` with every broken value taken
    out — a default stands in, or the entry holding it goes — until only those remain."""
    if not isinstance(data, dict):
        return []
    pruned = copy.deepcopy(data)
    # original index of every tenant and pool still in ``pruned``: problems cite those
    kept = {name: list(range(len(pruned[name]))) for name in TOP_LISTS
            if isinstance(pruned.get(name), list)}
    errors = error.errors()
    for _ in range(ROUNDS):
        if not _prune(pruned, (e for e in errors if _clean(e["loc"])), kept):
            return []
        try:
            root.model_validate(pruned)
        except ValidationError as again:
            errors = again.errors()
            if all(not _clean(e["loc"]) for e in errors):
                return [_renumber(p, kept) for p in _field_problems(again, root)]
            continue
        return []
    return []


def _prune(data: dict[str, Any], errors: Iterable[ErrorDetails],
           kept: dict[str, list[int]]) -> bool:
    """Take out the value each error is about (when it is missing: the entry that needs
    it); whether anything was taken out."""
    marked = False
    for err in errors:
        loc = _clean(err["loc"])
        if _stand_in(data, loc if err["type"] == "missing" else _existing(data, loc)):
            marked = True
            continue
        present = _existing(data, loc)  # missing: the entry that needs it
        if not present:
            continue  # the file itself
        parent = _get(data, present[:-1])
        if parent[present[-1]] is not _GONE:
            parent[present[-1]] = _GONE
            marked = True
    for name, indexes in kept.items():
        if isinstance(data.get(name), list):
            indexes[:] = [i for i, v in zip(indexes, data[name], strict=True) if v is not _GONE]
    _sweep(data)
    _keep_one_entry(data, kept)
    return marked


def _keep_one_entry(data: dict[str, Any], kept: dict[str, list[int]]) -> None:
    """A list of tenants or pools every entry of which was taken out gets one stand-in
    entry (valid, and referring to nothing), so the others' cross-references are still
    checked: an empty list is a problem of its own, and would end the check there."""
    for name, indexes in kept.items():
        if data.get(name) != []:
            continue
        where = f"<{name} stand-in>"
        if name == "pools":
            entry: dict[str, Any] = {"name": where, "models": [{"name": where}],
                                     "endpoints": ["127.0.0.1:1"]}
        elif isinstance(data.get("tiers"), dict) and data["tiers"]:
            entry = {"name": where, "tier": next(iter(data["tiers"])),
                     "api_keys": STAND_INS["api_keys"](where)}
        else:
            continue
        data[name].append(entry)
        indexes.append(-1)  # not in the file: no problem cites it


def _stand_in(data: dict[str, Any], loc: tuple[Any, ...]) -> bool:
    """Put a stand-in for a broken required value of a tenant or pool (so the rest of the
    entry is still checked); whether one was put."""
    if len(loc) != 3 or loc[0] not in TOP_LISTS or loc[2] not in STAND_INS:
        return False
    if _existing(data, loc[:2]) != loc[:2] or not isinstance(entry := _get(data, loc[:2]), dict):
        return False
    stand_in = STAND_INS[loc[2]](format_loc(loc))
    if entry.get(loc[2]) == stand_in:
        return False
    entry[loc[2]] = stand_in
    return True


def _renumber(problem: str, kept: dict[str, list[int]]) -> str:
    """``tenants[1]`` of the pruned copy → its index in the file."""
    match = re.match(r"(tenants|pools)\[(\d+)\]", problem)
    if match is None or match[1] not in kept or int(match[2]) >= len(kept[match[1]]) or (
            kept[match[1]][int(match[2])] < 0):
        return problem
    return f"{match[1]}[{kept[match[1]][int(match[2])]}]{problem[match.end():]}"


def _existing(data: Any, loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """The longest prefix of ``loc`` that is present in ``data``."""
    node, found = data, ()
    for part in loc:
        present = (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if not present:
            break
        node, found = node[part], (*found, part)
    return found


def _get(data: Any, loc: tuple[Any, ...]) -> Any:
    for part in loc:
        data = data[part]
    return data


def _sweep(node: Any) -> None:
    """Remove what :func:`_prune` marked (after marking, so indexes held meanwhile stay)."""
    if isinstance(node, dict):
        for key in [k for k, v in node.items() if v is _GONE]:
            del node[key]
        children: Iterable[Any] = node.values()
    elif isinstance(node, list):
        node[:] = [v for v in node if v is not _GONE]
        children = node
    else:
        return
    for child in children:
        _sweep(child)


# -- files the config names -------------------------------------------------------------------


def file_problems(data: Any) -> list[str]:
    """Files named in ``data`` (tokenizers, chat templates, TLS material, secrets) that
    cannot be read here: kvgate would fail on them when it starts, or later."""
    return [f"{format_loc(loc)}: cannot read {value}: {problem}"
            for loc, value in _file_fields(data)
            if (problem := _unreadable(Path(value))) is not None]


def _file_fields(data: Any) -> Iterator[tuple[tuple[Any, ...], str]]:
    if not isinstance(data, dict):
        return
    tls = (data.get("server") or {}).get("tls") if isinstance(data.get("server"), dict) else None
    for key in ("cert_file", "key_file", "client_ca_file"):
        if isinstance(tls, dict) and isinstance(tls.get(key), str):
            yield ("server", "tls", key), tls[key]
    for p, pool in _items(data.get("pools")):
        for m, model in _items(pool.get("models")):
            for key in ("tokenizer", "chat_template"):
                if isinstance(model.get(key), str):
                    yield ("pools", p, "models", m, key), model[key]
        secret = pool.get("upstream_api_key")
        if isinstance(secret, dict) and isinstance(secret.get("file"), str):
            yield ("pools", p, "upstream_api_key", "file"), secret["file"]


def _items(value: Any) -> Iterator[tuple[int, dict[str, Any]]]:
    if isinstance(value, list):
        yield from ((i, v) for i, v in enumerate(value) if isinstance(v, dict))


def _unreadable(path: Path) -> str | None:
    """Why ``path`` cannot be read, or None. Every OSError is this file's problem, the
    ``stat`` behind ``exists()`` included: a name too long (ENAMETOOLONG) or a path through
    a file (ENOTDIR) raised there, and ended ``kvgate check`` on one line naming neither the
    config file nor the key, with every other problem unreported."""
    try:
        if not path.exists():
            return "no such file"
        if not path.is_file():
            return "not a file"
        with path.open("rb") as handle:
            handle.read(1)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None
