"""lm-eval benchmarks scored on the live model under every strategy equal one process's: each of 2
CPU ranks scores a share of every task's requests through the sharded forward (FSDP2, DeepSpeed
ZeRO-3: collective, so the shares are padded to the same batches and the greedy generations run
as long as the longest rank's) and the answers are gathered (ZeRO-1 and DDP too); the serial and
overlapped offloads in this process. Multiple choice, generation (with stop sequences) and rolling perplexity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_eval_tasks import GEN_TASK, MC_TASK, ROLLING_TASK, write_lm_eval_tasks
from rank_launcher import FIT_WORKER, fit_step, launch
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

pytest.importorskip("deepspeed")
pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

TWO_RANK = {"fsdp": {"name": "fsdp"}, "zero3": {"name": "deepspeed", "deepspeed": {"zero_stage": 3}},
            "zero1": {"name": "deepspeed", "deepspeed": {"zero_stage": 1}}, "ddp": {"name": "ddp"}}


def benchmark_run(root: Path, name: str, model: Path, files: dict, tasks: list, **sections) -> Path:
    evaluation = {"num_evals": 1, "batch_size": 8, "forgetting": {"enabled": False}, "generation": {"samples": 0},
                  "benchmarks": {"tasks": tasks, "batch_size": 2}}
    return write_sft_run_config(root / f"{name}.yaml", model, root / name, files, evaluation=evaluation,
                                optimizer={"name": "adamw", "hparams": {"lr": 1e-2}}, **sections)


def fit(config: Path) -> dict:
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    trainer = Trainer(load_config(config))
    results = trainer.fit()
    trainer.strategy.close()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_benchmark_strategies")
    mc, gen, text = write_lm_eval_tasks(root / "tasks")
    tasks = [{"path": str(mc), "num_fewshot": 1}, {"path": str(gen)}, {"path": str(text), "limit": 5}]
    model, files = build_tiny_llm_dir(root / "llama", "llama"), write_sft_rows(root / "data")
    out = {"single": fit(benchmark_run(root, "single", model, files, tasks))}
    for offload in (False, True):  # the optimizer offloaded to the host, serial or overlapped with backward
        name = f"offload_overlap_{offload}".lower()
        out[name] = fit(benchmark_run(root, name, model, files, tasks,
                                      strategy={"name": "single", "offload_optimizer": {"overlap": offload}}))
    configs = [benchmark_run(root, name, model, files, tasks, strategy=strategy, training={"per_device_batch_size": 4})
               for name, strategy in TWO_RANK.items()]
    launch(FIT_WORKER, [fit_step(c) for c in configs], root)
    for name in TWO_RANK:
        out[name] = json.loads((root / name / "results.json").read_text())
    return out


@pytest.mark.parametrize("strategy", [*TWO_RANK, "offload_overlap_false", "offload_overlap_true"])
def test_the_scores_equal_one_process(runs, strategy):
    want, got = runs["single"]["benchmarks"], runs[strategy]["benchmarks"]
    assert list(got) == [MC_TASK, GEN_TASK, ROLLING_TASK]
    for task in want:
        # θ* is the same model everywhere: its scores agree to 1e-6.
        assert got[task]["theta_star"] == pytest.approx(want[task]["theta_star"], rel=1e-6, abs=1e-6), task
        assert got[task]["theta_star_stderr"] == pytest.approx(want[task]["theta_star_stderr"], rel=1e-6, abs=1e-6)
        # The trained models agree as the training does (its losses to 1e-5: test_llm_strategies.py); the
        # counted scores exactly.
        assert got[task]["score"] == pytest.approx(want[task]["score"], rel=1e-5, abs=1e-6), task
    assert got[MC_TASK]["score"] == want[MC_TASK]["score"] and got[GEN_TASK]["score"] == want[GEN_TASK]["score"]
    assert runs[strategy]["benchmark_forgetting"] == pytest.approx(runs["single"]["benchmark_forgetting"], rel=1e-5)
