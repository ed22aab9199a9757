"""Packaging facts that live in two files stay equal: the DeepSpeed and lm-eval ranges pyproject installs
are the ones their adapters accept, the test extra is the other extras plus test tools, and install.sh's two modes."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from ft_framework.models.lm_benchmarks import LM_EVAL_SPECIFIER
from ft_framework.strategies.deepspeed_adapter import SUPPORTED_DEEPSPEED

REPO = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def test_deepspeed_extra_is_the_range_the_adapter_accepts():
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED_DEEPSPEED
    (req,) = [Requirement(r) for r in EXTRAS["deepspeed"]]
    assert req.name == "deepspeed"
    assert req.specifier == SpecifierSet(f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}")
    # no other place in pyproject spells a deepspeed requirement of its own
    others = [r for name, reqs in EXTRAS.items() if name != "deepspeed" for r in reqs
              if Requirement(r).name == "deepspeed"]
    assert others == []


def test_lm_eval_extra_is_the_range_the_adapter_accepts():
    (req,) = [Requirement(r) for r in EXTRAS["lm_eval"]]
    assert req.name == "lm-eval"
    assert req.specifier == SpecifierSet(LM_EVAL_SPECIFIER)
    others = [r for name, reqs in EXTRAS.items() if name != "lm_eval" for r in reqs if Requirement(r).name == "lm-eval"]
    assert others == []


def test_test_extra_takes_every_other_extra_by_name():
    (self_req,) = [Requirement(r) for r in EXTRAS["test"] if Requirement(r).name == "ft_framework"]
    assert set(self_req.extras) == set(EXTRAS) - {"test"}


def test_install_script_refuses_an_unknown_argument_in_one_line():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--tests"], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": "/bin/false"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == "scripts/install.sh: unknown argument '--tests'; valid: --test"
