"""Names inside a checkpoint stay inside it (ft_framework/path_containment.py): a manifest naming
`../outside` or an absolute path, a `latest` pointer naming `../x`, a symlink in the checkpoint
leading out. Each is refused in one line naming the entry by resume, `resume_from: auto` (which
passes over it, saying why), `ft-export --verify` and `ft-interpolate`; and nothing outside is
opened: the outside file is a named pipe, whose open would block, and an alarm turns a block into
a failure."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import xxhash

from ft_framework.checkpointing.dcp_read import DCP_METADATA, checkpoint_reader
from ft_framework.checkpointing.manager import CheckpointManager
from ft_framework.checkpointing.manifest import MANIFEST_FILE, CheckpointFormatError
from ft_framework.cli import export_main, interpolate_main
from ft_framework.config import load_config
from ft_framework.errors import UserError
from ft_framework.run.files import CHECKPOINTS_DIR, LATEST_FILE
from ft_framework.trainer import Trainer
from tiny_run import write_run_config

STEP_DIR = "step_00000002"
OPEN_BLOCKS_AFTER_S = 20  # far above any of these calls (a second or two): only a blocked open gets there


@contextlib.contextmanager
def nothing_outside_opened():
    """Fails the test (instead of hanging it) when something opens the named pipe outside."""
    def blocked(signum, frame):
        raise TimeoutError(f"still running after {OPEN_BLOCKS_AFTER_S} s: the named pipe outside the "
                           "checkpoint was opened")
    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(OPEN_BLOCKS_AFTER_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def finished_run(tiny_bert_dir, tmp_path_factory):
    """A finished 2-step run with its final checkpoint (no export: ft-interpolate reads the checkpoint)."""
    root = tmp_path_factory.mktemp("contained")
    cfg = write_run_config(root / "run.yaml", tiny_bert_dir, root / "out", training={"max_steps": 2},
                           data={"max_train_examples": 16, "max_eval_examples": 16},
                           evaluation={"num_evals": 1}, checkpoint={"every_steps": 2})
    Trainer(load_config(cfg)).fit()
    assert (root / "out" / CHECKPOINTS_DIR / STEP_DIR / MANIFEST_FILE).is_file()
    return root / "out"


def _edit_manifest(checkpoint: Path, edit) -> None:
    path = checkpoint / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    edit(manifest["files"])
    path.write_text(json.dumps(manifest))


def _record(files: dict, name: str, content: bytes) -> None:
    files[name] = {"size": len(content), "xxh3_64": xxhash.xxh3_64(content).hexdigest()}


def manifest_names_dotdot_pipe(run: Path, outside: Path) -> str:
    """`../outside`: a named pipe beside the checkpoint, recorded with the size and checksum it has
    (0 bytes, the empty digest)."""
    os.mkfifo(run / CHECKPOINTS_DIR / "outside")
    _edit_manifest(run / CHECKPOINTS_DIR / STEP_DIR, lambda files: _record(files, "../outside", b""))
    return "'../outside'"


def manifest_names_dotdot_file(run: Path, outside: Path) -> str:
    """`../../outside.bin`: a real file outside, recorded with its true size and checksum (the issue's
    case: before the fix it was hashed, and the checkpoint accepted)."""
    content = b"a file outside the checkpoint\n" * 7
    (run / "outside.bin").write_bytes(content)
    _edit_manifest(run / CHECKPOINTS_DIR / STEP_DIR, lambda files: _record(files, "../../outside.bin", content))
    return "'../../outside.bin'"


def manifest_names_absolute_pipe(run: Path, outside: Path) -> str:
    os.mkfifo(outside / "pipe")
    _edit_manifest(run / CHECKPOINTS_DIR / STEP_DIR, lambda files: _record(files, str(outside / "pipe"), b""))
    return "is an absolute path"


def latest_names_dotdot(run: Path, outside: Path) -> str:
    """`latest` names `../x`, a complete copy of the checkpoint outside checkpoints/."""
    shutil.copytree(run / CHECKPOINTS_DIR / STEP_DIR, run / "x")
    (run / CHECKPOINTS_DIR / LATEST_FILE).write_text("../x")
    return "'../x'"


def symlink_to_a_pipe(run: Path, outside: Path) -> str:
    """The checkpoint's data file replaced by a symlink to a named pipe outside it."""
    os.mkfifo(outside / "pipe")
    [data_file] = (run / CHECKPOINTS_DIR / STEP_DIR).glob("*.distcp")
    data_file.unlink()
    data_file.symlink_to(outside / "pipe")
    return f"'{data_file.name}'"


