"""Config errors: the exception, the unknown-key check, and the formatting of pydantic's errors
into messages that name the key path, the bad value and what is valid there."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from ft_framework.errors import UserError, did_you_mean, quoted, shortened

__all__ = ["ConfigError", "check_keys", "format_validation_error"]

# The most errors of one validation that a message lists (then "and N more"): a list of a
# hundred thousand bad values is one mistake to the user, and the message stays one line to read.
MAX_LISTED_ERRORS = 5


class ConfigError(UserError):
    """A config file or override is invalid; the message says which key and what to change."""


def _section_classes(annotation: Any) -> list[type[BaseModel]]:
    """The config section classes inside a field annotation (unwrapping Optional / unions)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found.extend(_section_classes(arg))
    return found


def check_keys(data: Any, cls: type[BaseModel], prefix: str) -> None:
    """Raises ConfigError for the first key of `data` that `cls` (recursively) does not define.

    Checked before pydantic runs so the message can list the valid keys and suggest the closest;
    pydantic's own "extra fields not permitted" names neither.
    """
    if not isinstance(data, dict):
        return
    fields = cls.model_fields
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            level = f"under {quoted(prefix[:-1])}" if prefix else "at the top level"
            raise ConfigError(
                f"unknown key {quoted(path)}{did_you_mean(key, fields)}; valid keys {level}: {', '.join(fields)}"
            )
        for sub in _section_classes(fields[key].annotation):
            check_keys(value, sub, f"{path}.")


def format_validation_error(err: ValidationError, where: str) -> str:
    """One line per error: ``  key.path: what is wrong (got <value>)``, under a heading with `where`.
    At most MAX_LISTED_ERRORS are listed; user values and keys are quoted through `quoted`."""
    lines = []
    errors = err.errors(include_url=False)
    for e in errors[:MAX_LISTED_ERRORS]:
        path = ".".join(shortened(str(p)) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "value_error":
            msg = msg.removeprefix("Value error, ")
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif e["type"] in ("literal_error", "enum") and "input" in e:
            msg = f"{msg} (got {quoted(e['input'])})"
        elif "input" in e and not isinstance(e["input"], dict):
            msg = f"{msg} (got {quoted(e['input'])})"
        lines.append(f"  {path}: {msg}")
    if len(errors) > MAX_LISTED_ERRORS:
        lines.append(f"  and {len(errors) - MAX_LISTED_ERRORS} more errors")
    head = f"invalid config{f' {where}' if where else ''}:"
    return "\n".join([head, *lines])
