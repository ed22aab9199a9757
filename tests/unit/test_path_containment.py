"""ft_framework/path_containment.py: a name read from a file stays inside the file's directory, and
the walk that decides it reads only the directory's own entries (the outside targets here are named
pipes: a stat would not block, but an open would)."""

from __future__ import annotations

import json
import os

import pytest

from ft_framework.path_containment import NameOutsideError, links_leading_out, resolve_inside
from ft_framework.sweep.store import SweepStore


@pytest.fixture
def tree(tmp_path):
    """root/ with a file, a subdirectory and links that stay inside; outside/pipe beside it."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "sub").mkdir(parents=True)
    outside.mkdir()
    os.mkfifo(outside / "pipe")
    (root / "sub" / "a.bin").write_bytes(b"a")
    (root / "rel_inside").symlink_to("sub/a.bin")
    (root / "sub" / "up_inside").symlink_to("../sub/a.bin")
    (root / "abs_inside").symlink_to(root / "sub" / "a.bin")
    (root / "dir_link").symlink_to("sub")
    return root, outside


@pytest.mark.parametrize("name", ["sub/a.bin", "rel_inside", "sub/up_inside", "abs_inside", "dir_link/a.bin",
                                  "./sub/a.bin", "missing/file"])
def test_names_that_stay_inside_resolve_as_given(tree, name):
    root, _ = tree
    assert resolve_inside(root, name, entry="the entry") == root / name


@pytest.mark.parametrize("name, why", [
    ("../outside/pipe", "climbs out with '..'"),
    ("sub/../../outside/pipe", "climbs out with '..'"),
    ("", "is not a file name"),
    ("a\0b", "is not a file name"),
    (7, "is not a file name"),
])
def test_plain_names_that_lead_out_are_refused(tree, name, why):
    root, _ = tree
    with pytest.raises(NameOutsideError, match="refused without opening") as refused:
        resolve_inside(root, name, entry="the entry")
    assert why in str(refused.value) and str(refused.value).startswith("the entry ")


def test_an_absolute_name_is_refused_even_inside(tree):
    root, _ = tree
    with pytest.raises(NameOutsideError, match="is an absolute path"):
        resolve_inside(root, str(root / "sub" / "a.bin"), entry="the entry")


@pytest.mark.parametrize("link, target", [
    ("to_pipe", "../outside/pipe"),             # relative, out
    ("abs_pipe", "{outside}/pipe"),             # absolute, out
    ("sub/deep_out", "../../outside/pipe"),     # from a subdirectory
    ("dir_out", "{outside}"),                   # a directory leading out, then a name inside it
    ("chain", "rel_chain"),                     # a link to a link that leads out
])
def test_symlinks_that_lead_out_are_refused_without_touching_the_target(tree, link, target):
    root, outside = tree
    (root / "rel_chain").symlink_to("../outside/pipe")
    (root / link).symlink_to(target.format(outside=outside))
    name = f"{link}/pipe" if link == "dir_out" else link
    with pytest.raises(NameOutsideError, match="leads outside it through a symlink"):
        resolve_inside(root, name, entry="the entry")


def test_a_symlink_loop_is_refused(tree):
    root, _ = tree
    (root / "loop_a").symlink_to("loop_b")
    (root / "loop_b").symlink_to("loop_a")
    with pytest.raises(NameOutsideError, match="a loop"):
        resolve_inside(root, "loop_a", entry="the entry")


def test_a_long_name_is_quoted_short(tree):
    root, _ = tree
    with pytest.raises(NameOutsideError) as refused:
        resolve_inside(root, "/" + "x" * 100_000, entry="the entry")
    assert len(str(refused.value)) < 400 + len(str(root)) * 3


def test_links_leading_out_lists_each_one_and_follows_none(tree):
    root, outside = tree
    assert links_leading_out(root) == []
    (root / "sub" / "to_pipe").symlink_to(outside / "pipe")
    (root / "dir_out").symlink_to(outside)  # never descended into
    found = links_leading_out(root)
    assert len(found) == 2
    assert "'dir_out'" in found[0] and "'sub/to_pipe'" in found[1]


def test_a_sweep_index_naming_a_run_outside_the_store_is_refused(tmp_path):
    store = SweepStore(tmp_path / "sweep")
    (store.runs_dir / "r1").mkdir(parents=True)
    index = {"runs": [{"id": "r1", "method": "adamw", "dir": "runs/r1"}]}
    (store.root / "index.json").write_text(json.dumps(index))
    assert store.list_runs()[0]["dir"] == "runs/r1"
    for bad in ("../elsewhere", "/etc", "runs/../../elsewhere"):
        index["runs"][0]["dir"] = bad
        (store.root / "index.json").write_text(json.dumps(index))
        with pytest.raises(NameOutsideError, match="index.json's run directory"):
            store.list_runs()


def test_a_sweep_run_directory_that_is_a_symlink_out_is_refused(tmp_path):
    store = SweepStore(tmp_path / "sweep")
    store.runs_dir.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (store.runs_dir / "r1").symlink_to(tmp_path / "elsewhere")
    index = {"runs": [{"id": "r1", "method": "adamw", "dir": "runs/r1"}]}
    (store.root / "index.json").write_text(json.dumps(index))
    with pytest.raises(NameOutsideError, match="leads outside it through a symlink"):
        store.list_runs()
    (store.root / "index.json").unlink()  # without an index: the run directories themselves
    with pytest.raises(NameOutsideError, match="the run directory 'runs/r1'"):
        store.list_runs()
