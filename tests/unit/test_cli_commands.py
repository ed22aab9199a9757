"""The command line as TRL, torchtitan and HfArgumentParser users type it: `ft COMMAND`, with the
ft-* scripts kept, and config overrides as --section.key=value and --section.key value beside
section.key=value."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from tiny_run import build_tiny_bert_dir, write_run_config

from ft_framework import cli

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")


def _parser() -> argparse.ArgumentParser:
    """A parser with ft-train's arguments (its --config and overrides, --local_rank, --debug)."""
    parser = argparse.ArgumentParser(prog="probe")
    cli.add_run_config_arguments(parser)
    parser.add_argument("--local_rank", type=int)
    parser.add_argument("--debug", action="store_true")
    return parser


@pytest.mark.parametrize("argv,overrides", [
    (["--training.max_steps=10"], ["training.max_steps=10"]),
    (["--training.max_steps", "10"], ["training.max_steps=10"]),
    (["training.max_steps=10"], ["training.max_steps=10"]),
    # every form, mixed among the options in any order; a value may start with "-" or hold "=" or spaces
    (["a.b=1", "--debug", "--optimizer.hparams.lr", "-1e-5", "--local_rank=3", "--data.name=x=y z"],
     ["a.b=1", "optimizer.hparams.lr=-1e-5", "data.name=x=y z"]),
    (["--task_overrides.rte.schedule.warmup_steps", "3", "--data.max-len", "7"],
     ["task_overrides.rte.schedule.warmup_steps=3", "data.max-len=7"]),
])
def test_every_override_form_reaches_the_config(argv, overrides):
    args = cli.parse_run_arguments(_parser(), ["--config", "c.yaml", *argv])
    assert args.config == "c.yaml" and args.overrides == overrides


def test_the_launchers_options_keep_working():
    """DeepSpeed's launcher appends --local_rank=N; --config= and --debug are ours: no dot, no override."""
    args = cli.parse_run_arguments(_parser(), ["--config=configs/x.yaml", "--training.seed", "1", "--local_rank=2",
                                               "--debug"])
    assert (args.config, args.local_rank, args.debug, args.overrides) == ("configs/x.yaml", 2, True,
                                                                          ["training.seed=1"])
    # an override is never read as an abbreviation of an option (argparse's allow_abbrev), nor after "--"
    args = cli.parse_run_arguments(_parser(), ["--config", "c", "--deb.x=1", "--", "--conf.y=2"])
    assert (args.debug, args.overrides) == (False, ["deb.x=1", "--conf.y=2"])


@pytest.mark.parametrize("argv", [["--training.max_steps"], ["--training.max_steps", "--debug"]])
def test_an_override_without_a_value_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_run_arguments(_parser(), ["--config", "c", *argv])
    assert exit_info.value.code == 2
    assert ("probe: error: --training.max_steps needs a value: --training.max_steps=VALUE or "
            "--training.max_steps VALUE") in capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "plan"])
@pytest.mark.parametrize("override,named", [
    (["--bogus.key=1"], "unknown key 'bogus'; valid keys at the top level: model, data"),
    (["--training.max_stepz", "5"], "unknown key 'training.max_stepz'"),
    (["--schedule.name", "reduce_lr_on_plateau"], "reduce_lr_on_plateau cannot drive ft-train's lr: it lowers lr "
                                                  "when an evaluation metric stops improving"),
])
def test_an_unknown_key_is_one_line_naming_the_valid_ones(command, override, named, capsys):
    assert cli.ft_main([command, "--config", QUICKSTART, *override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ft {command}: error: ") and named in err and err.count("\n") == 1, err


def test_ft_names_its_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.ft_main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0 and out.startswith("usage: ft COMMAND [ARGS ...]")
    for command in ("train", "sweep", "report", "plan", "export", "interpolate"):
        assert f"\n  {command} " in out
    with pytest.raises(SystemExit) as exit_info:
        cli.ft_main(["tran"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "ft: error: argument COMMAND: invalid choice: 'tran'" in err


def test_every_command_is_a_script_too():
    """`ft COMMAND` and `ft-COMMAND` are the same function: pyproject.toml declares both."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ft"] == "ft_framework.cli:ft_main"
    for command, (main, _) in cli.COMMANDS.items():
        assert scripts[f"ft-{command}"] == f"ft_framework.cli:{main.__name__}"
    assert set(scripts) == {"ft", *(f"ft-{command}" for command in cli.COMMANDS)}


def test_print_schema_is_the_run_configs_json_schema(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.ft_main(["train", "--print-schema"])  # no --config needed
    assert exit_info.value.code == 0
    schema = json.loads(capsys.readouterr().out)
    assert schema["title"] == "RunConfig" and {"model", "data", "schedule", "training"} <= set(schema["required"])
    schedule = schema["$defs"]["ScheduleConfig"]["properties"]
    assert "cosine" in schedule["name"]["enum"] and "reduce_lr_on_plateau" not in schedule["name"]["enum"]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_ft_train_with_dotted_options_trains_on_transformers_cosine(tmp_path, capsys):
    """ft-train's function with the new forms: the run follows them, and each step's lr is what
    transformers' cosine schedule with warm-up gives a real torch optimizer, step for step (ft-train's
    step k at transformers' k + 1, docs/training.md)."""
    import torch
    from transformers.optimization import get_cosine_schedule_with_warmup

    model = build_tiny_bert_dir(tmp_path / "tiny_bert")
    config = write_run_config(tmp_path / "run.yaml", model, tmp_path / "unused")
    total, warmup, lr = 7, 2, 1e-3
    assert cli.train_main(["--config", str(config), "--schedule.name", "cosine", "--schedule.kwargs.num_cycles=0.4",
                           f"--training.max_steps={total}", "--logging.output_dir", str(tmp_path / "run"),
                           "--evaluation.num_evals", "1"]) == 0
    records = [r for r in _lines(tmp_path / "run" / "metrics.jsonl") if r["type"] == "train"]
    assert [r["step"] for r in records] == list(range(1, total + 1))

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=lr)
    scheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total, num_cycles=0.4)
    for record in records:
        optimizer.step()
        scheduler.step()
        assert record["lr"] == optimizer.param_groups[0]["lr"], record["step"]
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["config"]["schedule"] == {"name": "cosine", "warmup_steps": 2, "warmup_ratio": None,
                                             "kwargs": {"num_cycles": 0.4}}


@pytest.mark.slow
def test_ft_train_command_runs_the_quickstart(tmp_path):
    """The real command line end to end: `ft train` with the --section.key forms on the quickstart."""
    script = Path(sys.executable).with_name("ft")  # the console script pip installed beside this Python
    assert script.is_file(), f"no {script}: install the package again (pip install -e .) for its ft script"
    proc = subprocess.run(
        [str(script), "train", "--config", QUICKSTART, "--training.max_steps=5", "--logging.output_dir",
         str(tmp_path / "qs"), "--logging.progress_bar=false", "--evaluation.num_evals=1"],
        cwd=tmp_path, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "qs" / "results.json").read_text())
    assert results["steps"] == 5 and results["config"]["training"]["max_steps"] == 5
