"""`builtin:general_text`, the shipped general text, in both keys that read general text
(optimizer.importance.source, data.replay.file): resolved by schema.general_text_path to the file the
package ships, which the path checks and the reader accept; an unknown built-in name refused in one line
that names the valid ones."""

import pytest
from config_errors import one_line_error

from ft_framework import resources
from ft_framework.config import validate_config
from ft_framework.config.loading import _check_paths
from ft_framework.config.schema import general_text_path
from ft_framework.data.general_text import text_table

BUILTIN = "builtin:general_text"


def decoder() -> dict:
    return {"model": {"name_or_path": "some/model"},
            "data": {"problem": "causal_lm", "source": "builtin:quickstart_sft",
                     "replay": {"file": BUILTIN, "fraction": 0.2}},
            "optimizer": {"name": "ewc", "hparams": {"lr": 2e-5, "ewc_lambda": 100.0},
                          "importance": {"source": BUILTIN}},
            "schedule": {"warmup_ratio": 0.1}, "training": {"max_steps": 10}}


def test_both_keys_resolve_the_name_to_the_shipped_file():
    cfg = validate_config(decoder())
    shipped = resources.general_text_file("general_text")
    assert (cfg.data.replay.file, cfg.optimizer.importance.source) == (BUILTIN, BUILTIN)  # the name is kept
    assert general_text_path(cfg.data.replay.file) == general_text_path(cfg.optimizer.importance.source) == shipped
    assert shipped.is_file() and shipped.parent.name == "general_text"
    _check_paths(cfg)  # both pass the file checks made before anything loads
    rows = list(text_table(shipped, "data.replay.file").records)
    assert len(rows) == 2000 and rows[0][1]["text"] == shipped.read_text(encoding="utf-8").splitlines()[0]


def test_a_path_stays_a_path(tmp_path):
    assert general_text_path(str(tmp_path / "general.txt")) == tmp_path / "general.txt"
    assert general_text_path("~/general.txt").is_absolute()


@pytest.mark.parametrize("key", ["data.replay.file", "optimizer.importance.source"])
@pytest.mark.parametrize("value", ["builtin:wikipedia", "builtin:General_Text", "builtin:quickstart_sft"])
def test_an_unknown_builtin_is_refused_in_one_line_naming_the_valid_ones(key, value):
    message = one_line_error(decoder(), [f"{key}={value}"])
    assert f"{key}: unknown built-in general text '{value}'; valid: builtin:general_text" in message
