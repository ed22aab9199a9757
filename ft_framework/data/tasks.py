"""The nine GLUE tasks, and a user's own data as a task: every fact about a task lives in its
:class:`TaskSpec` here, and the config (valid task names), the data loader (texts, labels, splits),
the metrics (which ones, the main one) and the sweep report (titles, sizes, order) read it from here.

This module imports nothing heavy (no torch, numpy or datasets), so the config can use it cheaply.

    spec = get_task("sst2")
    spec.title, spec.train_size, spec.metrics, spec.main_metric   # "SST-2", 67000, ("accuracy",), "accuracy"
"""

from __future__ import annotations

from dataclasses import dataclass

from ft_framework.errors import UserError, did_you_mean

__all__ = ["TaskSpec", "GLUE_TASKS", "GLUE_TASK_NAMES", "LARGE_TASK_MIN_TRAIN_SIZE", "get_task", "own_data_task",
           "OWN_DATA_SPLITS", "TASK_KINDS", "CAUSAL_LM", "SFT_METRICS", "sft_task", "task_kinds", "register_kind",
           "unregister_kind", "registered_kind_metrics"]

# The kinds of task (ft_framework/task_kinds/ implements each: its model class, batch collation, loss
# and metrics); a TaskSpec names its kind, the config's data.problem chooses it for your own data.
CLASSIFICATION, REGRESSION, CAUSAL_LM = "classification", "regression", "causal_lm"
TASK_KINDS: tuple[str, ...] = (CLASSIFICATION, REGRESSION, CAUSAL_LM)
# Kinds registered from outside the package (task_kinds.register_task_kind): name -> their metrics,
# in report order, the first the main one. Such a kind reads your files as labelled texts.
_REGISTERED_KINDS: dict[str, tuple[str, ...]] = {}


def task_kinds() -> tuple[str, ...]:
    """Every valid data.problem: the built-in kinds, then the registered ones."""
    return TASK_KINDS + tuple(_REGISTERED_KINDS)


def register_kind(name: str, metrics: tuple[str, ...]) -> None:
    """Makes `name` a valid data.problem whose tasks report `metrics` (task_kinds.register_task_kind
    calls it with the kind's class)."""
    if name in TASK_KINDS:
        raise ValueError(f"task kind {name!r} is built in")
    if not metrics:
        raise ValueError(f"task kind {name!r} names no metrics (its class's `metrics`, the first the main one)")
    _REGISTERED_KINDS[name] = tuple(metrics)


def unregister_kind(name: str) -> None:
    _REGISTERED_KINDS.pop(name, None)


def registered_kind_metrics(name: str) -> tuple[str, ...] | None:
    """A registered kind's metrics, or None for a built-in (or unknown) kind."""
    return _REGISTERED_KINDS.get(name)

# Chen et al. 2020 and Mosbach et al. 2020 group the tasks by training-set size at 10k examples.
LARGE_TASK_MIN_TRAIN_SIZE = 10_000


@dataclass(frozen=True)
class TaskSpec:
    """Static description of one task: a GLUE task, or a user's own data (:func:`own_data_task`).

    ``label_list[i]`` is the label string used in the original TSV files for hub label id ``i`` (own
    data: the label as the user's files write it).
    """

    name: str                          # config and hub name: "sst2"
    # The task's name in the GLUE paper ("SST-2"); the GLUE distribution also names each task's
    # directory by it (glue_data/SST-2/train.tsv), so the local loader looks for this directory.
    title: str
    text_keys: tuple[str, ...]         # hub (own data: file) column names of the input texts, in model order
    label_list: tuple[str, ...] | None  # None for regression (STS-B)
    eval_splits: tuple[str, ...]       # hub split names of the dev set(s); the first selects models
    # Metrics reported for the task, in report order (names as computed by ft_framework.metrics).
    metrics: tuple[str, ...]
    main_metric: str                   # the GLUE headline metric: model selection and "failed" runs
    # Nominal size of the full GLUE training set (the GLUE paper; Chen et al. 2020, Table 1),
    # not the size of whatever data a run loads; 0 for own data, which has no nominal size.
    train_size: int
    label_key: str = "label"           # hub (own data: file) column name of the label
    # The task's kind (TASK_KINDS): None derives it from label_list (classification, or regression
    # without one); causal_lm is a supervised fine-tuning task of a decoder LM (sft_task).
    problem: str | None = None

    def __post_init__(self) -> None:
        if self.main_metric not in self.metrics:
            raise ValueError(f"task {self.name!r}: main_metric {self.main_metric!r} is not in {self.metrics}")
        if self.problem is not None and self.problem not in task_kinds():
            raise ValueError(f"task {self.name!r}: problem {self.problem!r} is not one of {task_kinds()}")

    @property
    def kind(self) -> str:
        """classification, regression, causal_lm (TASK_KINDS) or a registered kind."""
        if self.problem is not None:
            return self.problem
        return REGRESSION if self.label_list is None else CLASSIFICATION

    @property
    def is_regression(self) -> bool:
        return self.kind == REGRESSION

    @property
    def num_labels(self) -> int:
        """Number of model outputs of a sequence classifier: 1 for regression, else the number of
        classes; 0 for a causal LM (it predicts tokens, not labels)."""
        if self.kind == CAUSAL_LM:
            return 0
        return 1 if self.label_list is None else len(self.label_list)

    @property
    def is_large(self) -> bool:
        """More than 10k training examples in the full GLUE set (the papers' "> 10k" group)."""
        return self.train_size > LARGE_TASK_MIN_TRAIN_SIZE

    @property
    def size_title(self) -> str:
        """Title with the nominal train size, as in a table header: "SST-2 67k", "RTE 2.5k"."""
        size = self.train_size
        if size < LARGE_TASK_MIN_TRAIN_SIZE:
            return f"{self.title} {size / 1000:.1f}k"
        return f"{self.title} {size // 1000}k"


