"""Files a user hands us, opened one way: the one owner of "open a file a user handed us".

A checkpoint, a sweep store, a config, a data file: whoever made them may have put a named pipe
where a file belongs (its open blocks forever), a link to /dev/zero (a read without end) or to a
file outside (read, and quoted back in an error), a manifest of 100 MB, or JSON nested 10^5 deep
(a RecursionError). Every reader of such a file opens it here:

- a file inside a root (a checkpoint, a sweep store): its name is resolved by
  `path_containment.real_path_inside` (no `..`, no absolute path, every symlink on the way leads
  inside), then the real path that walk found is opened component by component from the root,
  each with O_NOFOLLOW: a symlink planted after the walk is refused, never followed;
- a file the user named themselves (a config, a data file): the path is theirs, its links are
  followed;
- either way the file must be a regular file: refused before the open when a stat shows it is
  not, and checked again on the opened descriptor (fstat), which closes the window between the
  two; the open itself never blocks (O_NONBLOCK: a named pipe swapped in meanwhile opens at once,
  and is refused);
- what is read whole (JSON records, a config, a `latest` pointer) is bounded in bytes
  (WHOLE_FILE_LIMIT, or less where the caller says) and in nesting (NESTING_LIMIT); text must be
  UTF-8, and the error names the line and the byte offset.

Every refusal is a UserFileError (a UserError): one line naming the file. A missing file is
MissingFile (a UserFileError that is also a FileNotFoundError), so that a caller for which
"missing" means "not written yet" keeps saying so.

Not detected: a hard link. It is the file itself, and whoever can make one inside a checkpoint
could read its target already.

A directory a user names for us to write into (logging.output_dir, data.token_cache_dir) is made
here too (`make_writable_directory`): a file in its place or above it, a directory that cannot be
made or is not writable, is one line naming the key and the path.
"""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ft_framework.errors import MissingPath, UserError, quoted
from ft_framework.path_containment import NameOutsideError, links_leading_out, real_path_inside, resolve_inside

__all__ = ["MissingFile", "NESTING_LIMIT", "NO_REMOTE_CODE", "UserFileError", "WHOLE_FILE_LIMIT", "check_nesting",
           "file_size", "make_writable_directory", "open_binary", "read_bytes", "read_json", "read_text",
           "refused_entries", "text_stream"]

# The most bytes of a file read whole (a status or results record, a manifest, a config): far above
# any that ft_framework writes (a manifest of 10,000 ranks is about 2 MB), far below what fills memory.
WHOLE_FILE_LIMIT = 64 << 20
# The keyword arguments every from_pretrained of ours passes (models, configs, tokenizers, GGUF files):
# a model directory a user hands us is data too, so a model's own code (a config.json's auto_map) is
# never run, and transformers never stops to ask whether to run it (its default, None, prompts "run the
# custom code? [y/N]" when it does not know the model type). Here, below every layer that loads a model.
NO_REMOTE_CODE: dict[str, bool] = {"trust_remote_code": False}
# The deepest a JSON or YAML value a user hands us may nest (ours nest at most 6 or 7 levels);
# Python's parsers and every walk over the value then stay far from the interpreter's recursion limit.
NESTING_LIMIT = 100

_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK


class UserFileError(UserError):
    """A file a user handed us cannot be read as what it should be; one line naming it."""


class MissingFile(UserFileError, MissingPath):
    """The file does not exist (a FileNotFoundError too)."""


def _shown(path: object) -> str:
    text = str(path)
    return text if text.isprintable() else quoted(text)


def _kind(mode: int) -> str | None:
    """What a file of `mode` is, when it is not a regular file (None when it is)."""
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symlink")):
        if test(mode):
            return name
    return "not a plain file"


def _not_regular(path: object, mode: int) -> UserFileError:
    return UserFileError(f"{_shown(path)} is {_kind(mode)}, not a regular file: refused without reading it "
                         "(ft_framework reads regular files only)")


def _missing(path: object) -> MissingFile:
    return MissingFile(f"{_shown(path)} does not exist")