def symlinked_config_to_a_file(run: Path, outside: Path) -> str:
    """model/config.json (read by export and resume, recorded in the manifest) a symlink to a
    faithful copy outside: the size and checksum match, the name does not stay inside."""
    config = run / CHECKPOINTS_DIR / STEP_DIR / "model" / "config.json"
    shutil.copy(config, outside / "config.json")
    config.unlink()
    config.symlink_to(outside / "config.json")
    return "'model/config.json'"


CASES = [manifest_names_dotdot_pipe, manifest_names_dotdot_file, manifest_names_absolute_pipe, latest_names_dotdot,
         symlink_to_a_pipe, symlinked_config_to_a_file]


@pytest.fixture(params=CASES, ids=lambda case: case.__name__)
def tampered(request, finished_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    says = request.param(run, outside)
    return run, says, request.param is latest_names_dotdot


def _one_line_naming(message: str, says: str) -> None:
    assert "\n" not in message.strip(), message
    assert says in message and "refused without opening" in message, message


def test_resume_refuses_it(tampered, tmp_path, tiny_bert_dir):
    run, says, through_latest = tampered
    cfg = write_run_config(tmp_path / "resume.yaml", tiny_bert_dir, run, training={"max_steps": 4},
                           data={"max_train_examples": 16, "max_eval_examples": 16}, evaluation={"num_evals": 1},
                           checkpoint={"every_steps": 2, "resume_from": "latest" if through_latest
                                       else str(run / CHECKPOINTS_DIR / STEP_DIR)})
    trainer = Trainer(load_config(cfg))
    with nothing_outside_opened(), pytest.raises(UserError) as refused:
        trainer.setup()
    _one_line_naming(str(refused.value), says)


def test_auto_passes_over_it_saying_why(tampered, caplog):
    run, says, through_latest = tampered
    caplog.set_level("WARNING", logger="ft_framework.checkpointing.manager")
    with nothing_outside_opened():
        found = CheckpointManager(run / CHECKPOINTS_DIR).latest_complete()
    # The pointer refused, the checkpoint itself is fine: auto falls back to it; any other case
    # leaves no usable checkpoint (a fresh start).
    assert found == (run / CHECKPOINTS_DIR / STEP_DIR if through_latest else None)
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("checkpoint.resume_from=auto: " + ("not following" if through_latest else "skipping"))
    _one_line_naming(warning, says)


def test_ft_export_verify_refuses_it(tampered, capsys):
    run, says, _ = tampered
    with nothing_outside_opened():
        assert export_main([str(run), "--verify"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ft-export: error: ")
    _one_line_naming(err, says)


def test_ft_interpolate_refuses_it(tampered, capsys):
    run, says, _ = tampered
    with nothing_outside_opened():
        assert interpolate_main([str(run), "--alphas", "0,1", "--no-plot"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's loading report
    assert err.startswith("ft-interpolate: ")
    _one_line_naming(err, says)
    assert not (run / "interpolation.json").exists()


def test_the_untampered_run_passes_every_check(finished_run, tmp_path, capsys):
    """The same checks on the checkpoint as saved: it verifies, and auto takes it (the refusals
    above are about the names, not about a run these tools cannot read)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run, symlinks=True)
    assert export_main([str(run), "--verify"]) == 0
    assert "files match the sizes and checksums" in capsys.readouterr().out
    assert CheckpointManager(run / CHECKPOINTS_DIR).latest_complete() == run / CHECKPOINTS_DIR / STEP_DIR


def test_dcp_refuses_its_index_or_a_data_file_leading_out(finished_run, tmp_path):
    """DCP's own reader, as every checkpoint read opens it, resolves `.metadata` and each data file
    it names before opening them (the check that stands when no manifest is read first)."""
    run, outside = tmp_path / "run", tmp_path / "elsewhere"
    shutil.copytree(finished_run, run, symlinks=True)
    outside.mkdir()
    step = run / CHECKPOINTS_DIR / STEP_DIR
    symlink_to_a_pipe(run, outside)
    [data_file] = step.glob("*.distcp")
    with nothing_outside_opened(), pytest.raises(CheckpointFormatError) as refused:
        checkpoint_reader(step).read_metadata()
    assert f"{DCP_METADATA}'s data file '{data_file.name}'" in str(refused.value)
    shutil.move(step / DCP_METADATA, outside / DCP_METADATA)
    (step / DCP_METADATA).symlink_to(outside / DCP_METADATA)
    with nothing_outside_opened(), pytest.raises(CheckpointFormatError, match="DCP's index '.metadata' in .* leads "
                                                                                "outside it through a symlink"):
        checkpoint_reader(step).read_metadata()
