"""data.replay in a decoder's run (tiny Llama): every step holds its task rows and the replay rows of
the keyed draw; the step's objective is the mean next-token loss over the task rows' completion
tokens and the replay rows' every token together, checked against a reference computed here with
transformers' model directly; the logs and results.json count them; a resumed run equals the
straight one; packing mixes with replay."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tiny_llm import build_tiny_llm_dir, build_tiny_tokenizer, write_sft_rows, write_sft_run_config

from ft_framework.config import load_config
from ft_framework.counter_rng import STREAM_REPLAY_ROWS, lowbias32_int, stream_key
from ft_framework.data.sharding import epoch_batches
from ft_framework.trainer import Trainer

DOCUMENTS = [f"Document {i}: " + " ".join(["the river runs past the old stone mill"] * (1 + i % 5)) for i in range(23)]
BATCH, DATA_SEED, FRACTION = 6, 2, 0.25
TASK_ROWS = 48
MAX_LENGTH = 64  # write_sft_run_config's data.max_seq_length


def records(run_dir: Path, kind: str = "train") -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def fit(config: Path, overrides=()) -> dict:
    trainer = Trainer(load_config(config, list(overrides)))
    try:
        return trainer.fit()
    finally:
        trainer.strategy.close()


def drawn_rows(step: int, count: int, num_rows: int) -> list[int]:
    """The replay rows of `step`'s slots, from counter_rng's Python-int hash (not the tensor one)."""
    key = stream_key(DATA_SEED, STREAM_REPLAY_ROWS, step)
    return [(lowbias32_int(lowbias32_int(key ^ slot) ^ 0) * num_rows) >> 32 for slot in range(count)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay")
    replay = root / "general.txt"
    # Blank lines are no documents; a line is one.
    replay.write_text("\n".join(d + ("\n" if i % 7 == 3 else "") for i, d in enumerate(DOCUMENTS)) + "\n")
    return {"model": build_tiny_llm_dir(root / "llama", "llama"), "files": write_sft_rows(root / "data"),
            "replay": replay}


def replay_config(setup, tmp_path, name="run", **sections) -> Path:
    sections.setdefault("training", {})
    sections["training"] = {"max_steps": 6, "per_device_batch_size": BATCH, "data_seed": DATA_SEED,
                            "max_grad_norm": 1e9, **sections["training"]}
    sections["data"] = {"replay": {"file": str(setup["replay"]), "fraction": FRACTION}, **sections.get("data", {})}
    return write_sft_run_config(tmp_path / f"{name}.yaml", setup["model"], tmp_path / name, setup["files"], **sections)


def reference_step(model_dir: Path, train_file: str, step_rows: list[int], replay_rows: list[int]):
    """(task loss sum, task tokens, replay loss sum, replay tokens, gradient norm of the step's mean
    over both) on the model as saved, tokenized here: a prompt's tokens carry no loss, a replay
    document's every token after its first does; each row ends with the EOS token."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tiny_tokenizer()
    eos = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rows = [json.loads(line) for line in Path(train_file).read_text().splitlines()]
    sums = {"task": [torch.zeros((), dtype=torch.float64), 0], "replay": [torch.zeros((), dtype=torch.float64), 0]}
    pieces = [("task", rows[i]["prompt"], rows[i]["completion"] + eos) for i in step_rows]
    pieces += [("replay", "", DOCUMENTS[i] + eos) for i in replay_rows]
    for what, prompt, rest in pieces:
        ids = tokenizer(prompt + rest)["input_ids"][:MAX_LENGTH]  # a document is cut to data.max_seq_length
        first_target = max(1, len(tokenizer(prompt)["input_ids"]) if prompt else 1)
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
        targets = torch.tensor(ids[first_target:])
        sums[what][0] = sums[what][0] + F.cross_entropy(logits[first_target - 1:len(ids) - 1], targets, reduction="sum")
        sums[what][1] += len(targets)
    (task, n_task), (replay, n_replay) = sums["task"], sums["replay"]
    ((task + replay) / (n_task + n_replay)).backward()
    norm = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters() if p.grad is not None))
    return float(task.detach()), n_task, float(replay.detach()), n_replay, norm


def test_a_step_mixes_the_drawn_replay_rows_and_its_loss_is_the_mean_over_both(setup, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ft_framework"):
        results = fit(replay_config(setup, tmp_path, optimizer={"name": "adamw", "hparams": {"lr": 1e-3}}))
    # The run's start says what it mixes in.
    assert (f"replay: 2 rows of general text join the 6 task rows of every optimizer step (fraction 0.25 asked, "
            f"0.250 taken), drawn from {setup['replay']} ({len(DOCUMENTS)} rows, sha256 ") in caplog.text
    per_step = round(FRACTION / (1 - FRACTION) * BATCH)  # 2 replay rows beside 6 task rows
    assert per_step == 2
    logged = records(tmp_path / "run")
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 5, 6]
    assert all(r["replay_rows"] == per_step for r in logged)
    # The step-1 loss, replay loss and gradient over the rows the epoch order and the keyed draw name.
    task_rows = epoch_batches(TASK_ROWS, batch_size=BATCH, data_seed=DATA_SEED, epoch=0, rank=0, world_size=1)[0]
    replay_rows = drawn_rows(0, per_step, len(DOCUMENTS))
    task, n_task, replay, n_replay, norm = reference_step(setup["model"], setup["files"]["train"], task_rows,
                                                          replay_rows)
    first = logged[0]
    assert first["replay_tokens"] == n_replay
    assert first["loss"] == pytest.approx(task / n_task, rel=1e-5)
    assert first["replay_loss"] == pytest.approx(replay / n_replay, rel=1e-5)
    assert first["grad_norm"] == pytest.approx(norm, rel=1e-4)
    record = results["replay"]
    assert record["file"] == str(setup["replay"]) and record["fraction"] == FRACTION
    assert record["sha256"] == hashlib.sha256(setup["replay"].read_bytes()).hexdigest()
    assert record["rows_in_file"] == len(DOCUMENTS) and record["rows_per_step"] == per_step
    assert record["rows_used"] == 6 * per_step
    drawn = {row for step in range(6) for row in drawn_rows(step, per_step, len(DOCUMENTS))}
    assert record["distinct_rows_used"] == len(drawn)


def test_a_resumed_replay_run_equals_the_straight_one(setup, tmp_path):
    config = replay_config(setup, tmp_path, checkpoint={"every_steps": 3}, data={"packing": True})
    full = fit(config)
    trainer = Trainer(load_config(config, [f"logging.output_dir={tmp_path / 'resumed'}"]))
    assert trainer.fit(stop_after_step=3) == {"stopped_at_step": 3}
    trainer.strategy.close()
    resumed = fit(config, [f"logging.output_dir={tmp_path / 'resumed'}", "checkpoint.resume_from=latest"])
    keys = ("loss", "replay_loss", "replay_rows", "replay_tokens", "grad_norm")
    assert [[r[k] for k in keys] for r in records(tmp_path / "resumed")] == \
        [[r[k] for k in keys] for r in records(tmp_path / "run")]
    assert resumed["final"]["metrics"] == full["final"]["metrics"]
    assert resumed["replay"] == full["replay"]


def test_without_replay_the_logs_and_results_hold_none(setup, tmp_path):
    config = write_sft_run_config(tmp_path / "plain.yaml", setup["model"], tmp_path / "plain", setup["files"],
                                  training={"max_steps": 2})
    results = fit(config)
    assert "replay" not in results
    assert not any("replay_loss" in r for r in records(tmp_path / "plain"))