def _open_beneath(root: Path, parts: tuple[str, ...], path: object) -> int:
    """The real path `parts` below the real directory `root`, opened component by component without
    following a link (a link there now was planted after the containment walk: refused)."""
    if not parts:
        raise _not_regular(path, stat.S_IFDIR)
    try:
        directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _missing(path) from None
    def planted(name: str) -> bool:
        try:
            return stat.S_ISLNK(os.stat(name, dir_fd=directory, follow_symlinks=False).st_mode)
        except OSError:
            return False

    part = parts[0]
    try:
        for part in parts[:-1]:
            below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=directory)
            os.close(directory)
            directory = below
        part = parts[-1]
        mode = os.stat(part, dir_fd=directory, follow_symlinks=False).st_mode
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        return os.open(part, _READ | os.O_NOFOLLOW, dir_fd=directory)
    except OSError as exc:
        if isinstance(exc, UserFileError):
            raise
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and planted(part):
            # O_NOFOLLOW met a symlink that the containment walk did not see
            raise UserFileError(f"{_shown(path)} changed while it was opened (a symlink appeared on its way): "
                                "refused without reading it") from None
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise _missing(path) from None
        raise
    finally:
        os.close(directory)


def _open_fd(path: str | Path, root: str | Path | None, entry: str) -> int:
    """A read-only descriptor of the regular file `path` (inside `root` when given)."""
    if root is None:
        try:
            mode = os.stat(path).st_mode
            if not stat.S_ISREG(mode):
                raise _not_regular(path, mode)
            fd = os.open(path, _READ)
        except (FileNotFoundError, NotADirectoryError):
            raise _missing(path) from None
    else:
        name = str(Path(path).relative_to(root))
        real_root, real = real_path_inside(root, name, entry=entry)
        fd = _open_beneath(real_root, real.parts, path)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # replaced between the stat and the open
            raise _not_regular(path, mode)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_binary(path: str | Path, *, root: str | Path | None = None, entry: str = "the file") -> BinaryIO:
    """`path` opened for reading bytes, once it is certain to be a regular file (and, with `root`,
    inside that directory: `path` is `root / name`, `entry` says what the name is in the refusal)."""
    return os.fdopen(_open_fd(path, root, entry), "rb")


def file_size(path: str | Path, *, root: str | Path | None = None, entry: str = "the file") -> int:
    """The size of the regular file `path` (inside `root` when given), read from its descriptor."""
    fd = _open_fd(path, root, entry)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_bytes(path: str | Path, *, root: str | Path | None = None, limit: int | None = WHOLE_FILE_LIMIT,
               entry: str = "the file") -> bytes:
    """The bytes of the regular file `path`; more than `limit` (None: no bound) is refused unread."""
    with open_binary(path, root=root, entry=entry) as f:
        if limit is None:
            return f.read()
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
        if size > limit or len(data) > limit:
            raise UserFileError(f"{_shown(path)} holds {max(size, len(data))} bytes, more than the {limit} a file "
                                "of its kind may hold here: refused without reading it")
        return data


def read_text(path: str | Path, *, root: str | Path | None = None, limit: int | None = WHOLE_FILE_LIMIT,
              entry: str = "the file") -> str:
    """The UTF-8 text of the regular file `path` (a byte-order mark is dropped); text that is not
    UTF-8 is refused in one line naming the line and the byte offset of the first bad byte."""
    data = read_bytes(path, root=root, limit=limit, entry=entry)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise UserFileError(f"{_shown(path)}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x} at byte offset "
                            f"{exc.start}, column {column}); save the file as UTF-8") from None


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def check_nesting(value: Any, where: str, limit: int = NESTING_LIMIT) -> None:
    """Refuses (one line) a value of nested lists and mappings deeper than `limit`; walked without
    recursion, each container once."""
    pending, seen = [(value, 1)], set()
    while pending:
        item, depth = pending.pop()
        if not isinstance(item, (dict, list, tuple)) or id(item) in seen:
            continue
        if depth > limit:
            raise UserFileError(f"{where}: nested deeper than {limit} levels: refused (what ft_framework writes "
                                "nests a few levels)")
        seen.add(id(item))
        children = item.values() if isinstance(item, dict) else item
        pending.extend((child, depth + 1) for child in children)


