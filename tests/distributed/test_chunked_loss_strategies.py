"""The chunked next-token loss (training.chunked_loss, models/lm_head_requests.py) under every way the
LM head's weight is held: 2-rank DDP (replicated), FSDP2 (sharded in the root group, unsharded for
the model's forward) and DeepSpeed ZeRO-3 (gathered by the head module's hooks, again for backward's
recomputation) each equal one process computing the whole logits (training.chunked_loss=false):
the training losses, gradient norms and distances from θ*, the evaluation's completion loss and
exact match, and the forgetting probe's measures, on tiny Llama, Qwen2 and Gemma decoders with
tied embeddings (the head's weight is the embedding's). One launch runs every 2-rank run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rank_launcher import FIT_WORKER, fit_step, launch
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow
MODELS = ("llama", "qwen2", "gemma")
TWO_RANK = {
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
    "zero3": {"name": "deepspeed", "deepspeed": {"zero_stage": 3}},
}
SECTIONS = dict(training={"max_steps": 3}, data={"main_metric": "exact_match"},
                evaluation={"num_evals": 1, "generation": {"samples": 0}})


def records(run_dir: Path) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == "train"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    root = tmp_path_factory.mktemp("chunked_loss")
    files = write_sft_rows(root / "data")
    configs = []
    for model_type in MODELS:
        model = build_tiny_llm_dir(root / model_type, model_type)
        whole = write_sft_run_config(root / f"{model_type}_whole.yaml", model, root / model_type / "whole", files,
                                     **{**SECTIONS, "training": {**SECTIONS["training"], "chunked_loss": False}})
        trainer = Trainer(load_config(whole))
        trainer.fit()
        trainer.strategy.close()
        for name, strategy in TWO_RANK.items():
            configs.append(write_sft_run_config(
                root / f"{model_type}_{name}.yaml", model, root / model_type / name, files, strategy=strategy,
                **{**SECTIONS, "training": {**SECTIONS["training"], "per_device_batch_size": 4}}))
    launch(FIT_WORKER, [fit_step(c) for c in configs], root)
    return root


@pytest.mark.parametrize("strategy", list(TWO_RANK))
@pytest.mark.parametrize("model_type", MODELS)
def test_the_chunked_loss_on_two_ranks_equals_the_whole_logits_in_one_process(runs, model_type, strategy):
    want_dir, got_dir = runs / model_type / "whole", runs / model_type / strategy
    want, got = records(want_dir), records(got_dir)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3]
    for key in ("loss", "grad_norm", "forgetting_distance"):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=1e-5), key
    a, b = (json.loads((d / "results.json").read_text()) for d in (want_dir, got_dir))
    for when in ("baseline", "final"):
        assert b[when]["metrics"]["validation"] == pytest.approx(a[when]["metrics"]["validation"], rel=1e-5), when
    for key, value in a["final"]["forgetting"].items():
        assert b["final"]["forgetting"][key] == pytest.approx(value, rel=1e-3, abs=1e-6), key
