"""lm-evaluation-harness benchmarks inside a decoder's run (evaluation.benchmarks): the in-run scores
of θ* and of the trained model equal lm-eval's own `--model hf` run on θ*'s directory and on the
run's export (multiple choice, generation, rolling perplexity, and the shipped task by name);
results.json, metrics.jsonl and the printed table carry them; a resumed run reads θ*'s scores back
instead of scoring moved weights; the config's one-line refusals."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from lm_eval_tasks import GEN_TASK, MC_TASK, ROLLING_TASK, write_lm_eval_tasks
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config
from ft_framework.config import load_config
from ft_framework.errors import UserError
from ft_framework.resources import benchmarks_dir
from ft_framework.run.results import format_results_table
from ft_framework.trainer import Trainer

SHIPPED_TASK = "wordnet_gloss"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_benchmarks")
    mc, gen, text = write_lm_eval_tasks(root / "tasks")
    return {"root": root, "model": build_tiny_llm_dir(root / "llama", "llama"), "files": write_sft_rows(root / "data"),
            "tasks": [{"path": str(mc), "num_fewshot": 1}, {"path": str(gen)}, {"path": str(text), "limit": 5},
                      {"name": SHIPPED_TASK, "limit": 6}]}


def benchmark_config(setup, tmp_path, name="run", benchmarks=None, **sections):
    evaluation = {"num_evals": 2, "batch_size": 8, "forgetting": {"enabled": False}, "generation": {"samples": 0},
                  "benchmarks": benchmarks or {"tasks": setup["tasks"], "every_eval": True, "batch_size": 3}}
    sections = {"training": {"max_steps": 6}, "optimizer": {"name": "adamw", "hparams": {"lr": 1e-2}},
                "evaluation": evaluation, **sections}
    return write_sft_run_config(tmp_path / f"{name}.yaml", setup["model"], tmp_path / name, setup["files"], **sections)


def lm_eval_hf(model_dir: Path, task: dict, include: list[Path]) -> dict:
    """lm-eval's own run of `task` on the Hugging Face model in `model_dir` (its tokenizer beside it)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[str(p) for p in include], include_defaults=False)
    name = task.get("name") or next(n for n, e in manager.task_index.items()
                                    if str(getattr(e, "yaml_path", "")) == str(Path(task["path"]).resolve()))
    results = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32",
                                      tasks=[name], num_fewshot=task.get("num_fewshot"), limit=task.get("limit"),
                                      batch_size=1, device="cpu", task_manager=manager, log_samples=False)
    return results["results"][name]


def test_in_run_scores_equal_lm_evals_hf_run_on_theta_star_and_on_the_export(setup, tmp_path):
    export = tmp_path / "export"
    results = Trainer(load_config(benchmark_config(setup, tmp_path, checkpoint={"export_dir": str(export)}))).fit()
    scores = results["benchmarks"]
    assert list(scores) == [MC_TASK, GEN_TASK, ROLLING_TASK, SHIPPED_TASK]
    include = [setup["root"] / "tasks", benchmarks_dir()]
    for task, name in zip(setup["tasks"], scores):
        for model_dir, key in ((setup["model"], "theta_star"), (export, "score")):
            theirs = lm_eval_hf(model_dir, task, include)
            metric = scores[name]["metric"]
            stderr = scores[name]["stderr" if key == "score" else "theta_star_stderr"]
            assert scores[name][key] == pytest.approx(theirs[metric], abs=1e-6, rel=1e-6), (name, key)
            their_stderr = theirs[metric.replace(",", "_stderr,")]  # "N/A" where lm-eval gives none (perplexity)
            assert stderr == (None if their_stderr == "N/A" else pytest.approx(their_stderr, abs=1e-6, rel=1e-6)), (
                name, key)
    # Perplexity is lower-is-better: its drop is the rise; the run trained on these very rows.
    rolling = scores[ROLLING_TASK]
    assert rolling["metric"] == "word_perplexity,none" and rolling["score"] < rolling["theta_star"]
    assert rolling["drop"] == pytest.approx(rolling["score"] - rolling["theta_star"])
    assert scores[MC_TASK]["drop"] == pytest.approx(scores[MC_TASK]["theta_star"] - scores[MC_TASK]["score"])
    # The mean drop averages the rates (accuracy, exact match), not the perplexity's rise.
    assert [s["rate"] for s in scores.values()] == [True, True, False, True]
    rates = [scores[name]["drop"] for name in (MC_TASK, GEN_TASK, SHIPPED_TASK)]
    assert results["benchmark_forgetting"] == pytest.approx(sum(rates) / 3)
    assert results["benchmarks_run"]["step"] == 6 and len(results["benchmarks_run"]["tasks"]) == 4
    # every_eval: each evaluation's row carries them; θ*'s scores are kept in the run's directory.
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [3, 6] and all(set(e["benchmarks"]) == set(scores) for e in evals)
    kept = json.loads((tmp_path / "run" / "benchmark_reference.json").read_text())["scores"]
    assert {n: s["score"] for n, s in kept.items()} == {n: s["theta_star"] for n, s in scores.items()}
    table = format_results_table(results)
    assert "θ* (before)" in table and f"{MC_TASK}" in table
    assert f"over the 3 task(s) scored by a rate: {MC_TASK}, {GEN_TASK}, {SHIPPED_TASK})" in table


