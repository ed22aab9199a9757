from ft_framework.run.results import format_results_table
from ft_framework.trainer import eval_steps


def test_eval_steps_always_include_the_last_step():
    assert eval_steps(100, 4, None) == [25, 50, 75, 100]
    assert eval_steps(10, None, 4) == [4, 8, 10]
    assert eval_steps(7, None, None) == [7]
    assert eval_steps(3, 10, None) == [1, 2, 3]


def test_results_table_shows_run_against_baseline():
    results = {"task": "rte", "reported": "final", "steps": 5, "main_metric": "accuracy",
               "selection_split": "validation", "failed": True,
               "final": {"step": 5, "metrics": {"validation": {"accuracy": 0.5}}},
               "baseline": {"name": "majority class", "metrics": {"validation": {"accuracy": 0.527}}}}
    table = format_results_table(results)
    assert "0.5000" in table and "0.5270" in table and "FAILED" in table
