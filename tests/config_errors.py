"""The config's refusal of a value, read as a user sees it: one line (or "invalid config:" and the
one error's line).

    assert "valid: ..." in one_line_error(config, ["data.replay.fraction=1.5"])
"""

from __future__ import annotations

import pytest

from ft_framework.config import ConfigError, apply_overrides, validate_config


def one_line_error(config: dict, overrides=()) -> str:
    """The message of the ConfigError that `config` with `overrides` (pinned, as the CLI pins them) raises."""
    with pytest.raises(ConfigError) as info:
        validate_config(apply_overrides(config, list(overrides)), pinned=list(overrides))
    message = str(info.value)
    assert message.count("\n") <= 1  # one line, or "invalid config:" and the one error's line
    return message
