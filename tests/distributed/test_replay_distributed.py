"""data.replay under 2 ranks equals one process with the same global batch: the step's replay rows
are split across the ranks (slot s to rank s mod 2), so the losses, replay losses, counts and
gradient norms of every step match. Three runs in one launch: under DDP three replay rows a step over
two accumulated micro-batches, and one replay row a step with packed task rows (the other rank's
replay micro-batch is a padding row that counts nothing); under FSDP2 one replay row a step (at least
one, though 0.1 of 4 task rows rounds to none)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rank_launcher import FIT_WORKER, fit_step, launch
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

pytestmark = pytest.mark.slow
RUNS = {  # name: (data.replay, training, data, the 2-rank strategy)
    "three_rows": ({"fraction": 0.3}, {"gradient_accumulation_steps": 2}, {}, "ddp"),
    "one_row_packed": ({"fraction": 0.1}, {"gradient_accumulation_steps": 2}, {"packing": True}, "ddp"),
    "one_row_fsdp": ({"fraction": 0.1}, {}, {}, "fsdp"),
}
GLOBAL_ROWS = 4  # per micro-batch round: one process's per_device_batch_size, two ranks' 2 each


def records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    root = tmp_path_factory.mktemp("replay_ddp")
    files = write_sft_rows(root / "data")
    model = build_tiny_llm_dir(root / "llama", "llama")
    replay = root / "general.txt"
    replay.write_text("".join(f"Line {i} of general text: " + "a quiet morning by the sea. " * (i % 4) + "\n"
                              for i in range(17)))
    configs = []
    for name, (mix, training, data, two_ranks) in RUNS.items():
        def config(ranks: int) -> Path:
            return write_sft_run_config(
                root / f"{name}_{ranks}.yaml", model, root / name / str(ranks), files,
                data={"replay": {"file": str(replay), **mix}, **data},
                strategy={"name": two_ranks if ranks == 2 else "single"},
                training={"max_steps": 3, "per_device_batch_size": GLOBAL_ROWS // ranks, **training},
                evaluation={"num_evals": 1, "generation": {"samples": 0}})
        trainer = Trainer(load_config(config(1)))
        trainer.fit()
        trainer.strategy.close()
        configs.append(config(2))
    launch(FIT_WORKER, [fit_step(c) for c in configs], root)
    return root


@pytest.mark.parametrize("name", list(RUNS))
def test_replay_on_two_ranks_equals_one_process(runs, name):
    want, got = records(runs / name / "1"), records(runs / name / "2")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    rows = {"three_rows": 3, "one_row_packed": 1, "one_row_fsdp": 1}[name]  # replay rows per step
    assert [r["replay_rows"] for r in got] == [r["replay_rows"] for r in want] == [rows] * 3
    assert [r["replay_tokens"] for r in got] == [r["replay_tokens"] for r in want]
    for key in ("loss", "replay_loss", "grad_norm", "forgetting_distance"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key
    a, b = (json.loads((runs / name / ranks / "results.json").read_text()) for ranks in ("1", "2"))
    assert a["replay"] == b["replay"] and a["replay"]["rows_used"] == 3 * rows
    assert b["final"]["metrics"]["validation"] == pytest.approx(a["final"]["metrics"]["validation"], rel=1e-5)
