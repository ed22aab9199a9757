"""The content of the data a run reads, recorded in its checkpoints and checked on a resume
(run/fingerprint.py: check_data_content; the task kinds' data_content): a changed file refuses the
resume in one line naming the key, the file and both short ids, unless allowed (then recorded as a
config change); a checkpoint without content ids resumes with one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from tiny_run import write_run_config

from ft_framework.config import load_config
from ft_framework.data.readers import source_files
from ft_framework.data.token_cache import content_hash
from ft_framework.run.fingerprint import DATA_CONTENT, ResumeRefused, check_data_content, config_record
from ft_framework.task_kinds import build_task_kind

CONFIG = {"data": {"files": {"train": "/data/train.jsonl", "validation": "/data/dev.jsonl"},
                   "replay": {"file": "/data/general.txt"}},
          "optimizer": {"importance": {"source": "/data/fisher.txt"}},
          "evaluation": {"forgetting": {"probe_file": "/data/probe.txt"}}}
OLD = {"data.files.train": "a" * 32, "data.files.validation": "b" * 32, "data.replay.file": "c" * 32,
       "optimizer.importance.source": "d" * 32}


def saved(ids=OLD, config=CONFIG):
    return config_record(config, 1, data_content=ids)


def test_the_record_holds_the_content_ids_beside_the_config():
    record = saved()
    assert record[DATA_CONTENT] == OLD and record["config"] == CONFIG
    # The fingerprint is the config's: the same with other data.
    assert record["fingerprint"] == config_record(CONFIG, 1, data_content={})["fingerprint"]


def test_the_same_content_resumes_without_a_change():
    content, changes = check_data_content(saved(), {**OLD}, CONFIG, step=4)
    assert content == OLD and changes == []


def test_a_changed_training_file_refuses_in_one_line_naming_key_file_and_both_short_ids():
    with pytest.raises(ResumeRefused) as refused:
        check_data_content(saved(), {**OLD, "data.files.train": "e" * 32}, CONFIG, step=4, where="/run/step_4")
    message = str(refused.value)
    assert "\n" not in message
    assert message == (
        "cannot resume from /run/step_4 (step 4): the content of its data differs in data.files.train "
        f"(/data/train.jsonl): {'a' * 12} -> {'e' * 12}. Resume with the data it trained on, start a fresh run in "
        "another logging.output_dir, or accept the new data with checkpoint.allow_config_change=[data.files.train]")


def test_every_changed_file_is_named_in_the_one_line():
    with pytest.raises(ResumeRefused, match=r"data.files.train \(/data/train.jsonl\): a{12} -> e{12}; "
                                            r"data.replay.file \(/data/general.txt\): c{12} -> f{12}\. .*"
                                            r"allow_config_change=\[data.files.train,data.replay.file\]$"):
        check_data_content(saved(), {**OLD, "data.files.train": "e" * 32, "data.replay.file": "f" * 32}, CONFIG,
                           step=4)


def test_an_allowed_change_passes_and_is_returned_as_a_config_change():
    current = {**OLD, "data.replay.file": "f" * 32}
    content, changes = check_data_content(saved(), current, CONFIG, step=4, allowed_by_user=["data.replay"])
    assert content == current
    assert changes == [{"step": 4, "key": "data.replay.file", "old": "c" * 32, "new": "f" * 32,
                        "allowed_by": "checkpoint.allow_config_change", "content": True}]


def test_the_probe_file_may_change_as_evaluation_forgetting_may():
    old = {**OLD, "evaluation.forgetting.probe_file": "1" * 32}
    content, changes = check_data_content(saved(old), {**old, "evaluation.forgetting.probe_file": "2" * 32}, CONFIG,
                                          step=4)
    assert changes == [{"step": 4, "key": "evaluation.forgetting.probe_file", "old": "1" * 32, "new": "2" * 32,
                        "allowed_by": "allowed on resume", "content": True}]
    assert content["evaluation.forgetting.probe_file"] == "2" * 32


def test_a_file_read_only_by_the_fresh_run_keeps_its_recorded_id_while_the_config_names_it():
    # optimizer.importance's text is read before the first step: a resume reads it no more.
    unread = {k: v for k, v in OLD.items() if k != "optimizer.importance.source"}
    content, changes = check_data_content(saved(), unread, CONFIG, step=4)
    assert content == OLD and changes == []
    # ... and not once the config names another file (that change is the config check's to allow).
    other = {**CONFIG, "optimizer": {"importance": {"source": "/data/other.txt"}}}
    content, _ = check_data_content(saved(), unread, other, step=4)
    assert content == unread


@pytest.mark.parametrize("record", [None, {"config": CONFIG, "world_size": 1}], ids=["no record", "no ids"])
def test_a_checkpoint_without_content_ids_resumes_with_one_warning(record, caplog):
    with caplog.at_level(logging.WARNING):
        content, changes = check_data_content(record, OLD, CONFIG, step=4, where="/run/step_4")
    assert content == OLD and changes == []
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["checkpoint /run/step_4 records no content ids of its data files (written before they were "
                        "recorded): the data this run reads could not be checked against the data it trained on"]


def test_a_classifier_on_own_files_records_each_split_by_its_bytes(tiny_bert_dir, tmp_path):
    train, dev, probe = tmp_path / "train.csv", tmp_path / "dev.csv", tmp_path / "probe.txt"
    train.write_text("text,label\ngood film,1\nbad film,0\n")
    dev.write_text("text,label\nfine,1\n")
    probe.write_text("A sentence.\nAnother one.\n")
    config = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "run",
                              evaluation={"forgetting": {"probe_file": str(probe)}})
    config.write_text(config.read_text().replace("task: sst2", "task: null").replace(
        "source: builtin:quickstart", f"source: files\n  problem: classification\n  text_columns: [text]\n"
        f"  label_column: label\n  labels: ['0', '1']\n  files: {{train: {train}, validation: {dev}}}"))
    kind = build_task_kind(load_config(config))
    assert kind.data_content(None) == {"data.files.train": content_hash([train]),
                                       "data.files.validation": content_hash([dev]),
                                       "evaluation.forgetting.probe_file": content_hash([probe])}
    before = kind.data_content(None)["data.files.train"]
    train.write_text("text,label\ngood film,1\nbad film,1\n")
    assert build_task_kind(load_config(config)).data_content(None)["data.files.train"] != before
    assert content_hash(source_files(Path(train), "train")) != before
