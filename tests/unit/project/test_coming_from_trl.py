"""docs/coming_from_trl.md stays true to our schema and to the TRL and transformers we test with:
every key of ours it names is a key of the run config (and a value written with it one the key
takes), every TRL / transformers name in its first column and its "Not here" list is one of
theirs, each default of the "Defaults that differ" table is the installed default, and its YAML
example validates."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, TypeAdapter

from ft_framework import optim
from ft_framework.config.schema import OptimizerConfig, RunConfig

REPO = Path(__file__).resolve().parents[3]
PAGE = (REPO / "docs" / "coming_from_trl.md").read_text()
# `section.key[.sub]`, optionally `: value`, inside backticks
OURS = re.compile(rf"`((?:{'|'.join(RunConfig.model_fields)})\.[\w.]+)(?::\s*([^`]+))?`")
HPARAMS = "optimizer.hparams."


def _table(heading: str) -> list[list[str]]:
    """The rows (cells) of the first table under `## heading`, its header and rule left out."""
    section = PAGE.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[2:]]


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The config section a field holds (through `X | None`), or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _field(dotted: str):
    """The pydantic field a dotted key of ours names (an AssertionError naming it if none)."""
    model: type[BaseModel] = RunConfig
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        assert part in model.model_fields, f"{dotted}: {part!r} is not a key of {model.__name__}"
        info = model.model_fields[part]
        if i == len(parts) - 1:
            return info
        inner = _section_model(info.annotation)
        assert inner is not None, f"{dotted}: {'.'.join(parts[:i + 1])} holds no keys"
        model = inner
    raise AssertionError(dotted)


def _default_hparams() -> dict[str, Any]:
    return dict(optim.optimizer_hparams(OptimizerConfig.model_fields["name"].default))


def _ours_on_the_page() -> list[tuple[str, str | None]]:
    return OURS.findall(PAGE)


def test_the_page_names_many_keys_of_ours():
    assert len({key for key, _ in _ours_on_the_page()}) >= 40


@pytest.mark.parametrize("key, value", sorted(set(_ours_on_the_page())),
                         ids=[f"{k}:{v}" if v else k for k, v in sorted(set(_ours_on_the_page()))])
def test_every_key_of_ours_on_the_page_is_in_the_schema(key, value):
    if key.startswith(HPARAMS):
        name = key[len(HPARAMS):]
        known = {h for opt in optim.available_optimizers() for h in optim.optimizer_hparams(opt)}
        assert name in known, f"{key}: no optimizer takes {name!r}; they take {sorted(known)}"
        return
    info = _field(key)
    if value:   # a value written with the key is one it takes
        parsed = yaml.safe_load(value)
        if key == "optimizer.name":
            assert parsed in optim.available_optimizers()
        elif _section_model(info.annotation) is None:
            TypeAdapter(info.annotation).validate_python(parsed)


@pytest.fixture(scope="module")
def theirs() -> dict[str, Any]:
    trl = pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    from transformers import PreTrainedModel, Trainer, TrainingArguments

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "TrainingArguments": {f.name: f.default for f in dataclasses.fields(TrainingArguments)},
            "SFTConfig": {f.name: f.default for f in dataclasses.fields(trl.SFTConfig)},
            "SFTTrainer": set(inspect.signature(trl.SFTTrainer.__init__).parameters),
            "train": set(inspect.signature(Trainer.train).parameters),
            "LoraConfig": {f.name for f in dataclasses.fields(peft.LoraConfig)},
            "from_pretrained": inspect.getsource(PreTrainedModel.from_pretrained),
        }


def _their_name_exists(theirs: dict[str, Any], word: str) -> bool:
    return (word in theirs["SFTConfig"] or word in theirs["SFTTrainer"] or word in theirs["train"]
            or word in theirs["LoraConfig"] or word in ("SFTTrainer", "LoraConfig", "trainer", "train"))


def test_every_trl_name_on_the_page_is_one_of_theirs(theirs):
    rows = _table("Names")
    assert len(rows) >= 40
    unknown = []
    for row in rows:
        cell = row[0]
        if cell.startswith("none"):
            continue
        snippets = re.findall(r"`([^`]+)`", cell)
        assert snippets, f"a row of the Names table names nothing of TRL's: {row}"
        for snippet in snippets:
            words = re.findall(r"[A-Za-z_]\w*", snippet.split("=...")[0])
            for word in words:
                if "model_init_kwargs" in cell and word != "model_init_kwargs":
                    # from_pretrained's own keyword arguments, read from its **kwargs
                    ok = f'"{word}"' in theirs["from_pretrained"]
                else:
                    ok = _their_name_exists(theirs, word)
                if not ok:
                    unknown.append(f"{word} ({cell})")
    not_here = PAGE.split("Not here: ", 1)[1].split("and axolotl's", 1)[0]
    for snippet in re.findall(r"`([^`]+)`", not_here):
        word = snippet.split(":")[0]
        if not _their_name_exists(theirs, word):
            unknown.append(f"{word} (Not here)")
    assert not unknown, f"names on the page that TRL / transformers do not have: {unknown}"


def _pair(cell: str) -> tuple[str, str] | None:
    match = re.match(r"`([\w.]+): ([^`]+)`", cell)
    return (match.group(1), match.group(2)) if match else None


def test_every_default_in_the_table_is_the_installed_one(theirs):
    rows = _table("Defaults that differ")
    assert len(rows) >= 10
    for trl_cell, transformers_cell, ours_cell in rows:
        for cell, fields in ((trl_cell, theirs["SFTConfig"]), (transformers_cell, theirs["TrainingArguments"])):
            if not cell:
                continue
            name, value = _pair(cell)
            assert fields[name] == ast.literal_eval(value), f"{name}: the page says {value}, installed {fields[name]!r}"
        key, value = _pair(ours_cell)
        if key.startswith(HPARAMS):
            default = _default_hparams()[key[len(HPARAMS):]]
        else:
            default = _field(key).get_default(call_default_factory=True)
        assert default == yaml.safe_load(value), f"{key}: the page says {value}, the schema {default!r}"


def test_the_yaml_example_validates():
    example = yaml.safe_load(PAGE.split("```yaml\n", 1)[1].split("```", 1)[0])
    config = RunConfig.model_validate(example)
    assert config.data.task_spec().kind == "causal_lm"
