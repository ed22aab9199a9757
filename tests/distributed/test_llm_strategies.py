"""Supervised fine-tuning of tiny decoders (Llama, Qwen2) under every strategy equals one process:
DDP, FSDP2 (a unit per decoder layer) and DeepSpeed ZeRO 1-3 on 2 CPU ranks (one launch runs them
all, one after another, each on ranks forked from one process: rank_launcher.py), and the serial,
overlapped and device-lean offloads in this process. The rows have different lengths, so the ranks
hold different numbers of label tokens: the loss is the mean over the step's label tokens on every
rank, not a mean of the ranks' means. A 2-rank FSDP2 checkpoint resumes in one process where the
uninterrupted one-process run goes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rank_launcher import FIT_WORKER, fit_step, launch
from tiny_llm import build_tiny_llm_dir, write_sft_rows, write_sft_run_config

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow
MODELS = ("llama", "qwen2")
# strategy section of each 2-rank run
TWO_RANK = {
    "zero1": {"name": "deepspeed", "deepspeed": {"zero_stage": 1}},
    "zero2": {"name": "deepspeed", "deepspeed": {"zero_stage": 2}},
    "zero3": {"name": "deepspeed", "deepspeed": {"zero_stage": 3}},
    "ddp": {"name": "ddp"},
    "fsdp": {"name": "fsdp"},
}
CHECKPOINT = {"every_steps": 3, "keep_last": 2}


def records(run_dir: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["type"] == kind]


def fit(config: Path, overrides=()):
    from ft_framework.config import load_config
    from ft_framework.trainer import Trainer

    trainer = Trainer(load_config(config, list(overrides)))
    results = trainer.fit()
    trainer.strategy.close()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{model: {name: output directory}} of the one-process runs and the 2-rank ones."""
    root = tmp_path_factory.mktemp("llm_strategies")
    files = write_sft_rows(root / "data")
    out: dict[str, dict[str, Path]] = {}
    configs = []
    for model_type in MODELS:
        model = build_tiny_llm_dir(root / model_type, model_type)
        out[model_type] = {}
        single = write_sft_run_config(root / f"{model_type}_single.yaml", model, root / model_type / "single", files)
        fit(single)
        out[model_type]["single"] = root / model_type / "single"
        for name, strategy in TWO_RANK.items():
            run_dir = root / model_type / name
            configs.append(write_sft_run_config(root / f"{model_type}_{name}.yaml", model, run_dir, files,
                                                strategy=strategy, training={"per_device_batch_size": 4},
                                                checkpoint=CHECKPOINT if name == "fsdp" else {}))
            out[model_type][name] = run_dir
    launch(FIT_WORKER, [fit_step(c) for c in configs], root)
    out["root"] = {"root": root, "files": files}
    return out


def assert_same_run(got: Path, want: Path, rel: float = 1e-5) -> None:
    a, b = records(want, "train"), records(got, "train")
    assert [r["step"] for r in b] == [r["step"] for r in a] == list(range(1, 7))
    for key in ("loss", "grad_norm", "forgetting_distance"):
        assert [r[key] for r in b] == pytest.approx([r[key] for r in a], rel=rel), key
    ra, rb = (json.loads((d / "results.json").read_text()) for d in (want, got))
    assert rb["final"]["metrics"]["validation"]["completion_loss"] == pytest.approx(
        ra["final"]["metrics"]["validation"]["completion_loss"], rel=rel)
    assert rb["baseline"]["metrics"]["validation"] == pytest.approx(ra["baseline"]["metrics"]["validation"], rel=rel)
    for key, value in ra["final"]["forgetting"].items():
        assert rb["final"]["forgetting"][key] == pytest.approx(value, rel=1e-3, abs=1e-6), key
    assert rb["final"]["samples"] == ra["final"]["samples"]


@pytest.mark.parametrize("strategy", list(TWO_RANK))
@pytest.mark.parametrize("model_type", MODELS)
def test_two_ranks_equal_one_process(runs, model_type, strategy):
    assert_same_run(runs[model_type][strategy], runs[model_type]["single"])


