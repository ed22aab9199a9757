"""ft_framework/user_files.py: a file a user hands us is opened one way. A named pipe, a device or a
socket is refused in one line before anything is read (the pipes here would block an open: an alarm
turns a block into a failure), a link leading out of the root is refused unopened, a link planted
after the containment walk is refused rather than followed, and what is read whole is bounded in
bytes, in nesting and in encoding."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from ft_framework import user_files
from ft_framework.errors import UserError
from ft_framework.path_containment import NameOutsideError, resolve_inside
from bounded import no_block
from ft_framework.user_files import (NESTING_LIMIT, MissingFile, UserFileError, file_size, open_binary, read_bytes,
                                     read_json, read_text, refused_entries)

@pytest.fixture
def root(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "data.json").write_text('{"a": 1}')
    (root / "inside_link.json").symlink_to("sub/data.json")
    os.mkfifo(root / "pipe")
    (tmp_path / "outside.json").write_text('{"secret": 1}')
    (root / "out_link.json").symlink_to(tmp_path / "outside.json")
    (root / "zero").symlink_to("/dev/zero")
    return root


def _one_line(exc: BaseException, *says: str) -> None:
    text = str(exc)
    assert "\n" not in text and isinstance(exc, UserError), text
    for part in says:
        assert part in text, text


def test_regular_files_inside_read_and_links_inside_are_followed(root):
    assert read_json(root / "sub" / "data.json", root=root) == {"a": 1}
    assert read_json(root / "inside_link.json", root=root) == {"a": 1}
    assert file_size(root / "sub" / "data.json", root=root) == 8
    with open_binary(root / "inside_link.json", root=root) as f:
        assert f.read() == b'{"a": 1}'


@pytest.mark.parametrize("read", [read_json, read_text, read_bytes, open_binary, file_size])
def test_a_named_pipe_is_refused_without_blocking(root, read):
    for where in ({"root": root}, {}):  # inside a root, and as the user's own path
        with no_block("a named pipe was opened for reading"), pytest.raises(UserFileError) as refused:
            read(root / "pipe", **where)
        _one_line(refused.value, "is a named pipe, not a regular file", "refused without reading it")


def test_a_device_a_socket_and_a_directory_are_refused(root, tmp_path):
    with pytest.raises(UserFileError) as refused:
        read_text("/dev/zero")  # the user's own path, links followed: still no endless read
    _one_line(refused.value, "/dev/zero is a character device")
    server = socket.socket(socket.AF_UNIX)
    path = tmp_path / "s.sock"
    server.bind(str(path))
    with pytest.raises(UserFileError, match="is a socket"):
        read_bytes(path)
    server.close()
    with pytest.raises(UserFileError, match="is a directory"):
        read_bytes(root / "sub", root=root)


@pytest.mark.parametrize("name, why", [("out_link.json", "leads outside it through a symlink"),
                                       ("zero", "leads outside it through a symlink")])
def test_a_link_leading_out_of_the_root_is_refused_unopened(root, name, why):
    with pytest.raises(NameOutsideError) as refused:
        read_json(root / name, root=root, entry="the status file")
    _one_line(refused.value, why, "the status file", "refused without opening")


def test_a_link_planted_after_the_walk_is_refused_not_followed(root, tmp_path, monkeypatch):
    """The walk proves `sub/data.json` inside; then `sub` is replaced by a link to a directory
    outside holding a file of that name: the open, component by component without following a
    link, refuses it."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.json").write_text('{"planted": 1}')
    walk = user_files.real_path_inside

    def walk_then_plant(*args, **kwargs):
        found = walk(*args, **kwargs)
        (root / "sub").rename(root / "moved")
        (root / "sub").symlink_to(elsewhere)
        return found

    monkeypatch.setattr(user_files, "real_path_inside", walk_then_plant)
    with pytest.raises(UserFileError) as refused:
        read_json(root / "sub" / "data.json", root=root)
    _one_line(refused.value, "changed while it was opened")


def test_a_missing_file_is_a_file_not_found_error(root):
    with pytest.raises(FileNotFoundError) as missing:
        read_json(root / "nothing.json", root=root)
    assert isinstance(missing.value, MissingFile)
    with pytest.raises(MissingFile):
        read_text(root / "nothing.yaml")


def test_the_size_bound_refuses_before_reading(root):
    (root / "big.json").write_text("[" + "0," * 600 + "0]")
    with pytest.raises(UserFileError) as refused:
        read_json(root / "big.json", root=root, limit=1000, expect=list)
    _one_line(refused.value, "holds 1203 bytes, more than the 1000")
    assert len(read_json(root / "big.json", root=root, limit=2000, expect=list)) == 601


@pytest.mark.parametrize("depth", [NESTING_LIMIT + 1, 1000, 100_000])
def test_deep_json_is_refused_in_one_line(root, depth):
    (root / "deep.json").write_text("[" * depth + "]" * depth)
    with pytest.raises(UserFileError) as refused:
        read_json(root / "deep.json", root=root, expect=None)
    _one_line(refused.value, "nested deeper than")


def test_json_of_another_type_or_not_json_is_refused(root):
    (root / "list.json").write_text("[1]")
    with pytest.raises(UserFileError) as refused:
        read_json(root / "list.json", root=root)
    _one_line(refused.value, "holds a JSON array, expected an object")
    (root / "cut.json").write_text('{"a": ')
    with pytest.raises(UserFileError) as refused:
        read_json(root / "cut.json", root=root)
    _one_line(refused.value, "not valid JSON")
    assert read_json(root / "list.json", root=root, expect=list) == [1]


def test_text_that_is_not_utf8_names_line_and_byte_offset(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("a: 1\n# caf\u00e9\n".encode("latin-1"))
    with pytest.raises(UserFileError) as refused:
        read_text(path)
    _one_line(refused.value, f"{path}:2: not UTF-8 text (byte 0xe9 at byte offset 10, column 6)")
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbfa: 1\n")
    assert read_text(tmp_path / "bom.yaml") == "a: 1\n"


def test_refused_entries_names_what_no_reader_may_open(root):
    (root / "sub" / "pipe_link").symlink_to("../pipe")
    problems = refused_entries(root)
    assert len(problems) == 4, problems
    assert any("'out_link.json'" in p and "leads outside" in p for p in problems)
    assert any("'zero'" in p and "leads outside" in p for p in problems)
    assert any(p.startswith(f"{root / 'pipe'} is a named pipe") for p in problems)
    assert any(p.startswith(f"{root / 'sub' / 'pipe_link'} is a named pipe") for p in problems)
    assert all("\n" not in p for p in problems)


def test_a_name_too_long_to_look_up_is_refused_not_raised(tmp_path):
    with pytest.raises(NameOutsideError) as refused:
        resolve_inside(tmp_path, "x" * 300, entry="the latest pointer's checkpoint")
    _one_line(refused.value, "cannot be looked up (File name too long)")
    (tmp_path / "ok.json").write_text(json.dumps({"k": [1, 2]}))
    assert read_json(Path(tmp_path) / "ok.json", root=tmp_path) == {"k": [1, 2]}
