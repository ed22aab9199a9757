"""Turning YAML text and `key.sub=value` overrides into the raw config mapping that the schema
validates: the YAML reader, the override parser, the one set-path helper, and the task_overrides
engine (merging the entry of the config's task). Nothing here knows the schema.

    data = apply_overrides(read_yaml("configs/quickstart.yaml"), ["training.max_steps=10"])
    data = resolve_task_overrides(data)     # the active task's values merged, the map dropped
"""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

from ft_framework.data.tasks import GLUE_TASK_NAMES
from ft_framework.errors import UserError, did_you_mean, quoted, shortened
from ft_framework.user_files import MissingFile, read_text

from ft_framework.config.errors import ConfigError
from ft_framework.config.yaml_loader import ALIAS_NODE_LIMIT, AliasLimit, DuplicateKey, load_yaml, marks_text

__all__ = ["read_yaml", "parse_override", "set_path", "apply_overrides", "nest_dotted", "deep_merge",
           "normalized_task_overrides", "resolve_task_overrides"]


def yaml_error_text(err: yaml.YAMLError, of: str = "") -> str:
    """What is wrong with a YAML text, on one line; `of` follows each position (" of the value")."""
    if isinstance(err, DuplicateKey):
        return (f"key {quoted(err.key)} is given twice ({marks_text(err.first, err.second)}{of}); "
                "give each key once")
    if isinstance(err, AliasLimit):
        at = f"line {err.mark.line + 1}, column {err.mark.column + 1}{of}"
        if err.recursive:
            return f"alias *{shortened(err.anchor)} ({at}) refers to the node that holds it; write the values out"
        return (f"YAML aliases expand to more than {ALIAS_NODE_LIMIT} nodes (alias *{shortened(err.anchor)}, {at}); "
                "refused: write the repeated values out")
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err)
    at = f" (line {mark.line + 1}, column {mark.column + 1}{of})" if mark is not None else ""
    return f"not valid YAML{at}: {shortened(problem)}"


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Reads a YAML mapping (numbers like 2e-5 are floats; see yaml_loader for what is refused)."""
    path = Path(path)
    try:  # a regular file (never a named pipe), UTF-8, bounded: user_files.py
        text = read_text(path)
    except MissingFile:
        raise ConfigError(f"config file {str(path)!r} not found") from None
    except UserError as e:
        raise ConfigError(str(e)) from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: {yaml_error_text(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """Splits `a.b.c=value` into (["a", "b", "c"], value parsed as YAML)."""
    key, sep, raw = text.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"override {quoted(text)} must look like section.key=value (e.g. training.max_steps=10)")
    try:
        value = load_yaml(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {quoted(text)}: {yaml_error_text(e, ' of the value')}") from None
    return [p.strip() for p in parts], value


def set_path(data: dict[str, Any], path: str | Sequence[str], value: Any, where: str = "") -> None:
    """Sets `path` (``"a.b.c"`` or ``["a", "b", "c"]``) in the nested mapping `data` to a copy of
    `value`, creating missing sections, replacing what was there. `where` prefixes the path in errors
    (e.g. the task_overrides entry it comes from). Overrides, task overrides and sweep grids all
    set values through this one function, so they agree on what a path means."""
    if isinstance(path, str):
        path = path.split(".")
    node = data
    for i, part in enumerate(path[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            bad = ".".join([*([where] if where else []), *path[: i + 1]])
            raise ConfigError(f"cannot set {quoted('.'.join(path))}: {quoted(bad)} is a value, not a section")
        node = child
    node[path[-1]] = deepcopy(value)


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of `data` with each `key.sub=value` override set.

    Each key may be set once: an override that repeats another's key, or lies inside a section
    another one sets whole (or holds one that another sets), is refused, since one of the two
    would silently replace or change the other."""
    out = deepcopy(data)
    given: list[list[str]] = []
    for number, text in enumerate(overrides, start=1):
        path, value = parse_override(text)
        for earlier_number, earlier in enumerate(given, start=1):
            _check_overlap(earlier, earlier_number, path, number)
        given.append(path)
        set_path(out, path, value)
    return out


def _check_overlap(earlier: list[str], earlier_number: int, path: list[str], number: int) -> None:
    shorter = min(len(earlier), len(path))
    if earlier[:shorter] != path[:shorter]:
        return
    if len(earlier) == len(path):
        relation = "repeats"
    elif len(path) > len(earlier):
        relation = "lies inside"
    else:
        relation = "holds"
    raise ConfigError(f"override {quoted('.'.join(path))} (argument {number}) {relation} "
                      f"{quoted('.'.join(earlier))} (argument {earlier_number}): one would silently replace or "
                      "change the other; set each key once (several keys of one section: one override each, or "
                      "one mapping value)")


def nest_dotted(flat: dict[str, Any], where: str) -> dict[str, Any]:
    """Expands dotted keys ({"a.b": 1}) into nested dicts ({"a": {"b": 1}}), recursively."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        if isinstance(value, dict):
            value = nest_dotted(value, f"{where}.{shortened(str(key))}")
        path = str(key).split(".")
        existing = out
        for part in path[:-1]:
            existing = existing.setdefault(part, {})
            if not isinstance(existing, dict):
                raise ConfigError(f"{where}: key {quoted(key)} conflicts with a value set earlier")
        if isinstance(value, dict) and isinstance(existing.get(path[-1]), dict):
            existing[path[-1]] = deep_merge(existing[path[-1]], value)
        else:
            existing[path[-1]] = value
    return out


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """`update` merged into a copy of `base`: dicts merge key by key, everything else replaces."""
    out = deepcopy(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = deepcopy(value)
    return out


def normalized_task_overrides(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    overrides = data.get("task_overrides") or {}
    if not isinstance(overrides, dict):
        raise ConfigError("task_overrides must map a GLUE task name to a mapping of values")
    out = {}
    for task, values in overrides.items():
        where = f"task_overrides.{task}"
        if task not in GLUE_TASK_NAMES:
            raise ConfigError(f"unknown task {quoted(task)} in task_overrides{did_you_mean(task, GLUE_TASK_NAMES)};"
                              f" valid: {', '.join(GLUE_TASK_NAMES)}")
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(f"{where} must be a mapping of values, got {quoted(values)}")
        nested = nest_dotted(values, where)
        if "task_overrides" in nested or "task" in (nested.get("data") or {}):
            raise ConfigError(f"{where} cannot set task_overrides or data.task")
        out[task] = nested
    return out


def resolve_task_overrides(data: dict[str, Any], pinned: Sequence[str] = ()) -> dict[str, Any]:
    """Merges the entry of `task_overrides` for the config's data.task and drops the map.

    `pinned` overrides (command-line `key=value`) are applied again on top, so they win over the
    task's values.
    """
    overrides = normalized_task_overrides(data)
    base = {k: v for k, v in data.items() if k != "task_overrides"}
    task = (base.get("data") or {}).get("task") if isinstance(base.get("data"), dict) else None
    merged = deep_merge(base, overrides.get(task, {})) if task in overrides else base
    return apply_overrides(merged, [o for o in pinned if not o.strip().startswith("task_overrides.")])
