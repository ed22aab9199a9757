"""An ft-export directory speaks lm-evaluation-harness's language, offline: lm-eval's `hf` model scores
the shipped task wordnet_gloss on it through the Python API (each choice's log-likelihood equal to
the export's own forward, so the accuracies are the export's), and the `lm_eval` command runs a
user's own task YAML with local JSON-lines files on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config
from ft_framework.config import load_config
from ft_framework.resources import benchmarks_dir
from ft_framework.trainer import Trainer

pytest.importorskip("lm_eval")

OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
    """A tiny Llama fine-tuned for a few steps, its weights exported by the run (checkpoint.export_dir)."""
    root = tmp_path_factory.mktemp("lm_eval_export")
    model = build_tiny_llm_dir(root / "llama", "llama")
    config = write_sft_run_config(root / "run.yaml", model, root / "run", write_sft_rows(root / "data"),
                                  training={"max_steps": 4}, evaluation={"num_evals": 1, "batch_size": 8,
                                                                         "forgetting": {"enabled": False},
                                                                         "generation": {"samples": 0}},
                                  optimizer={"name": "adamw", "hparams": {"lr": 1e-2}},
                                  checkpoint={"export_dir": str(root / "export")})
    Trainer(load_config(config)).fit()
    return root / "export"


def choice_loglikelihoods(model_dir: Path, context: str, choices: list[str]) -> list[float]:
    """Σ log p(continuation token | what precedes it) of `context` + " " + each choice, by the exported
    model's own forward (lm-eval's multiple-choice score; target_delimiter " ")."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    scores = []
    for choice in choices:
        ids = tokenizer(context + " " + choice, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), dim=-1)
        scores.append(sum(logprobs[i - 1, ids[i]].item() for i in range(len(context_ids), len(ids))))
    return scores


def test_lm_evals_hf_model_scores_the_shipped_task_on_an_export(export_dir, monkeypatch, tmp_path):
    import lm_eval
    from lm_eval.tasks import TaskManager

    for name, value in OFFLINE.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    limit = 4
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={export_dir},dtype=float32", device="cpu",
                                  tasks=["wordnet_gloss"], limit=limit, batch_size=3, log_samples=True,
                                  task_manager=TaskManager(include_path=[str(benchmarks_dir())],
                                                           include_defaults=False))
    scores = out["results"]["wordnet_gloss"]
    samples = sorted(out["samples"]["wordnet_gloss"], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(limit))
    acc, acc_norm = [], []
    for sample in samples:
        doc = sample["doc"]
        want = choice_loglikelihoods(export_dir, f'Question: What does the word "{doc["word"]}" mean?\nAnswer:',
                                     doc["choices"])
        got = [loglikelihood for loglikelihood, _greedy in sample["filtered_resps"]]
        assert got == pytest.approx(want, abs=1e-3, rel=1e-5), doc["word"]
        normalised = [ll / len(choice) for ll, choice in zip(want, doc["choices"])]
        acc.append(float(max(range(4), key=want.__getitem__) == doc["label"]))
        acc_norm.append(float(max(range(4), key=normalised.__getitem__) == doc["label"]))
    assert scores["acc,none"] == pytest.approx(sum(acc) / limit)
    assert scores["acc_norm,none"] == pytest.approx(sum(acc_norm) / limit)
    assert 0.0 <= scores["acc,none"] <= 1.0 and 0.0 <= scores["acc_norm,none"] <= 1.0


def test_the_lm_eval_command_runs_a_users_task_yaml_with_local_files_on_an_export(export_dir, tmp_path):
    """What a user writes: a task YAML whose data_files are JSON lines on this machine (an absolute path:
    lm-eval reads a relative one from the current directory), run by `lm_eval --model hf` on the export."""
    rows = [{"question": f"{a} + {b} =", "choices": [str(a + b), str(a + b + 1), str(a * b + 3)], "answer": 0}
            for a, b in ((1, 2), (2, 5), (3, 3), (4, 1), (6, 2))]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "my_sums.yaml").write_text(f"""task: my_sums
dataset_path: json
dataset_kwargs:
  data_files:
    test: {tmp_path / 'sums.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf_home")}
    cli = Path(sys.executable).with_name("lm_eval")
    proc = subprocess.run([str(cli), "--model", "hf", "--model_args", f"pretrained={export_dir},dtype=float32",
                           "--device", "cpu", "--include_path", str(tasks), "--tasks", "my_sums",
                           "--output_path", str(tmp_path / "results")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["n-samples"]["my_sums"] == {"original": 5, "effective": 5}
    acc = results["results"]["my_sums"]["acc,none"]
    assert acc in {k / 5 for k in range(6)}
