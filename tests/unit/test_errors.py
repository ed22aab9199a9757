"""The one user-error type and its "did you mean" hint."""

from __future__ import annotations

from ft_framework.config import ConfigError
from ft_framework.errors import UserError, did_you_mean


def test_config_errors_are_user_errors_and_value_errors():
    assert issubclass(ConfigError, UserError) and issubclass(UserError, ValueError)


def test_did_you_mean_names_the_closest_choice_or_nothing():
    assert did_you_mean("learning_rat", ["lr", "learning_rate", "eps"]) == " (did you mean 'learning_rate'?)"
    assert did_you_mean("zzz", ["lr", "eps"]) == ""
    assert did_you_mean(3, [1, 3]) == " (did you mean '3'?)"  # non-string keys (YAML ints) are compared as text
