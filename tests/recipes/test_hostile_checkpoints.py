"""A planted checkpoint gets one line, never a hang, a traceback or a read outside (issue 44):

- a `.metadata` pickle whose BUILD rewrites an allowed class (pathlib.PurePosixPath) for the whole
  process is refused before anything changes;
- a named pipe as `.metadata`, as a data file or as the COMPLETE marker is refused, not read (an alarm
  turns a blocked read into a failure);
- the old-format converter copies no file a link leads out to;
- a manifest that is a JSON list, nested 10^5 deep or listing 70,000 files, a `latest` of 300
  characters and a `.metadata` claiming a 128 TiB tensor are refused in one line, bounded in time
  and length;
- ft-export never asks whether to run a model's own code (auto_map), and says so in one line.
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import shutil
import time
from pathlib import Path

import pytest
import torch

from ft_framework.checkpointing.manifest import check_files, file_records, record_files
from ft_framework.checkpointing.dcp_read import (DCP_METADATA, _MetadataUnpickler, read_metadata,
                                                 read_whole_checkpoint)
from ft_framework.checkpointing.layout import read_fields
from ft_framework.checkpointing.legacy import main as convert_main
from ft_framework.checkpointing.manager import CheckpointManager
from ft_framework.checkpointing.manifest import MANIFEST_FILE, CheckpointFormatError
from ft_framework.cli import export_main, interpolate_main
from ft_framework.errors import UserError
from ft_framework.run.files import CHECKPOINTS_DIR, COMPLETE_MARKER, LATEST_FILE
from test_checkpoint_containment import STEP_DIR, finished_run, nothing_outside_opened  # noqa: F401 (a fixture)

CONVERTER = "python -m ft_framework.checkpointing.legacy"


@pytest.fixture
def run(finished_run, tmp_path):  # noqa: F811 (the fixture imported above)
    """A copy of the finished run, its checkpoint, and a directory outside it."""
    copied = Path(shutil.copytree(finished_run, tmp_path / "run", symlinks=True))
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    return copied, copied / CHECKPOINTS_DIR / STEP_DIR, outside


def one_line(text: str, *says: str) -> str:
    text = text.strip()
    assert "\n" not in text and "Traceback" not in text, text
    for part in says:
        assert part in text, text
    return text


def unlist(checkpoint: Path, name: str) -> None:
    """The manifest no longer records `name` (whoever planted a file there rewrote it too)."""
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    del manifest["files"][name]
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))


# ---- 1. a BUILD on an allowed class ----------------------------------------------------------------
# GLOBAL pathlib PurePosixPath; BUILD (None, {name: '../../../../etc/hostname', parts: ('ok',)}); POP
POISON = (b"\x80\x04cpathlib\nPurePosixPath\n(N}X\x04\x00\x00\x00nameX\x18\x00\x00\x00../../../../etc/hostnames"
          b"X\x05\x00\x00\x00parts(X\x02\x00\x00\x00oktstb0")


def test_a_build_that_would_rewrite_an_allowed_class_is_refused(run):
    _, checkpoint, _ = run
    (checkpoint / DCP_METADATA).write_bytes(POISON + (checkpoint / DCP_METADATA).read_bytes())
    record_files(checkpoint, file_records(checkpoint))  # the manifest is no signature
    before = dict(vars(pathlib.PurePosixPath))
    try:
        with pytest.raises(CheckpointFormatError) as refused:
            read_metadata(checkpoint / DCP_METADATA)
        one_line(str(refused.value), "sets the state of the class pathlib.PurePosixPath (BUILD)", "refused before")
        with pytest.raises(UserError) as refused:
            CheckpointManager(checkpoint.parent).resolve(str(checkpoint))
        one_line(str(refused.value), "sets the state of the class pathlib.PurePosixPath")
        assert pathlib.PurePosixPath("a/b").name == "b" and vars(pathlib.PurePosixPath) == before
    finally:  # a regression must not leave the class rewritten for the tests after this one
        for name in set(vars(pathlib.PurePosixPath)) - set(before):
            delattr(pathlib.PurePosixPath, name)


def test_the_unpickler_sets_items_only_on_lists_and_dicts():
    """An APPEND or SETITEM on an allowed class (not a container) is refused like BUILD."""
    onto_class = b"\x80\x04ctorch\nSize\nX\x01\x00\x00\x00kX\x01\x00\x00\x00vs."
    with pytest.raises(pickle.UnpicklingError, match="SETITEM on the class torch.Size"):
        _MetadataUnpickler(io.BytesIO(onto_class)).load()


# ---- 2. named pipes --------------------------------------------------------------------------------
def test_a_named_pipe_as_the_dcp_index_is_refused_by_every_reader(run, capsys, caplog):
    out, checkpoint, _ = run
    (checkpoint / DCP_METADATA).unlink()
    os.mkfifo(checkpoint / DCP_METADATA)
    unlist(checkpoint, DCP_METADATA)
    manager = CheckpointManager(out / CHECKPOINTS_DIR)
    says = f"{checkpoint / DCP_METADATA} is a named pipe, not a regular file"
    with nothing_outside_opened():
        with pytest.raises(UserError) as refused:
            manager.resolve("latest")
        one_line(str(refused.value), says)
        with pytest.raises(CheckpointFormatError) as refused:
            read_metadata(checkpoint / DCP_METADATA)
        one_line(str(refused.value), says)
        caplog.set_level("WARNING", logger="ft_framework.checkpointing.manager")
        assert manager.latest_complete() is None and says in caplog.text
        for argv in ([str(out), "--verify"], [str(out), str(out / "exported")]):
            assert export_main(argv) == 2
            one_line(capsys.readouterr().err, "ft-export: error: ", says)
        assert not (out / "exported").exists()


def test_a_named_pipe_as_a_data_file_is_refused(run):
    _, checkpoint, _ = run
    [data_file] = checkpoint.glob("*.distcp")
    data_file.unlink()
    os.mkfifo(data_file)
    unlist(checkpoint, data_file.name)
    says = f"{data_file} is a named pipe, not a regular file"
    with nothing_outside_opened():
        for read in (read_whole_checkpoint, read_fields, read_metadata):
            with pytest.raises(CheckpointFormatError) as refused:
                read(checkpoint / DCP_METADATA if read is read_metadata else checkpoint)
            one_line(str(refused.value), says)


def test_ft_interpolate_refuses_a_named_pipe_as_the_complete_marker(run, capsys):
    out, checkpoint, _ = run
    (checkpoint / COMPLETE_MARKER).unlink()
    os.mkfifo(checkpoint / COMPLETE_MARKER)
    with nothing_outside_opened():
        assert interpolate_main([str(out), "--alphas", "0,1", "--no-plot"]) == 2
    one_line(capsys.readouterr().err.strip().splitlines()[-1], "ft-interpolate: error: ",
             f"{checkpoint / COMPLETE_MARKER} is a named pipe")
    assert not (out / "interpolation.json").exists()


# ---- 3. the old-format converter -------------------------------------------------------------------
def test_the_converter_copies_no_file_a_link_leads_out_to(tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    old.mkdir()
    torch.save({"w": torch.ones(3)}, old / "model.pt")
    torch.save({"optimizer": {"param_groups": [{"params": [0], "param_names": ["w"]}],
                              "state": {0: {"exp_avg": torch.zeros(3)}}}}, old / "optimizer.pt")
    (old / COMPLETE_MARKER).write_text('{"step": 1}')
    secret = tmp_path / "secret.pt"
    secret.write_bytes(b"a file outside the checkpoint")
    (old / "trainer_state.pt").symlink_to(secret)
    assert convert_main([str(old), str(new)]) == 2
    one_line(capsys.readouterr().err, CONVERTER, "'trainer_state.pt'", "leads outside it through a symlink")
    assert not new.exists()


# ---- 7. a manifest, a pointer and an index that would cost a traceback, a minute or 100 MB ---------
@pytest.mark.parametrize("manifest", ["[1]", "[" * 100_000 + "]" * 100_000], ids=["a_list", "nested_100000_deep"])
def test_a_manifest_that_is_no_json_object_is_refused(run, manifest):
    out, checkpoint, _ = run
    (checkpoint / MANIFEST_FILE).write_text(manifest)
    with pytest.raises(UserError) as refused:
        CheckpointManager(out / CHECKPOINTS_DIR).resolve("latest")
    one_line(str(refused.value), MANIFEST_FILE)
    [problem] = check_files(checkpoint)
    one_line(problem, str(checkpoint / MANIFEST_FILE))


def test_a_manifest_of_70000_files_is_refused_quickly_in_one_short_line(run):
    out, checkpoint, _ = run
    manifest = json.loads((checkpoint / MANIFEST_FILE).read_text())
    manifest["files"].update({f"planted/{i}": {"size": 1} for i in range(70_000)})
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
    started = time.monotonic()
    problems = check_files(checkpoint)
    with pytest.raises(UserError) as refused:
        CheckpointManager(out / CHECKPOINTS_DIR).resolve("latest")
    assert time.monotonic() - started < 5
    assert len(problems) == 1 and len(one_line(problems[0], "records 70")) < 1000
    assert len(one_line(str(refused.value))) < 1000
    # Damage past the first few files: named one by one up to five, then counted.
    manifest["files"] = {**{f"missing/{i}": {"size": 1} for i in range(8)}}
    (checkpoint / MANIFEST_FILE).write_text(json.dumps(manifest))
    problems = check_files(checkpoint)
    assert len(problems) == 6 and problems[-1] == "and 3 more", problems


def test_a_latest_pointer_of_300_characters_is_refused_and_auto_falls_back(run, caplog):
    out, checkpoint, _ = run
    (out / CHECKPOINTS_DIR / LATEST_FILE).write_text("x" * 300)
    manager = CheckpointManager(out / CHECKPOINTS_DIR)
    with pytest.raises(UserError) as refused:
        manager.resolve("latest")
    one_line(str(refused.value), "cannot be looked up (File name too long)")
    caplog.set_level("WARNING", logger="ft_framework.checkpointing.manager")
    assert manager.latest_complete() == checkpoint and "not following" in caplog.text


def test_a_dcp_index_claiming_a_128_tib_tensor_is_refused_before_it_is_allocated(run):
    _, checkpoint, _ = run
    metadata = read_metadata(checkpoint / DCP_METADATA)
    key = next(k for k, md in metadata.state_dict_metadata.items() if getattr(md, "size", None))
    metadata.state_dict_metadata[key].size = torch.Size([2 ** 45])  # float32: 128 TiB
    (checkpoint / DCP_METADATA).write_bytes(pickle.dumps(metadata))
    for read in (read_fields, read_whole_checkpoint):
        with pytest.raises(CheckpointFormatError) as refused:
            read(checkpoint)
        claimed = int(one_line(str(refused.value), "bytes of tensors, but its data files hold",
                               "refused before anything of that size is allocated").split(" claims ")[1].split()[0])
        assert claimed > 2 ** 47


# ---- 6. a model's own code -------------------------------------------------------------------------
def test_ft_export_never_asks_to_run_a_models_own_code(run, tmp_path, capsys, monkeypatch):
    """A config naming its own code (auto_map) for a model type transformers does not ship: with
    stdin closed and no terminal, nothing is asked (transformers' prompt calls input()), and the
    export is refused in one line."""
    _, checkpoint, _ = run
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "config.json").write_text(json.dumps({"model_type": "planted_type", "auto_map": {
        "AutoConfig": "planted.PlantedConfig", "AutoModelForSequenceClassification": "planted.PlantedModel"}}))
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "y")
    monkeypatch.setattr("sys.stdin", io.StringIO(""))
    code = export_main([str(checkpoint), str(tmp_path / "hf"), "--config-dir", str(custom),
                        "--model-class", "transformers:AutoModelForSequenceClassification"])
    assert not asked, asked
    assert code == 2
    one_line(capsys.readouterr().err.strip().splitlines()[-1], "ft-export: error: ",
             "names a model's own code (auto_map)", "never runs it")
    assert not (tmp_path / "hf").exists()
