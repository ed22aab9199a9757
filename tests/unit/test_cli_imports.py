"""The console scripts answer --help and a config error without importing torch (or the other slow
packages): importing torch alone takes seconds, the answer should take a fraction of one.

Each case runs a command's function in a fresh interpreter, the way its console script does, and
reads which packages that process loaded. No timing: a loaded package is the cause of a slow answer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = str(REPO / "configs" / "quickstart.yaml")
# Every console script pyproject.toml declares, so a new one is covered too.
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
SLOW_PACKAGES = ("torch", "transformers", "datasets", "deepspeed", "peft", "ray", "scipy", "matplotlib")

PROBE = f"""
import contextlib, io, json, sys
from ft_framework import cli
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = getattr(cli, sys.argv[1])(sys.argv[2:])
    except SystemExit as exc:
        code = exc.code
print(json.dumps({{"code": code, "out": out.getvalue(), "err": err.getvalue(),
                  "loaded": [m for m in {SLOW_PACKAGES!r} if m in sys.modules]}}))
"""


def _run(function: str, *argv: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", PROBE, function, *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_loads_no_slow_package(script):
    module, function = SCRIPTS[script].split(":")
    assert module == "ft_framework.cli", f"{script}: console scripts live in ft_framework/cli.py"
    result = _run(function, "--help")
    assert result["code"] == 0 and "usage:" in result["out"], result
    assert result["loaded"] == [], f"{script} --help imported {result['loaded']}"


@pytest.mark.parametrize("override,named", [
    ("bogus.key=1", "unknown key 'bogus'"),
    # Checked against the optimizer registry (optim/validation.py): the rules are read without torch.
    ("optimizer.hparams.gamma=1", "unknown hyper-parameter 'gamma' for optimizer 'recadam'"),
    ("optimizer.name=radam", "adamw, bertadam, ewc, prior_wd, recadam"),
])
def test_a_config_error_loads_no_slow_package(override, named):
    result = _run("train_main", "--config", QUICKSTART, override)
    assert result["code"] == 2 and named in result["err"], result
    assert len(result["err"].strip().splitlines()) == 1, result["err"]
    assert result["loaded"] == [], f"ft-train with a config error imported {result['loaded']}"


@pytest.mark.parametrize("argv", [["train", "--help"], ["plan", "--help"], ["sweep", "--help"], ["train", "--print-schema"],
                                  ["train", "--config", QUICKSTART, "--training.bogus=1"],
                                  ["train", "--config", QUICKSTART, "--schedule.name", "cosine",
                                   "--schedule.kwargs.min_lr", "0.1"]])
def test_ft_commands_answer_before_torch_loads(argv):
    """ft COMMAND: --help, the schema and a config error given as --section.key, without torch."""
    result = _run("ft_main", *argv)
    assert result["code"] in (0, 2) and result["loaded"] == [], (argv, result)
    if result["code"] == 2:
        assert len(result["err"].strip().splitlines()) == 1 and result["err"].startswith("ft train: error: "), result
