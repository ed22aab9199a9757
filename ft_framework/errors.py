"""The one exception type for mistakes a user can fix (a config value, a data file, a path), and the
"did you mean" hint that such messages share.

Anything raised as :class:`UserError` is meant to be shown to the user as one line (what is wrong,
where, and what is valid), without a traceback; every other exception is a bug or an environment
failure and keeps its traceback.
"""

from __future__ import annotations

import difflib
import reprlib
from typing import Iterable

__all__ = ["MissingPath", "QUOTE_LIMIT", "UserError", "did_you_mean", "quoted", "shortened"]

# The most characters of a user's value (or key) that an error message shows: a message must stay
# one readable line whatever the user gave (a 1 MB string, a 100k-element list, an alias bomb).
QUOTE_LIMIT = 100


class UserError(ValueError):
    """An error the user can fix; the message names what, where, and what is valid.

    A ValueError subclass so existing ``except ValueError`` callers keep catching it.
    """


class MissingPath(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (still a FileNotFoundError for callers)."""


# Bounded work as well as bounded output: reprlib looks at a few levels and elements only, so a
# nested value that shares its parts (YAML aliases) is never walked in full.
_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel = 3
_REPR.maxtuple = _REPR.maxlist = _REPR.maxarray = _REPR.maxdict = _REPR.maxset = _REPR.maxfrozenset = 4
_REPR.maxdeque = 4
_REPR.maxstring = _REPR.maxother = QUOTE_LIMIT
_REPR.maxlong = 40


def shortened(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text` on one line (whitespace runs become one space), cut to at most `limit` characters."""
    text = " ".join(text[: 4 * limit].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def quoted(value: object, limit: int = QUOTE_LIMIT) -> str:
    """How an error message shows a value or key the user gave: its repr, one line, at most `limit`
    characters. Every message that quotes user input goes through here."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int longer than Python converts to text (sys.get_int_max_str_digits())
        text = f"<{type(value).__name__} too long to show>"
    return shortened(text, limit)


def did_you_mean(key: object, choices: Iterable[object]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to `key`, or "" when none is close."""
    close = difflib.get_close_matches(str(key)[:QUOTE_LIMIT], [str(c) for c in choices], n=1)
    return f" (did you mean {quoted(close[0])}?)" if close else ""