def read_json(path: str | Path, *, root: str | Path | None = None, limit: int | None = WHOLE_FILE_LIMIT,
              expect: type | None = dict, entry: str = "the file") -> Any:
    """The JSON value of the regular file `path`: at most `limit` bytes of UTF-8, nested at most
    NESTING_LIMIT deep, of type `expect` (dict: a JSON object; None: any); anything else is refused
    in one line naming the file."""
    text = read_text(path, root=root, limit=limit, entry=entry)
    try:
        value = json.loads(text)
    except RecursionError:
        raise UserFileError(f"{_shown(path)}: JSON nested deeper than {NESTING_LIMIT} levels: refused") from None
    except json.JSONDecodeError as exc:
        raise UserFileError(f"{_shown(path)}: not valid JSON ({exc.msg} at line {exc.lineno}, column "
                            f"{exc.colno})") from None
    check_nesting(value, _shown(path))
    if expect is not None and not isinstance(value, expect):
        raise UserFileError(f"{_shown(path)}: holds a JSON {_JSON_TYPES.get(type(value), type(value).__name__)}, "
                            f"expected {'an' if _JSON_TYPES.get(expect, '')[:1] in 'aeiou' else 'a'} "
                            f"{_JSON_TYPES.get(expect, expect.__name__)}")
    return value


def refused_entries(directory: str | Path) -> list[str]:
    """One line per entry under `directory` that no reader may open: a symlink leading out of it
    (path_containment.links_leading_out), or an entry that is neither a regular file nor a
    directory (a named pipe, a device, a socket; a symlink inside to one). Empty when there is
    none. Nothing is opened: the walk reads the tree's own entries, and stats a link's target only
    once it is known to stay inside."""
    directory = Path(directory)
    problems = links_leading_out(directory)
    pending = [directory]
    while pending:
        with os.scandir(pending.pop()) as entries:
            for item in sorted(entries, key=lambda e: e.name):
                try:
                    if item.is_dir(follow_symlinks=False):
                        pending.append(Path(item.path))
                        continue
                    if item.is_file(follow_symlinks=False):
                        continue
                    if item.is_symlink():
                        try:
                            resolve_inside(directory, str(Path(item.path).relative_to(directory)), entry="the symlink")
                        except NameOutsideError:
                            continue  # leads out: said above, and never stat'ed
                        mode = os.stat(item.path).st_mode
                        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
                            continue
                    else:
                        mode = item.stat(follow_symlinks=False).st_mode
                except OSError:
                    continue  # removed meanwhile, or a dangling link inside: its reader says it is missing
                problems.append(str(_not_regular(item.path, mode)))
    return problems


def make_writable_directory(directory: str | Path, *, key: str) -> Path:
    """Creates `directory` (with its parents) and checks that this process can write into it; a file
    in its place or above it, a directory that cannot be created, or one this user cannot write into
    is a UserError: one line naming `key` (the config key that names the directory) and the path."""
    root = Path(directory)
    for part in (root, *root.parents):
        if part.exists() and not part.is_dir():
            where = f"{str(root)!r}" if part == root else f"{str(root)!r}: {str(part)!r}"
            raise UserError(f"{key} {where} is a file, not a directory; {key} names a directory: choose another "
                            "path")
        if part.exists():
            break
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{key} {str(root)!r} cannot be created ({exc.strerror}: {exc.filename}); choose a "
                        "directory you can write to") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise UserError(f"{key} {str(root)!r} is not writable by this user; choose a directory you can write to, "
                        "or fix its permissions")
    return root


def text_stream(path: str | Path, *, newline: str | None = None) -> io.TextIOWrapper:
    """The regular file `path` (the user's own path) opened as UTF-8 text, a byte-order mark dropped."""
    return io.TextIOWrapper(open_binary(path), encoding="utf-8-sig", newline=newline)
