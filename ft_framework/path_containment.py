"""Names read from a file a user hands us stay inside that file's directory: the one owner of the rule.

A checkpoint's manifest, its `latest` pointer, DCP's `.metadata` and a sweep's index name other
files by relative path. Whoever can edit such a file could otherwise make us open, size or hash any
file on the machine (`../../etc/...`, `/dev/...`, a named pipe that hangs the reader) and repeat what
it found in an error. So every such name is resolved here before anything opens it:

- it must be a non-empty relative path: no absolute path, no `..` component, no NUL byte;
- every symlink on its way is followed by reading the link (never the target), and must lead to a
  place inside the directory.

The walk touches only the directory's own entries (lstat and readlink), never anything outside
it, so a refused name's target is never opened, sized or hashed; a name the file system cannot look
up (too long, no permission) is refused the same way. `real_path_inside` returns what the walk found
(the real path, no symlink in it), which user_files.py opens without following a link. A refusal is one line naming the
entry, quoting at most about 100 characters of the name (`errors.quoted`). `links_leading_out`
applies the same walk to every symlink found in a directory tree (a checkpoint's files that the
readers open by their fixed names: the manifest, trainer_state.pt, the model's config and
tokenizer files).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from ft_framework.errors import UserError, quoted

__all__ = ["MAX_LINKS", "NameOutsideError", "links_leading_out", "real_path_inside", "resolve_inside"]

MAX_LINKS = 40  # symlinks followed for one name (as the kernel's own bound): a loop is refused


class NameOutsideError(UserError):
    """A name read from a file leads outside that file's directory (or is not a plain relative path)."""


def _is_inside(path: PurePosixPath, root: PurePosixPath) -> bool:
    return path == root or root in path.parents


def _walk(directory: str | Path, name: object, entry: str) -> tuple[PurePosixPath, PurePosixPath]:
    """(the directory's real path, the real path `name` leads to inside it), or NameOutsideError."""
    root = PurePosixPath(os.path.realpath(directory))  # the directory itself is the user's own choice

    def refuse(why: str) -> NameOutsideError:
        return NameOutsideError(f"{entry} {quoted(name)} in {directory} {why}: refused without opening what it "
                                f"names (every name read there must stay inside {directory}; it was not written by "
                                "ft_framework, or it was tampered with)")

    if not isinstance(name, str) or not name or "\0" in name:
        raise refuse("is not a file name")
    given = PurePosixPath(name)
    if given.is_absolute():
        raise refuse("is an absolute path")
    if ".." in given.parts:
        raise refuse("climbs out with '..'")
    pending = list(given.parts)
    current, links = root, 0  # `current` is always a real path (no symlink in it) inside root
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":  # only from a symlink's target: the parent of a real path is its real parent
            current = current.parent
            if not _is_inside(current, root):
                raise refuse("leads outside it through a symlink")
            continue
        candidate = current / part
        try:
            mode = os.lstat(candidate).st_mode
        except (FileNotFoundError, NotADirectoryError):
            current = candidate  # missing (and so is the rest): the reader reports it
            continue
        except OSError as exc:  # a name the file system cannot look up: too long, or no permission
            raise refuse(f"cannot be looked up ({exc.strerror or type(exc).__name__})") from None
        if not stat.S_ISLNK(mode):
            current = candidate
            continue
        links += 1
        if links > MAX_LINKS:
            raise refuse(f"passes more than {MAX_LINKS} symlinks (a loop)")
        try:
            target = PurePosixPath(os.readlink(candidate))
        except OSError as exc:  # replaced meanwhile
            raise refuse(f"cannot be looked up ({exc.strerror or type(exc).__name__})") from None
        if target.is_absolute():
            # Inside only when it starts with the directory's real path (which holds no symlink).
            if target.parts[:len(root.parts)] != root.parts:
                raise refuse("leads outside it through a symlink")
            current, pending = root, list(target.parts[len(root.parts):]) + pending
        else:
            pending = list(target.parts) + pending
    return root, current


def resolve_inside(directory: str | Path, name: object, *, entry: str) -> Path:
    """The path `name` (read from a file in `directory`) designates, once it is certain that it stays
    inside `directory`; `entry` says where the name was read (e.g. "ft_checkpoint.json's files entry").
    Raises NameOutsideError, one line, without touching anything outside `directory`. A name whose
    file does not exist resolves too: the caller's reader says it is missing."""
    _walk(directory, name, entry)
    return Path(directory) / name  # as given (the walk proved where it leads): messages keep the user's spelling


def real_path_inside(directory: str | Path, name: object, *, entry: str) -> tuple[Path, PurePosixPath]:
    """As `resolve_inside`, but what the walk found: the directory's real path and, relative to it,
    the real path (no symlink in it) that `name` leads to. user_files.py opens that path component
    by component without following links, so a link planted after this walk is refused, not followed."""
    root, real = _walk(directory, name, entry=entry)
    return Path(root), real.relative_to(root)


def links_leading_out(directory: str | Path) -> list[str]:
    """One line per symlink under `directory` that leads outside it (or is a loop); empty when there
    is none. Only the tree's own entries are read: no symlink is followed into, and no target is stat'ed."""
    directory = Path(directory)
    problems: list[str] = []
    pending = [directory]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for item in sorted(entries, key=lambda e: e.name):
                if item.is_symlink():
                    try:
                        resolve_inside(directory, str(Path(item.path).relative_to(directory)), entry="the symlink")
                    except NameOutsideError as exc:
                        problems.append(str(exc))
                elif item.is_dir(follow_symlinks=False):
                    pending.append(Path(item.path))
    return problems