_VALIDATION = ("validation",)
_PAIR = ("sentence1", "sentence2")
_ACCURACY = ("accuracy",)
_ACC_F1 = ("f1", "accuracy", "accuracy_f1_avg")

# In the GLUE paper's order (its Table 1); the report orders its columns by train_size instead.
GLUE_TASKS: dict[str, TaskSpec] = {
    spec.name: spec
    for spec in (
        # hub: 0 = unacceptable, 1 = acceptable
        TaskSpec("cola", "CoLA", ("sentence",), ("0", "1"), _VALIDATION, ("mcc", "accuracy"), "mcc", 8_500),
        # hub: 0 = negative, 1 = positive
        TaskSpec("sst2", "SST-2", ("sentence",), ("0", "1"), _VALIDATION, _ACCURACY, "accuracy", 67_000),
        # hub: 0 = not_equivalent, 1 = equivalent
        TaskSpec("mrpc", "MRPC", _PAIR, ("0", "1"), _VALIDATION, _ACC_F1, "f1", 3_700),
        # hub: 0 = not_duplicate, 1 = duplicate
        TaskSpec("qqp", "QQP", ("question1", "question2"), ("0", "1"), _VALIDATION, _ACC_F1, "f1", 364_000),
        TaskSpec("stsb", "STS-B", _PAIR, None, _VALIDATION, ("pearson", "spearmanr", "pearson_spearman_avg"),
                 "pearson", 5_700),
        TaskSpec("mnli", "MNLI", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"),
                 ("validation_matched", "validation_mismatched"), _ACCURACY, "accuracy", 393_000),
        TaskSpec("qnli", "QNLI", ("question", "sentence"), ("entailment", "not_entailment"), _VALIDATION,
                 _ACCURACY, "accuracy", 105_000),
        TaskSpec("rte", "RTE", _PAIR, ("entailment", "not_entailment"), _VALIDATION, _ACCURACY, "accuracy", 2_500),
        # hub: 0 = not_entailment, 1 = entailment (the TSV files already use 0/1)
        TaskSpec("wnli", "WNLI", _PAIR, ("0", "1"), _VALIDATION, _ACCURACY, "accuracy", 635),
    )
}

# The config's valid data.task values.
GLUE_TASK_NAMES: tuple[str, ...] = tuple(GLUE_TASKS)


def get_task(name: str) -> TaskSpec:
    """Return the TaskSpec for ``name`` (case-insensitive; "sst-2"/"sts-b" accepted)."""
    key = name.lower().replace("-", "")
    if key not in GLUE_TASKS:
        raise UserError(f"unknown GLUE task {name!r}{did_you_mean(key, GLUE_TASK_NAMES)}; "
                        f"valid tasks: {', '.join(GLUE_TASK_NAMES)}")
    return GLUE_TASKS[key]


# The keys of data.files: the train split, the split that selects models, and an optional held-out one.
OWN_DATA_SPLITS: tuple[str, ...] = ("train", "validation", "test")
# Own data's metrics, in report order, the first the main one. Classification: accuracy, and MCC,
# which stays informative when the classes are imbalanced. Regression: as STS-B, plus the mean
# squared error, which the mean baseline makes concrete (its correlations are 0 by definition).
_OWN_CLASSIFICATION_METRICS = ("accuracy", "mcc")
_OWN_REGRESSION_METRICS = ("pearson", "spearmanr", "mse")


def own_data_task(name: str, *, text_columns: tuple[str, ...], label_column: str,
                  labels: tuple[str, ...] | None, eval_splits: tuple[str, ...], problem: str | None = None) -> TaskSpec:
    """The TaskSpec of a user's own data: ``labels`` lists the classes (label id = position), None
    for regression; `problem` a registered kind (its metrics), None for a classifier's."""
    metrics = registered_kind_metrics(problem) if problem is not None else None
    if metrics is None:
        metrics = _OWN_REGRESSION_METRICS if labels is None else _OWN_CLASSIFICATION_METRICS
    return TaskSpec(name, name, tuple(text_columns), labels, tuple(eval_splits), metrics, metrics[0], 0,
                    label_key=label_column, problem=problem)


# A supervised fine-tuning task's metrics, in report order. exact_match (greedy completions equal
# to the reference, token for token) is the main one when the run scores generations
# (evaluation.generation.exact_match); otherwise completion_loss is, which is lower-is-better
# (metrics.LOWER_IS_BETTER).
SFT_METRICS = ("exact_match", "completion_loss", "perplexity")


def sft_task(name: str, *, eval_splits: tuple[str, ...], exact_match: bool) -> TaskSpec:
    """The TaskSpec of a supervised fine-tuning data set of a causal LM (data.problem: causal_lm)."""
    metrics = SFT_METRICS if exact_match else SFT_METRICS[1:]
    return TaskSpec(name, name, (), None, tuple(eval_splits), metrics, metrics[0], 0, problem=CAUSAL_LM)