def test_the_ranks_hold_different_numbers_of_label_tokens(runs):
    """What makes the equalities above a test of the loss's normalization: in the first step the
    two ranks' halves of the batch hold different numbers of label tokens, so a mean of the ranks'
    own means would not be one process's mean."""
    from transformers import AutoTokenizer

    from ft_framework.config import load_config
    from ft_framework.data.sharding import epoch_batches
    from ft_framework.task_kinds import RunContext, build_task_kind

    root = runs["root"]["root"]
    cfg = load_config(root / "llama_ddp.yaml")
    data = build_task_kind(cfg).load_data(AutoTokenizer.from_pretrained(root / "llama"), RunContext())
    tokens = []
    for rank in (0, 1):
        first = epoch_batches(len(data.train), batch_size=4, data_seed=cfg.training.data_seed, epoch=0, rank=rank,
                              world_size=2)[0]
        tokens.append(sum(t != -100 for i in first for t in data.train[i]["labels"][1:]))
    assert tokens[0] != tokens[1]


@pytest.mark.parametrize("offload", [{"overlap": False}, {"overlap": True}])
def test_the_offloads_equal_one_process(runs, offload, tmp_path):
    root = runs["root"]
    config = write_sft_run_config(tmp_path / "offload.yaml", root["root"] / "llama", tmp_path / "offload",
                                  root["files"], strategy={"name": "single", "offload_optimizer": offload})
    fit(config)
    assert_same_run(tmp_path / "offload", runs["llama"]["single"])


def test_the_device_lean_offload_with_the_compact_state_trains_a_decoder(runs, tmp_path, caplog):
    """bf16 weights on the device, fp32 masters and the compact state on the host: the first step
    sees θ* in bf16, so its loss is the bf16 model's; the run then follows the fp32 one closely."""
    root = runs["root"]
    lean = write_sft_run_config(tmp_path / "lean.yaml", root["root"] / "llama", tmp_path / "lean", root["files"],
                                strategy={"name": "single", "offload_optimizer": {"overlap": True}},
                                training={"precision": "bf16"},
                                optimizer={"state_dtype": "bfloat16", "anchor_dtype": "bfloat16"})
    with caplog.at_level("WARNING", logger="ft_framework.strategies.offload"):
        fit(lean)
    # 12 host bytes per parameter: the step runs after backward, and the run says so.
    assert "runs after backward, not during it" in caplog.text
    got, want = records(tmp_path / "lean", "train"), records(runs["llama"]["single"], "train")
    assert all(r["offload_speculated_steps"] == 0 for r in got)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=2e-2)
    results = json.loads((tmp_path / "lean" / "results.json").read_text())
    assert results["final"]["metrics"]["validation"]["completion_loss"] < \
        results["baseline"]["metrics"]["validation"]["completion_loss"]


def test_a_two_rank_fsdp_checkpoint_resumes_in_one_process(runs, tmp_path):
    run_dir = runs["llama"]["fsdp"]
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in checkpoint.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    resumed = fit(runs["root"]["root"] / "llama_fsdp.yaml", [
        f"logging.output_dir={tmp_path / 'resumed'}", "strategy.name=single", "strategy.fsdp=null",
        "training.per_device_batch_size=8", f"checkpoint.resume_from={checkpoint}"])
    single = runs["llama"]["single"]
    want = {r["step"]: r for r in records(single, "train")}
    got = {r["step"]: r for r in records(tmp_path / "resumed", "train")}
    assert sorted(got) == [4, 5, 6]
    for step in got:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5)
    single_results = json.loads((single / "results.json").read_text())
    # The pretrained model's scores (the 2-rank run's, bit for bit) and θ*'s answers to the probe
    # come with the checkpoint.
    assert resumed["baseline"] == json.loads((run_dir / "results.json").read_text())["baseline"]
    assert resumed["final"]["forgetting"] == pytest.approx(single_results["final"]["forgetting"], rel=1e-3, abs=1e-6)
