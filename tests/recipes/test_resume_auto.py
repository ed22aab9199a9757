"""checkpoint.resume_from: auto - what a restarted job is given: the latest complete checkpoint when
there is one, else a fresh start; never refused by the output-directory guard. (Under torchrun
--max-restarts with a worker killed: tests/multinode/test_elastic_restart.py.)"""

import json
from pathlib import Path

from ft_framework.checkpointing.manager import CheckpointManager
from ft_framework.config import load_config
from ft_framework.trainer import Trainer
from tiny_run import write_run_config


def read_jsonl(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def run(config_path, overrides=(), stop_after_step=None):
    trainer = Trainer(load_config(config_path, list(overrides)))
    return trainer, trainer.fit(stop_after_step=stop_after_step)


def test_auto_starts_fresh_then_resumes_from_the_latest_checkpoint(tiny_bert_dir, tmp_path, caplog):
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, tmp_path / "out", training={"max_steps": 6},
                           checkpoint={"every_steps": 2, "resume_from": "auto"}, evaluation={"num_evals": 2})
    full = write_run_config(tmp_path / "full.yaml", tiny_bert_dir, tmp_path / "full", training={"max_steps": 6},
                            evaluation={"num_evals": 2})
    run(full)
    caplog.set_level("INFO", logger="ft_framework.run.start")
    # A first attempt: nothing to resume, so a fresh start (no error); it stops after step 3 (saving a
    # checkpoint there, as a preempted run does).
    assert run(cfg, stop_after_step=3)[1] == {"stopped_at_step": 3}
    assert "resume_from=auto: no complete checkpoint" in caplog.text
    # The restart resumes from it and ends where the uninterrupted run ends.
    trainer, results = run(cfg)
    assert trainer.state.step == 6 and "resume_from=auto: resuming from" in caplog.text
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl") == read_jsonl(tmp_path / "full" / "metrics.jsonl")
    assert results["final"] == json.loads((tmp_path / "full" / "results.json").read_text())["final"]


def test_auto_without_a_checkpoint_moves_an_earlier_attempt_aside_instead_of_refusing(tiny_bert_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    # An attempt killed before its first checkpoint left its logs.
    (out / "metrics.jsonl").write_text('{"type": "train", "step": 1, "loss": 9.0}\n')
    cfg = write_run_config(tmp_path / "run.yaml", tiny_bert_dir, out, training={"max_steps": 2},
                           checkpoint={"resume_from": "auto"}, evaluation={"num_evals": 1})
    _, results = run(cfg)
    assert results["steps"] == 2
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train"] == [1, 2]
    [aside] = out.glob("overwritten-*")
    assert (aside / "metrics.jsonl").read_text().startswith('{"type": "train", "step": 1, "loss": 9.0}')


def test_latest_complete_skips_an_incomplete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root)
    assert manager.latest_complete() is None
    for step, complete in ((2, True), (4, True), (6, False)):
        directory = root / manager.name_for(step)
        directory.mkdir(parents=True)
        (directory / "trainer_state.pt").write_bytes(b"x")
        if complete:
            (directory / "COMPLETE").write_text("{}")
    assert manager.latest_complete() == root / manager.name_for(4)
    (root / "latest").write_text(manager.name_for(2))
    assert manager.latest_complete() == root / manager.name_for(2)  # the pointer wins when complete
    (root / "latest").write_text(manager.name_for(6))
    assert manager.latest_complete() == root / manager.name_for(4)
