"""The one exception type for mistakes a user can fix (a config value, a data file, a path), and the
"did you mean" hint that such messages share.

Anything raised as :class:`UserError` is meant to be shown to the user as one line (what is wrong,
where, and what is valid), without a traceback; every other exception is a bug or an environment
failure and keeps its traceback.
"""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["MissingPath", "UserError", "did_you_mean"]


class UserError(ValueError):
    """An error the user can fix; the message names what, where, and what is valid.

    A ValueError subclass so existing ``except ValueError`` callers keep catching it.
    """


class MissingPath(UserError, FileNotFoundError):
    """A file or directory the user named does not exist (still a FileNotFoundError for callers)."""


def did_you_mean(key: object, choices: Iterable[object]) -> str:
    """`` (did you mean 'x'?)`` for the choice closest to `key`, or "" when none is close."""
    close = difflib.get_close_matches(str(key), [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
