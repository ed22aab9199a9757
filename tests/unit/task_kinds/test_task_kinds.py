"""The task-kind registry: every kind the config accepts has its module, and a run's config finds it."""

import pytest

from ft_framework.config import validate_config
from ft_framework.data.tasks import TASK_KINDS
from ft_framework.task_kinds import TASK_KIND_CLASSES, TaskKind, build_task_kind
from ft_framework.task_kinds.causal_lm import CausalLMKind
from ft_framework.task_kinds.classification import SequenceClassificationKind


def test_every_kind_the_config_accepts_has_a_class():
    assert set(TASK_KIND_CLASSES) == set(TASK_KINDS)
    assert all(issubclass(cls, TaskKind) for cls in TASK_KIND_CLASSES.values())


def _config(**data):
    return validate_config({"model": {"name_or_path": "some/model"}, "data": data,
                            "schedule": {"warmup_steps": 0}, "training": {"max_steps": 1}})


@pytest.mark.parametrize("data, kind, model_class", [
    ({"task": "sst2"}, SequenceClassificationKind, "AutoModelForSequenceClassification"),
    ({"task": "stsb"}, SequenceClassificationKind, "AutoModelForSequenceClassification"),
    ({"problem": "causal_lm", "source": "builtin:quickstart_sft"}, CausalLMKind, "AutoModelForCausalLM"),
])
def test_the_config_finds_its_kind(data, kind, model_class):
    built = build_task_kind(_config(**data))
    assert type(built) is kind and built.model_class.auto_class == model_class
    assert built.model_class.new_head is (kind is SequenceClassificationKind)
