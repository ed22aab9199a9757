import math

import pytest

from ft_framework.optim.anneal import ANNEAL_FUNCTIONS, anneal_lambda, validate_anneal


def test_sigmoid_values():
    assert anneal_lambda("sigmoid", 100, 0.1, 100, 1.0) == 0.5
    assert anneal_lambda("sigmoid", 110, 0.1, 100, 2.0) == pytest.approx(2.0 / (1 + math.exp(-1.0)), rel=1e-15)
    assert anneal_lambda("sigmoid", 90, 0.1, 100, 2.0) == pytest.approx(2.0 / (1 + math.exp(1.0)), rel=1e-15)


def test_sigmoid_k_zero_is_constant_half_weight():
    assert {anneal_lambda("sigmoid", t, 0.0, 250, 1.0) for t in (1, 250, 10_000)} == {0.5}


def test_sigmoid_k_infinite_is_a_step_at_t0():
    assert anneal_lambda("sigmoid", 99, math.inf, 100, 1.0) == 0.0
    assert anneal_lambda("sigmoid", 100, math.inf, 100, 1.0) == 0.5
    assert anneal_lambda("sigmoid", 101, math.inf, 100, 1.0) == 1.0


def test_sigmoid_does_not_overflow_for_huge_arguments():
    assert anneal_lambda("sigmoid", 1, 1e6, 1000, 1.0) == 0.0
    assert anneal_lambda("sigmoid", 1e9, 1e6, 1000, 1.0) == 1.0
    tiny = anneal_lambda("sigmoid", 1, 1.0, 700, 1.0)
    assert 0 < tiny == pytest.approx(math.exp(-699), rel=1e-12)


def test_linear_and_constant():
    assert anneal_lambda("linear", 50, 0, 100, 1.0) == 0.5
    assert anneal_lambda("linear", 500, 0, 100, 1.0) == 1.0
    assert anneal_lambda("constant", 3, 0, 0, 0.3) == 0.3


def test_invalid_setups_are_explained():
    with pytest.raises(ValueError, match="anneal_t0 must be > 0"):
        validate_anneal("linear", 0.0, 0, 1.0)
    with pytest.raises(ValueError, match="valid: sigmoid, linear, constant"):
        validate_anneal("cosine", 0.0, 0, 1.0)
    with pytest.raises(ValueError, match="anneal_k must be >= 0"):
        validate_anneal("sigmoid", -1.0, 0, 1.0)
    with pytest.raises(ValueError, match="valid: sigmoid"):
        anneal_lambda("cosine", 1, 0, 0, 1.0)
    assert ANNEAL_FUNCTIONS == ("sigmoid", "linear", "constant")