def test_a_resumed_run_reads_theta_stars_scores_back(setup, tmp_path):
    config = benchmark_config(setup, tmp_path, benchmarks={"tasks": setup["tasks"][:1], "batch_size": 4},
                              checkpoint={"every_steps": 3})
    first = Trainer(load_config(config)).fit(stop_after_step=3)
    assert first == {"stopped_at_step": 3}
    reference = tmp_path / "run" / "benchmark_reference.json"
    kept = json.loads(reference.read_text())
    # A resume that scored θ* again (on the moved weights) would not see this planted value.
    kept["scores"][MC_TASK]["score"] = 0.625
    reference.write_text(json.dumps(kept))
    results = Trainer(load_config(config, ["checkpoint.resume_from=auto"])).fit()
    assert results["benchmarks"][MC_TASK]["theta_star"] == 0.625
    # Without every_eval, the end's evaluation alone scores them.
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [("benchmarks" in e) for e in evals if e["type"] == "eval"] == [False, True]
    # Other tasks than the run started with: refused in one line.
    other = benchmark_config(setup, tmp_path, benchmarks={"tasks": setup["tasks"][1:2]}, checkpoint={"every_steps": 3},
                             training={"max_steps": 9})
    with pytest.raises(UserError, match="other tasks"):
        Trainer(load_config(other, ["checkpoint.resume_from=auto"])).fit()


def test_the_config_refuses_benchmarks_it_cannot_score(setup, tmp_path, tiny_bert_dir, monkeypatch):
    from tiny_run import write_run_config

    encoder = write_run_config(tmp_path / "enc.yaml", tiny_bert_dir, tmp_path / "enc",
                               evaluation={"benchmarks": {"tasks": [{"name": "hellaswag"}]}})
    with pytest.raises(UserError, match="evaluation.benchmarks scores a decoder LLM"):
        load_config(encoder)
    both = benchmark_config(setup, tmp_path, benchmarks={"tasks": [{"name": "x", "path": "y.yaml"}]})
    with pytest.raises(UserError, match="exactly one of name and path"):
        load_config(both)
    not_yaml = benchmark_config(setup, tmp_path, benchmarks={"tasks": [{"path": "tasks/arc.json"}]})
    with pytest.raises(UserError, match="must be an lm-eval task YAML"):
        load_config(not_yaml)
    ok = benchmark_config(setup, tmp_path, name="ok", benchmarks={"tasks": setup["tasks"][:1]})
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real_find_spec(
        name, *a))
    with pytest.raises(UserError, match=r"needs lm-evaluation-harness: pip install 'ft_framework\[lm_eval\]'"):
        load_config(ok)
    monkeypatch.undo()
    unknown = benchmark_config(setup, tmp_path, name="unknown", benchmarks={"tasks": [{"name": "hellaswagg"}]})
    with pytest.raises(UserError, match=r"lm-eval has no task 'hellaswagg' \(did you mean 'hellaswag'\?\)"):
        Trainer(load_config(unknown)).fit()
