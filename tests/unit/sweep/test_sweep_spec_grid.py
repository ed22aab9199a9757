"""Sweep files: schema errors, grid expansion, run identity; every file in configs/sweeps/ expands."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import yaml

from ft_framework.config import ConfigError, RunConfig, validate_config
from ft_framework.sweep import expand, load_sweep, plan_sweep, run_identity, validate_sweep
from sweep_helpers import BASE_RUN, sweep_dict

SWEEP_DIR = Path(__file__).resolve().parents[3] / "configs" / "sweeps"
SWEEPS = sorted(SWEEP_DIR.glob("*.yaml"))


def test_grid_expands_methods_times_axes_in_order(tmp_path):
    runs = expand(validate_sweep(sweep_dict()), store_root=tmp_path)
    assert [(r.method, r.seed, r.axes.get("optimizer.hparams.anneal_k")) for r in runs] == [
        ("recadam", 1, 0.1), ("recadam", 1, 1.0), ("recadam", 2, 0.1), ("recadam", 2, 1.0),
        ("vanilla", 1, None), ("vanilla", 2, None)]
    assert all(isinstance(r.config, RunConfig) for r in runs)
    assert runs[0].config.optimizer.hparams["anneal_k"] == 0.1
    # The flat method form sets whole keys: vanilla's optimizer section replaced RecAdam's.
    assert runs[4].config.optimizer.name == "adamw" and "anneal_k" not in runs[4].config.optimizer.hparams
    assert len({r.run_id for r in runs}) == 6
    for r in runs:
        assert r.config.logging.output_dir == str(tmp_path / "runs" / r.run_id)
        assert r.config.logging.progress_bar is False
        # The stored config validates back to itself and to the same identity.
        again = validate_config(r.config.to_dict())
        assert again == r.config and run_identity(again) == r.run_id


def test_identity_ignores_where_a_run_writes_but_not_what_it_computes():
    cfg = validate_config(copy.deepcopy(BASE_RUN))
    moved = cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"output_dir": "elsewhere",
                                                                             "progress_bar": False})})
    assert run_identity(moved) == run_identity(cfg)
    assert len(run_identity(cfg)) == 12 and int(run_identity(cfg), 16) >= 0
    other = copy.deepcopy(BASE_RUN)
    other["training"]["seed"] = 2
    assert run_identity(validate_config(other)) != run_identity(cfg)
    # 1 and 1.0 for a float field are the same run once validated.
    a, b = copy.deepcopy(BASE_RUN), copy.deepcopy(BASE_RUN)
    a["optimizer"]["weight_decay"], b["optimizer"]["weight_decay"] = 0, 0.0
    assert run_identity(validate_config(a)) == run_identity(validate_config(b))


def test_identity_reads_only_the_values_that_differ_from_the_schema_defaults():
    # A key written at its default is the run that leaves it out: a key a later release adds, off
    # unless asked for, leaves every earlier run id as it was (a sweep that gains methods runs only them).
    cfg = validate_config(copy.deepcopy(BASE_RUN))
    spelled = copy.deepcopy(BASE_RUN)
    spelled["evaluation"]["benchmarks"] = {"tasks": []}
    spelled["training"]["gradient_accumulation_steps"] = 1   # TrainingConfig's default
    assert run_identity(validate_config(spelled)) == run_identity(cfg)
    # A value off its default is another run, wherever in the tree it sits.
    changed = copy.deepcopy(BASE_RUN)
    changed["training"]["gradient_accumulation_steps"] = 2
    assert run_identity(validate_config(changed)) != run_identity(cfg)


def test_an_interpolating_sweep_gives_every_run_its_interpolation_and_export_without_changing_the_ids(tmp_path):
    plain = expand(validate_sweep(sweep_dict()), store_root=tmp_path)
    spec = validate_sweep(sweep_dict(interpolate={"alphas": [1, 0, 0.5], "theta_star": "pretrained"}))
    runs = expand(spec, store_root=tmp_path)
    assert [r.run_id for r in runs] == [r.run_id for r in plain]   # interpolating changes no weight
    for run in runs:
        assert run.config.evaluation.interpolation == spec.interpolate
        assert run.config.evaluation.interpolation.alphas == [0.0, 0.5, 1.0]
        assert run.config.checkpoint.export_dir == str(tmp_path / "runs" / run.run_id / "export")
        # What the run's process reads back (config.yaml): valid, with the same interpolation.
        assert validate_config(run.config.to_dict()).evaluation.interpolation == spec.interpolate
    assert all(r.config.evaluation.interpolation is None for r in plain)


def test_sweep_values_and_overrides_win_over_task_overrides(tmp_path):
    spec = validate_sweep(sweep_dict(axes={"task": ["rte", "mrpc"]}, methods=None))
    runs = expand(spec, store_root=tmp_path)
    assert [r.task for r in runs] == ["rte", "mrpc"]
    assert [r.config.optimizer.hparams["lr"] for r in runs] == [1.0e-4, 2.0e-5]  # mrpc's task override
    spec = validate_sweep(sweep_dict(axes={"task": ["rte", "mrpc"], "optimizer.hparams.lr": [3.0e-5]}, methods=None))
    assert [r.config.optimizer.hparams["lr"] for r in expand(spec, store_root=tmp_path)] == [3.0e-5, 3.0e-5]
    runs = expand(spec, ["optimizer.hparams.lr=7e-5", "training.max_steps=3"], store_root=tmp_path)
    assert [(r.config.optimizer.hparams["lr"], r.config.training.max_steps) for r in runs] == [(7e-5, 3), (7e-5, 3)]
    # Without methods, a run's method is its optimizer's name.
    assert {r.method for r in runs} == {"recadam"}


def test_set_and_method_base(tmp_path):
    base = tmp_path / "cfgs" / "base.yaml"
    base.parent.mkdir()
    base.write_text(yaml.safe_dump(BASE_RUN))
    other = copy.deepcopy(BASE_RUN)
    other["optimizer"] = {"name": "bertadam", "hparams": {"lr": 3.0e-5}}
    (base.parent / "other.yaml").write_text(yaml.safe_dump(other))
    sweep = tmp_path / "cfgs" / "sweeps" / "s.yaml"
    sweep.parent.mkdir()
    sweep.write_text(yaml.safe_dump({
        "base": "../base.yaml", "set": {"training.max_steps": 4}, "axes": {"seed": [1, 2]},
        "methods": {"recadam": None, "bert": {"base": "../other.yaml", "set": {"training.max_steps": 5}}}},
        sort_keys=False))
    runs = expand(load_sweep(sweep), store_root=tmp_path / "store")
    assert [(r.method, r.config.optimizer.name, r.config.training.max_steps) for r in runs] == [
        ("recadam", "recadam", 4), ("recadam", "recadam", 4), ("bert", "bertadam", 5), ("bert", "bertadam", 5)]


@pytest.mark.parametrize("change, message", [
    ({"axes": {"training.seed": []}}, "non-empty list"),
    ({"axes": {"training.seed": [1, 1]}}, "twice"),
    ({"axez": {}}, "valid keys here: name, base, set, axes"),
    ({"runner": {"name": "kubernetes"}}, "runner.name"),
    ({"runner": {"max_paralel": 2}}, "max_parallel"),
    ({"set": {"training.seed": 3}}, "also an axis"),
    ({"methods": {}}, "at least one method"),
    ({"methods": {"a": {"axes": {"training.seed": [1]}}}}, "shared axis"),
])
def test_schema_errors_name_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        validate_sweep(sweep_dict(**change))


def test_invalid_run_configs_are_errors_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="max_stepz"):
        expand(validate_sweep(sweep_dict(axes={"training.max_stepz": [1]})), store_root=tmp_path)
    with pytest.raises(ConfigError, match="vanilla"):  # anneal_k is no AdamW hyper-parameter
        expand(validate_sweep(sweep_dict(axes={"training.seed": [1], "optimizer.hparams.anneal_t0": [5]})),
               store_root=tmp_path)
    with pytest.raises(ConfigError, match="same run config"):  # the axis changes nothing
        expand(validate_sweep(sweep_dict(axes={"logging.progress_bar": [True, False]}, methods=None)),
               store_root=tmp_path)
    with pytest.raises(ConfigError, match="override"):
        expand(validate_sweep(sweep_dict()), ["no_equals_sign"], store_root=tmp_path)


def test_sweep_files_exist():
    assert {p.name for p in SWEEPS} >= {"glue_recadam.yaml", "quickstart_grid.yaml"}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_every_sweep_file_loads_expands_and_validates(path, tmp_path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ft-sweep --config configs/sweeps/" + path.name), first
    spec = load_sweep(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        store, runs = plan_sweep(spec, output_dir=tmp_path)
    assert runs and len({r.run_id for r in runs}) == len(runs)
    if path.name == "glue_recadam.yaml":
        # 8 tasks x 5 seeds x (4 t0 x 5 k) RecAdam settings, plus 2 baselines x 8 tasks x 5 seeds.
        assert len(runs) == 8 * 5 * 20 + 2 * 8 * 5
        assert {r.method for r in runs} == {"recadam", "vanilla", "bertadam"}
        assert {r.task for r in runs} == {"mnli", "qqp", "qnli", "sst2", "cola", "stsb", "mrpc", "rte"}
    if path.name == "quickstart_grid.yaml":
        assert len(runs) == 6 and {r.method for r in runs} == {"recadam", "vanilla"}


def test_ft_sweep_dry_run_and_errors(tmp_path, capsys):
    from ft_framework.cli import sweep_main

    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(sweep_dict(output_dir=str(tmp_path / "store"))))
    assert sweep_main(["--config", str(path), "--dry-run", "training.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("6 runs in ") and "0 finished, 6 to run" in out and out.count("pending") == 6
    assert not (tmp_path / "store").exists()  # a dry run writes nothing
    assert sweep_main(["--config", str(path), "--dry-run", "training.max_stepz=3"]) == 2
    assert "max_stepz" in capsys.readouterr().err
    path.write_text(yaml.safe_dump(sweep_dict(runnr={})))
    assert sweep_main(["--config", str(path), "--dry-run"]) == 2
    assert "runnr" in capsys.readouterr().err
