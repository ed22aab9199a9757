"""Every console script shows a mistake the user can fix in one form, argparse's own: one line
`PROG: error: MESSAGE`, exit code 2, no traceback (run/failures.py: error_line, the one owner)."""

from __future__ import annotations

import pytest

from ft_framework import cli


def _missing(tmp_path):
    return str(tmp_path / "missing.yaml")


CASES = {
    "ft-train": (cli.train_main, lambda tmp: ["--config", _missing(tmp)]),
    "ft-sweep": (cli.sweep_main, lambda tmp: ["--config", _missing(tmp), "--dry-run"]),
    "ft-report": (cli.report_main, lambda tmp: [str(tmp), "--no-plots"]),
    "ft-interpolate": (cli.interpolate_main, lambda tmp: [str(tmp), "--no-plot"]),
    "ft-export": (cli.export_main, lambda tmp: [str(tmp / "no_checkpoint"), "--verify"]),
    "ft-plan": (cli.plan_main, lambda tmp: ["--config", _missing(tmp)]),
}


@pytest.mark.parametrize("prog", sorted(CASES))
def test_every_cli_says_a_user_error_as_prog_error_message(prog, tmp_path, capsys):
    main, argv = CASES[prog]
    assert main(argv(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"{prog}: error: ") and "Traceback" not in err, err
    assert str(tmp_path) in err, err  # it names the path it could not use


@pytest.mark.parametrize("prog", sorted(CASES))
def test_ft_command_says_it_as_ft_command(prog, tmp_path, capsys):
    """ft COMMAND is ft-COMMAND under its own name."""
    _, argv = CASES[prog]
    command = prog.removeprefix("ft-")
    assert cli.ft_main([command, *argv(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ft {command}: error: ") and err.count("\n") == 1 and str(tmp_path) in err, err
