"""Two exports to one directory never mix, a kill between the two renames of a replacement loses
neither export, and the rule of what an export may replace is applied again at the rename
(checkpointing/export.py: write_atomically). A sweep whose runs would all export into one directory
is refused when it is planned (sweep/grid.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import yaml

from ft_framework.checkpointing.export import PARTIAL_SUFFIX, REPLACED_SUFFIX, ExportExistsError, write_atomically
from ft_framework.config import ConfigError
from ft_framework.sweep import load_sweep, plan_sweep

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "config"))  # test_config.py's minimal config
from test_config import minimal as base_config  # noqa: E402

FILES_PER_WRITER = 20


def _writer(name: str, both_writing: threading.Barrier):
    def write(directory: Path) -> None:
        for i in range(FILES_PER_WRITER // 2):
            (directory / f"{name}-{i}").write_text(name)
        both_writing.wait(timeout=30)  # the other writer is inside its write now too
        for i in range(FILES_PER_WRITER // 2, FILES_PER_WRITER):
            (directory / f"{name}-{i}").write_text(name)
    return write


def test_two_writers_of_one_directory_never_mix(tmp_path):
    out = tmp_path / "export"
    both_writing = threading.Barrier(2)
    errors: list[BaseException] = []

    def run(name: str) -> None:
        try:
            write_atomically(out, _writer(name, both_writing))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    names = sorted(p.name for p in out.iterdir())
    writers = {name.split("-")[0] for name in names}
    assert len(writers) == 1 and len(names) == FILES_PER_WRITER, names  # one writer's files, all of them
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing left beside it


def test_a_kill_between_the_renames_loses_neither_export(tmp_path):
    """What a kill between the two renames of a replacement leaves: nothing at OUT, the previous
    export renamed aside, the new one complete in its partial directory. The next export, which
    fails (a refusal, a crash), must leave an export at OUT: the previous one, put back."""
    out = tmp_path / "export"
    write_atomically(out, lambda d: (d / "old").write_text("previous export"))
    aside = out.with_name(f".{out.name}{REPLACED_SUFFIX}")
    out.rename(aside)
    new = out.with_name(f".{out.name}{PARTIAL_SUFFIX}")
    new.mkdir()
    (new / "new").write_text("complete new export")

    def fails(directory: Path) -> None:
        raise RuntimeError("the next export fails")

    with pytest.raises(RuntimeError, match="the next export fails"):
        write_atomically(out, fails)
    assert (out / "old").read_text() == "previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_the_replace_rule_is_applied_again_at_the_rename(tmp_path):
    """Another run's export appears at OUT while this export is written (it was empty when the
    export started): the check at the rename refuses, and the other export stays."""
    out = tmp_path / "export"

    def refuse_anything_there() -> None:
        if out.exists():
            raise ExportExistsError(f"export directory {out} holds an export of another run")

    def write_while_another_finishes(directory: Path) -> None:
        (directory / "mine").write_text("this export")
        out.mkdir()
        (out / "theirs").write_text("another run's export")

    with pytest.raises(ExportExistsError, match="holds an export of another run"):
        write_atomically(out, write_while_another_finishes, check=refuse_anything_there)
    assert sorted(p.name for p in out.iterdir()) == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_a_sweep_whose_runs_share_one_export_dir_is_refused(tmp_path):
    base = base_config()
    base["checkpoint"] = {"export_dir": str(tmp_path / "shared_export")}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "base": "base.yaml", "output_dir": str(tmp_path / "store"), "axes": {"training.seed": [1, 2, 3]}}))
    with pytest.raises(ConfigError) as refused:
        plan_sweep(load_sweep(tmp_path / "sweep.yaml"), [], None)
    message = str(refused.value)
    assert "\n" not in message and "checkpoint.export_dir" in message and "3 runs" in message, message
    assert str(tmp_path / "shared_export") in message
