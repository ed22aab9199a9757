"""Runs that survive a cluster (issue 18), on CPU with the tiny BERT: signals end a run with a
checkpoint and resume to the uninterrupted run's metrics, one writer per output directory, file
errors as one line, damaged checkpoints named and skipped, every path a user would pass to
ft-export, and checkpoints that are data, never code. (Two ranks under torchrun:
tests/multinode/test_signals.py.)"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ft_framework import cli
from ft_framework.checkpointing.manager import CheckpointError, CheckpointManager, resolve_latest
from ft_framework.checkpointing.manifest import (MANIFEST_FILE, CheckpointFormatError, check_files, file_records,
                                                 record_files)
from ft_framework.config import load_config
from ft_framework.run.lock import RunLock
from ft_framework.trainer import Trainer
from small_filesystem import small_filesystem
from tiny_run import sweep_in_this_process, write_run_config

REPO = Path(__file__).resolve().parents[2]
PLANTED = "/tmp/ft_framework_test_planted_{}"


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.train_main(argv)
    return rc, out.getvalue(), err.getvalue()


def ft_lines(err):
    """The lines ft-train itself printed (libraries print progress bars on stderr too)."""
    return [line for line in err.splitlines() if line.startswith("ft-train")]


def env():
    return {**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def finished_run(tiny_bert_dir, tmp_path_factory):
    """A 4-step run with checkpoints after steps 2 and 4."""
    root = tmp_path_factory.mktemp("finished")
    cfg = write_run_config(root / "run.yaml", tiny_bert_dir, root / "out", training={"max_steps": 4},
                           checkpoint={"every_steps": 2, "keep_last": 2}, evaluation={"num_evals": 1})
    Trainer(load_config(cfg)).fit()
    return root / "out"


def copy_run(finished_run, tmp_path):
    return Path(shutil.copytree(finished_run, tmp_path / "out"))


# ---- signals --------------------------------------------------------------------------------------
def start_and_signal(config, signum, after_step=2, extra=()):
    """ft-train as a subprocess, sent `signum` once metrics.jsonl shows `after_step`."""
    out = Path(load_config(config).logging.output_dir)
    proc = subprocess.Popen([sys.executable, "-m", "ft_framework.cli", "--config", str(config), *extra],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        lines = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
        if any(r.get("type") == "train" and r["step"] >= after_step for r in lines):
            proc.send_signal(signum)
            break
        time.sleep(0.02)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_the_resume_matches_the_uninterrupted_run(tiny_bert_dir, tmp_path):
    steps = dict(training={"max_steps": 40}, evaluation={"num_evals": 2})
    full = write_run_config(tmp_path / "full.yaml", tiny_bert_dir, tmp_path / "full", **steps)
    Trainer(load_config(full)).fit()
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", **steps,
                           checkpoint={"resume_from": "auto"})
    rc, _, stderr = start_and_signal(cfg, signal.SIGTERM)
    assert rc == 143, stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["status"] == "interrupted" and results["signal"] == "SIGTERM"
    step = results["steps"]
    assert 2 <= step < 40 and Path(results["checkpoint"]).name == CheckpointManager.name_for(step)
    [line] = [line for line in stderr.splitlines() if "stopped by SIGTERM" in line]
    assert f"at step {step}" in line and results["checkpoint"] in line and "resume_from=auto" in line
    assert "Traceback" not in stderr
    # The same command again resumes from that checkpoint and ends as the uninterrupted run did.
    trainer = Trainer(load_config(cfg))
    resumed = trainer.fit()
    assert resumed["steps"] == 40
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl") == read_jsonl(tmp_path / "full" / "metrics.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_ctrl_c_and_sigusr1_end_with_a_checkpoint_and_no_traceback(tiny_bert_dir, tmp_path, signum):
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", training={"max_steps": 400},
                           evaluation={"num_evals": 1})
    rc, _, stderr = start_and_signal(cfg, signum)
    assert rc == 128 + signum, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["status"] == "interrupted" and results["signal"] == signal.Signals(signum).name
    assert check_files(Path(results["checkpoint"])) == []


SIGNAL_SCRIPT = """
import os, signal, sys, time
from ft_framework.run.signals import StopSignals
with StopSignals(on_signal=sys.argv[1], prog="ft-train") as stop:
    stop.echo_s = 0.5
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # at once: the launcher's echo of the first, not a second one
    time.sleep(0.6)
    print("flag", stop.received, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
print("not reached", flush=True)
"""


@pytest.mark.parametrize("on_signal, first_exits", [("save", False), ("exit", True)])
def test_a_second_signal_or_on_signal_exit_ends_the_process_at_once(on_signal, first_exits):
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SIGNAL_SCRIPT, on_signal], env=env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 143 and "not reached" not in proc.stdout
    assert ("flag 15" in proc.stdout) is not first_exits
    assert "exiting now without a checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - started < 30


# ---- one writer per run ---------------------------------------------------------------------------
HOLD_SCRIPT = """
import os, sys, time
from ft_framework.run.lock import RunLock
lock = RunLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(float(sys.argv[2]))
os._exit(0)  # dies holding it: nothing released, the record stays
"""


def test_a_second_run_on_a_locked_output_dir_exits_2_naming_the_holder(tiny_bert_dir, tmp_path):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_SCRIPT, str(out), "60"], env=env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, out, training={"max_steps": 2})
        rc, _, err = run_cli(["--config", str(cfg)])
    finally:
        holder.kill()
        holder.wait()
    assert rc == 2
    [line] = err.strip().splitlines()
    assert f"pid {holder.pid} on host" in line and "is in use by another run" in line
    assert not (out / "metrics.jsonl").exists()


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, caplog):
    subprocess.run([sys.executable, "-c", HOLD_SCRIPT, str(tmp_path), "0"], env=env(), check=True,
                   capture_output=True)
    dead = json.loads((tmp_path / ".ft-train.lock.json").read_text())["pid"]
    os.kill(os.getpid(), 0)  # our own pid is alive; the holder's is gone (it exited without releasing)
    lock = RunLock(tmp_path)
    caplog.set_level("WARNING", logger="ft_framework.run.lock")
    lock.acquire()
    try:
        assert f"pid {dead}" in caplog.text and "no longer running" in caplog.text
        assert lock.holder()["pid"] == os.getpid()
        with pytest.raises(Exception, match="in use by another run"):
            RunLock(tmp_path).acquire()  # a second lock object, as a second process would hold
    finally:
        lock.release()
    assert not (tmp_path / ".ft-train.lock.json").exists()


# ---- file errors ----------------------------------------------------------------------------------
def test_an_output_dir_that_is_a_file_is_one_line(tiny_bert_dir, tmp_path):
    (tmp_path / "out").write_text("not a directory")
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", training={"max_steps": 2})
    rc, _, err = run_cli(["--config", str(cfg)])
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "is a file, not a directory" in err


UNWRITABLE_SCRIPT = """
import os, sys
from ft_framework.run.output_dir import check_output_dir_usable
from ft_framework.errors import UserError
if os.geteuid() == 0:  # root writes anywhere: check as the unprivileged user nobody
    os.setgid(65534)
    os.setuid(65534)
for path in sys.argv[1:]:
    try:
        check_output_dir_usable(path)
    except UserError as exc:
        print(exc)
"""


def test_an_unwritable_output_dir_is_one_line():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)  # others may enter, not write (root's test drops to nobody)
        target = Path(tmp) / "ro"
        target.mkdir(mode=0o555 if os.geteuid() != 0 else 0o755)
        if os.geteuid() != 0 and os.access(target, os.W_OK):
            pytest.skip("this user can write into a read-only directory")
        proc = subprocess.run([sys.executable, "-c", UNWRITABLE_SCRIPT, str(target / "run"), str(target)],
                              env=env(), capture_output=True, text=True, timeout=60)
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2, proc.stderr
    assert f"{str(target / 'run')!r} cannot be created (Permission denied" in lines[0]
    assert f"{str(target)!r} is not writable by this user" in lines[1]


class FullDiskStream:
    """A data file's stream that has `room` bytes left, then fails as a full disk does (ENOSPC)."""

    def __init__(self, stream, room: int):
        self.stream, self.room = stream, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.stream.write(data)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def assert_full_disk_line(rc, err, out: Path):
    """The run ended in one line naming the directory and its free space; the first checkpoint is
    intact and still the latest, the partial second one is gone."""
    assert rc == 2 and len(ft_lines(err)) == 1 and "Traceback" not in err, err
    first = out / "checkpoints" / CheckpointManager.name_for(2)
    [line] = ft_lines(err)
    assert f"saving checkpoint {CheckpointManager.name_for(4)} into {out / 'checkpoints'} failed" in line
    assert re.search(rf"\d+(\.\d)? (B|KiB|MiB|GiB) free on the file system of {re.escape(str(out / 'checkpoints'))}", line)
    assert f"the previous checkpoint {first} is intact" in line
    assert resolve_latest(out) == first and check_files(first, checksums=True) == []
    assert not list((out / "checkpoints").glob(".*partial"))


def test_a_full_disk_inside_torchs_writer_is_one_line_and_keeps_the_previous_checkpoint(tiny_bert_dir, tmp_path,
                                                                                         monkeypatch):
    """ENOSPC from the file below torch.save inside DCP's writer: torch raises a RuntimeError while
    handling it, which DCP wraps per rank in a CheckpointException."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream
    data_files = []

    @contextlib.contextmanager
    def create_stream(self, path, mode):  # the second checkpoint's data file runs out of space
        with real(self, path, mode) as stream:
            if str(path).endswith(".distcp"):
                data_files.append(path)
                yield FullDiskStream(stream, room=1 << 20) if len(data_files) == 2 else stream
            else:
                yield stream

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", training={"max_steps": 4},
                           checkpoint={"every_steps": 2}, evaluation={"num_evals": 1})
    rc, _, err = run_cli(["--config", str(cfg)])
    assert len(data_files) == 2
    assert_full_disk_line(rc, err, tmp_path / "out")
    assert "No space left on device" in err


def test_a_full_small_file_system_during_a_save_is_one_line(finished_run, tiny_bert_dir, tmp_path):
    """A real tmpfs with room for one checkpoint and a half: the second save fills it."""
    checkpoint = finished_run / "checkpoints" / CheckpointManager.name_for(2)
    size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
    with small_filesystem(tmp_path / "disk", size * 3 // 2 + (1 << 20)) as disk:
        cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, disk / "out", training={"max_steps": 4},
                               checkpoint={"every_steps": 2}, evaluation={"num_evals": 1})
        rc, _, err = run_cli(["--config", str(cfg)])
        assert_full_disk_line(rc, err, disk / "out")


# ---- integrity ------------------------------------------------------------------------------------
def test_the_manifest_records_every_file_and_auto_skips_a_damaged_checkpoint(finished_run, tiny_bert_dir,
                                                                              tmp_path, caplog):
    out = copy_run(finished_run, tmp_path)
    newest = resolve_latest(out)
    files = json.loads((newest / MANIFEST_FILE).read_text())["files"]
    on_disk = sorted(str(p.relative_to(newest)) for p in newest.rglob("*") if p.is_file() and p.name not in (MANIFEST_FILE, "COMPLETE"))
    assert sorted(files) == on_disk and "trainer_state.pt" in files
    assert all(entry["size"] == (newest / name).stat().st_size for name, entry in files.items())
    # Truncate the newest checkpoint's largest data file: auto names it, and resumes from step 2.
    data = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    caplog.set_level("WARNING", logger="ft_framework.checkpointing.manager")
    older = CheckpointManager(out / "checkpoints").latest_complete()
    assert older.name == CheckpointManager.name_for(2)
    assert f"skipping {newest}: {data} has" in caplog.text and "truncated" in caplog.text
    # Resuming, exporting or interpolating that checkpoint by name is refused in one line that names the file.
    with pytest.raises(CheckpointError, match=f"is damaged: {data} has"):
        CheckpointManager(out / "checkpoints").resolve(str(newest))
    assert cli.export_main([str(newest), str(tmp_path / "hf")]) == 2
    from ft_framework.checkpointing.run_weights import RunWeightsError, anchors_from_checkpoint

    with pytest.raises(RunWeightsError, match=f"is damaged: {data} has"):
        anchors_from_checkpoint(newest)


@pytest.mark.parametrize("size", [0, 1, 3 * 4096 + 17])
def test_the_checksum_over_windows_is_xxh3_64_of_the_whole_file(tmp_path, monkeypatch, size):
    import mmap

    import xxhash

    from ft_framework.checkpointing import manifest

    monkeypatch.setattr(manifest, "_WINDOW", mmap.ALLOCATIONGRANULARITY)  # several windows
    data = bytes((i * 7 + 3) % 251 for i in range(size))
    (tmp_path / "f").write_bytes(data)
    assert manifest._digest(tmp_path / "f") == xxhash.xxh3_64(data).hexdigest()


def test_export_verify_names_a_changed_file(finished_run, tmp_path, capsys):
    out = copy_run(finished_run, tmp_path)
    assert cli.export_main([str(out), "--verify"]) == 0
    assert "files match the sizes and checksums" in capsys.readouterr().out
    state = resolve_latest(out) / "trainer_state.pt"
    raw = bytearray(state.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, one bit pattern changed: only the checksum sees it
    state.write_bytes(bytes(raw))
    assert cli.export_main([str(out), "--verify"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"{state} has changed since it was saved" in err


# ---- every path a user would try ------------------------------------------------------------------
def test_every_path_to_a_checkpoint_resolves_to_the_latest(finished_run, tmp_path, capsys):
    newest = finished_run / "checkpoints" / CheckpointManager.name_for(4)
    for path in (finished_run, finished_run / "checkpoints", finished_run / "checkpoints" / "latest", newest):
        assert resolve_latest(path) == newest, path
    with pytest.raises(CheckpointError, match="does not exist: pass a run's output directory"):
        resolve_latest(tmp_path / "nowhere")
    assert cli.export_main([str(finished_run / "checkpoints" / "latest"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
    assert cli.export_main([str(tmp_path / "nowhere"), str(tmp_path / "hf2")]) == 2
    assert "ft-export: error:" in capsys.readouterr().err


def test_interpolate_accepts_the_checkpoint_paths_of_a_run(finished_run):
    from ft_framework.interpolate import run_dir_of

    for path in (finished_run, finished_run / "checkpoints", finished_run / "checkpoints" / "latest",
                 finished_run / "checkpoints" / CheckpointManager.name_for(2)):
        assert run_dir_of(path) == finished_run, path


# ---- a checkpoint is data, never code -------------------------------------------------------------
class Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, payload_key: str, name: str) -> Path:
    marker = Path(PLANTED.format(name))
    marker.unlink(missing_ok=True)
    torch.save({payload_key: Planted(marker)}, path)
    return marker


def test_every_reader_refuses_a_pickle_that_would_run_code(finished_run, tiny_bert_dir, tmp_path):
    from ft_framework.checkpointing.legacy import _read_single
    from ft_framework.checkpointing.run_weights import RunWeightsError, load_tensors

    out = copy_run(finished_run, tmp_path)
    # The resume reads trainer_state.pt.
    state = resolve_latest(out) / "trainer_state.pt"
    marker = plant(state, "train_state", "resume")
    # Whoever planted it rewrote the manifest too: the sizes match, the pickle itself is refused.
    record_files(state.parent, file_records(state.parent))
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, out, training={"max_steps": 6},
                           checkpoint={"resume_from": "latest"})
    rc, _, err = run_cli(["--config", str(cfg)])
    assert rc == 2 and len(ft_lines(err)) == 1 and "posix.system" in err and "never unpickled" in err
    assert "Traceback" not in err
    assert not marker.exists()
    # ft-interpolate reads old single-process checkpoints.
    marker = plant(tmp_path / "model.pt", "weight", "interpolate")
    with pytest.raises(RunWeightsError, match="never unpickled"):
        load_tensors(tmp_path / "model.pt")
    assert not marker.exists()
    # The legacy converter reads the old optimizer.pt.
    old = tmp_path / "old"
    old.mkdir()
    torch.save({}, old / "model.pt")
    marker = plant(old / "optimizer.pt", "optimizer", "legacy")
    with pytest.raises(ValueError, match="never unpickled"):
        _read_single(old)
    assert not marker.exists()


def plant_dcp_metadata(checkpoint: Path, name: str) -> Path:
    """A pickle that would run code, as the checkpoint's DCP index, with the manifest rewritten to
    match it (the manifest is no signature)."""
    marker = Path(PLANTED.format(name))
    marker.unlink(missing_ok=True)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Planted(marker)))
    if (checkpoint / MANIFEST_FILE).is_file():
        record_files(checkpoint, file_records(checkpoint))
        assert check_files(checkpoint, checksums=True) == []
    return marker


def refused_in_one_line(err: str, prog: str) -> bool:
    lines = [line for line in err.splitlines() if line.startswith(prog)]
    return (len(lines) == 1 and "Traceback" not in err and ".metadata refers to posix.system" in lines[0]
            and "never unpickled" in lines[0])


def test_a_planted_dcp_metadata_runs_no_code_on_any_reader(finished_run, tiny_bert_dir, tmp_path, caplog, capsys):
    from ft_framework.checkpointing.legacy import main as convert_main

    out = copy_run(finished_run, tmp_path)
    newest, older = resolve_latest(out), out / "checkpoints" / CheckpointManager.name_for(2)
    marker = plant_dcp_metadata(newest, "dcp_metadata")
    # Resume: refused before anything is loaded.
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, out, training={"max_steps": 6},
                           checkpoint={"resume_from": "latest"})
    rc, _, err = run_cli(["--config", str(cfg)])
    assert rc == 2 and refused_in_one_line(err, "ft-train"), err
    # resume_from=auto skips it, says why, and resumes from the one before.
    caplog.set_level("WARNING", logger="ft_framework.checkpointing.manager")
    assert CheckpointManager(out / "checkpoints").latest_complete() == older
    assert f"skipping {newest}: checkpoint {newest}: .metadata refers to posix.system" in caplog.text
    # ft-export and ft-interpolate (the run's final weights are that checkpoint's).
    capsys.readouterr()
    assert cli.export_main([str(newest), str(tmp_path / "hf")]) == 2
    assert refused_in_one_line(capsys.readouterr().err, "ft-export")
    assert cli.interpolate_main([str(out), "--no-plot"]) == 2
    assert refused_in_one_line(capsys.readouterr().err, "ft-interpolate")
    # The legacy converter and ft-interpolate read the old FSDP format (a bare DCP checkpoint).
    old = tmp_path / "old_fsdp"
    old.mkdir()
    (old / "fsdp_checkpoint.json").write_text("{}")
    plant_dcp_metadata(old, "dcp_metadata")
    assert convert_main([str(old), str(tmp_path / "new")]) == 2
    assert refused_in_one_line(capsys.readouterr().err, "python -m ft_framework.checkpointing.legacy")
    from ft_framework.checkpointing.run_weights import anchors_from_checkpoint

    with pytest.raises(CheckpointFormatError, match=r"\.metadata refers to posix\.system, .* never unpickled"):
        anchors_from_checkpoint(old)
    assert not marker.exists()


# ---- a sweep that gets SIGTERM ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_sweep_stopped_by_sigterm_resumes_its_run_from_the_checkpoint(tiny_bert_dir, tmp_path, monkeypatch):
    import yaml

    write_run_config(tmp_path / "base.yaml", tiny_bert_dir, tmp_path / "unused", training={"max_steps": 30},
                     evaluation={"num_evals": 1})
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump({
        "base": "base.yaml", "output_dir": str(tmp_path / "store"), "axes": {"training.seed": [1]},
        "runner": {"name": "local", "max_parallel": 1, "num_cpus_per_run": 1}}))
    cmd = [sys.executable, str(REPO / "launch" / "sweep.py"), "--config", str(tmp_path / "sweep.yaml"), "--no-progress"]
    first = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    run_dir = None
    while time.monotonic() < deadline and first.poll() is None:
        found = list((tmp_path / "store" / "runs").glob("*/metrics.jsonl"))
        if found and any(r.get("type") == "train" and r["step"] >= 2 for r in read_jsonl(found[0])):
            run_dir = found[0].parent
            first.send_signal(signal.SIGTERM)
            break
        time.sleep(0.02)
    out = first.communicate(timeout=120)[0]
    assert run_dir is not None and first.returncode == 143, out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "interrupted" and "checkpoint saved" in status["error"], status
    step = json.loads((run_dir / "results.json").read_text())["steps"]
    # The same command again, as ft-sweep's function in this process (the sweep's run is a process of
    # its own, as in the first).
    for name, value in env().items():
        monkeypatch.setenv(name, value)
    code, output = sweep_in_this_process(tmp_path, cmd[2:])
    assert code == 0, output
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "finished" and status["attempts"] == 2
    assert f"resumed from {run_dir / 'checkpoints' / CheckpointManager.name_for(step)} at step {step}" in \
        (run_dir / "log.txt").read_text()
    train_steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["type"] == "train"]
    assert train_steps == list(range(1, 31))
