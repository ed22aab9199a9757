"""A resumed decoder run (tiny Llama, SFT) reads the data its checkpoint trained on: the content ids
of its files are in every checkpoint and in results.json; a training file or a data.replay file
edited between the interrupted run and its resume refuses the resume in one line (exit 2 through
ft-train), which checkpoint.allow_config_change accepts and results.json's config_changes records;
an unchanged resume equals the straight run; a checkpoint written before the ids were recorded
resumes with one warning."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

from ft_framework.checkpointing.manager import CheckpointManager
from ft_framework.checkpointing.manifest import file_records, record_files
from ft_framework.cli import train_main
from ft_framework.config import load_config
from ft_framework.data.token_cache import content_hash
from ft_framework.errors import UserError
from ft_framework.run.files import TRAINER_STATE_FILE
from ft_framework.run.fingerprint import DATA_CONTENT
from ft_framework.trainer import Trainer

RESUME = "checkpoint.resume_from=latest"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_llm_dir(tmp_path_factory.mktemp("resume_data") / "llama", "llama")


def fit(config: Path, overrides=(), stop_after_step: int | None = None) -> dict:
    trainer = Trainer(load_config(config, list(overrides)))
    try:
        return trainer.fit(stop_after_step=stop_after_step)
    finally:
        trainer.strategy.close()


def interrupted(model: Path, tmp_path: Path, **sections) -> tuple[Path, dict[str, str]]:
    """A run's config on its own copy of the data, stopped after step 3 with a checkpoint."""
    files = write_sft_rows(tmp_path / "data")
    config = write_sft_run_config(tmp_path / "run.yaml", model, tmp_path / "run", files,
                                  checkpoint={"every_steps": 3}, **sections)
    assert fit(config, stop_after_step=3) == {"stopped_at_step": 3}
    return config, files


def content_changes(results: dict) -> list[dict]:
    """results.json's config changes of a file's content (the others: resume_from, the allow list)."""
    return [change for change in results["config_changes"] if change.get("content")]


def edit(path: str | Path) -> None:
    """The same rows but the first, whose completion changes."""
    lines = Path(path).read_text().splitlines(keepends=True)
    row = json.loads(lines[0])
    lines[0] = json.dumps({**row, "completion": row["completion"] + " again"}) + "\n"
    Path(path).write_text("".join(lines))


def test_an_unchanged_resume_equals_the_straight_run_and_records_its_files(model, tmp_path):
    config, files = interrupted(model, tmp_path)
    full = fit(config, [f"logging.output_dir={tmp_path / 'full'}"])
    resumed = fit(config, [RESUME])
    assert resumed["final"]["metrics"] == full["final"]["metrics"]
    ids = {f"data.files.{split}": content_hash([Path(path)]) for split, path in files.items()}
    assert full["data_content"] == resumed["data_content"] == ids
    assert content_changes(resumed) == []
    saved = torch.load(CheckpointManager(tmp_path / "run" / "checkpoints").latest() / TRAINER_STATE_FILE,
                       weights_only=True)
    assert saved["config_record"][DATA_CONTENT] == ids


def test_a_changed_training_file_refuses_the_resume_in_one_line_until_allowed(model, tmp_path, capsys):
    config, files = interrupted(model, tmp_path)
    old = content_hash([Path(files["train"])])
    edit(files["train"])
    new = content_hash([Path(files["train"])])
    capsys.readouterr()
    assert train_main(["--config", str(config), RESUME]) == 2
    err = capsys.readouterr().err  # the run's log lines, then the error's one line
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("ft-train: error:")]
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003"
    assert errors == [(
        f"ft-train: error: cannot resume from {checkpoint} (step 3): the content of its data differs in "
        f"data.files.train ({files['train']}): {old[:12]} -> {new[:12]}. Resume with the data it trained on, start a "
        "fresh run in another logging.output_dir, or accept the new data with "
        "checkpoint.allow_config_change=[data.files.train]")]
    results = fit(config, [RESUME, "checkpoint.allow_config_change=[data.files.train]"])
    assert content_changes(results) == [{"step": 3, "key": "data.files.train", "old": old, "new": new,
                                          "allowed_by": "checkpoint.allow_config_change", "content": True}]
    assert results["data_content"]["data.files.train"] == new
    on_disk = json.loads((tmp_path / "run" / "results.json").read_text())
    assert content_changes(on_disk) == content_changes(results)


def test_a_replay_file_changed_between_the_runs_is_refused(model, tmp_path):
    replay = tmp_path / "general.txt"
    replay.write_text("The river runs past the old stone mill.\nA second document of general text.\n")
    config, _ = interrupted(model, tmp_path, data={"replay": {"file": str(replay), "fraction": 0.25}})
    old = content_hash([replay])
    replay.write_text("The river runs past the new stone mill.\nA second document of general text.\n")
    with pytest.raises(UserError, match=rf"differs in data.replay.file \({replay}\): {old[:12]} -> "
                                        rf"{content_hash([replay])[:12]}\. .*allow_config_change=\[data.replay.file\]$"):
        fit(config, [RESUME])


def test_a_checkpoint_without_content_ids_resumes_with_one_warning(model, tmp_path, caplog):
    config, files = interrupted(model, tmp_path)
    # As a checkpoint written before the ids were recorded: its record without them, its manifest
    # recording the trainer state's new size and checksum.
    checkpoint = CheckpointManager(tmp_path / "run" / "checkpoints").latest()
    state = torch.load(checkpoint / TRAINER_STATE_FILE, weights_only=True)
    del state["config_record"][DATA_CONTENT]
    torch.save(state, checkpoint / TRAINER_STATE_FILE)
    record_files(checkpoint, file_records(checkpoint))
    edit(files["train"])  # not seen: nothing to compare it with
    with caplog.at_level(logging.WARNING):
        results = fit(config, [RESUME])
    warned = [r.getMessage() for r in caplog.records if "records no content ids" in r.getMessage()]
    assert warned == [f"checkpoint {checkpoint} records no content ids of its data files (written before they were "
                      "recorded): the data this run reads could not be checked against the data it trained on"]
    assert results["steps"] == 6 and content_changes(results) == []
    assert results["data_content"]["data.files.train"] == content_hash([Path(files["train"])])


def test_optimizer_importance_file_is_recorded_when_read_and_kept_by_the_resume_that_reads_it_no_more(model, tmp_path):
    general = tmp_path / "general.txt"
    general.write_text("".join(f"Document {i} of general text, read once for the Fisher.\n" for i in range(8)))
    config, _ = interrupted(model, tmp_path, optimizer={"name": "ewc", "hparams": {"lr": 3e-3, "ewc_lambda": 10.0},
                                                        "importance": {"source": str(general), "batch_size": 4}})
    checkpoint = CheckpointManager(tmp_path / "run" / "checkpoints").latest()
    recorded = torch.load(checkpoint / TRAINER_STATE_FILE, weights_only=True)["config_record"][DATA_CONTENT]
    assert recorded["optimizer.importance.source"] == content_hash([general])
    # F~ is the checkpoint's: the resume does not read the file, so an edit of it is not the resume's.
    general.write_text("Another text.\n" * 8)
    results = fit(config, [RESUME])
    assert results["data_content"] == recorded and content_changes(results) == []
