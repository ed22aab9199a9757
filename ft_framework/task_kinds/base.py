"""What a kind of task owns, as one interface: its model class, its data and batch collation, its
loss and its metrics (with the baseline a run is judged against and the forgetting probe). The
trainer, the memory plan and the integrations call these and never branch on the kind, as they
never branch on the backend (a Strategy hides that).

    kind = build_task_kind(cfg)                          # task_kinds/__init__.py
    loaded = load_model_and_tokenizer(cfg.model, model_class=kind.model_class, seed=...)
    data = kind.load_data(loaded.tokenizer, run=RunContext(...))
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch
import xxhash

from ft_framework.data.readers import source_files
from ft_framework.data.replay import ReplayMix
from ft_framework.data.tasks import TaskSpec
from ft_framework.data.token_cache import content_hash
from ft_framework.errors import UserError
from ft_framework.models.kl_anchor import KLAnchor
from ft_framework.models.loading import ModelClass
from ft_framework.models.lm_benchmarks import BenchmarkSuite
from ft_framework.models.probes import ForgettingProbe

if TYPE_CHECKING:
    from ft_framework.config import RunConfig

__all__ = ["Baseline", "EvalContext", "LossNormalizer", "MemoryRow", "MicroBatchLoss", "RunContext", "TaskKind",
           "TraceBatch", "combined_content", "to_device"]


@dataclass(frozen=True)
class RunContext:
    """What a kind needs to know of the run's processes while it loads data or builds a probe."""

    rank: int = 0
    world_size: int = 1
    is_main: bool = True
    barrier: Callable[[], None] = lambda: None
    gather: Callable[[Any], list[Any]] = lambda obj: [obj]
    device: torch.device = torch.device("cpu")
    progress: bool = False


@dataclass(frozen=True)
class EvalContext:
    """What an evaluation needs of the run: the strategy's forward (collective under sharding: every
    rank calls it the same number of times) and the gather of each rank's share."""

    forward: Callable[[dict[str, torch.Tensor]], Any]
    device: torch.device
    rank: int
    world_size: int
    gather: Callable[[Any], list[Any]]
    batch_size: int
    collate: Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LossNormalizer:
    """How the micro-batch losses of one optimizer step are scaled before backward: the step's
    micro-batch count and world size, and (for a kind that counts its loss in units, a causal LM's
    label tokens) the units of the whole step on every rank together."""

    micro_batches: int
    world_size: int
    step_units: float | None = None


@dataclass(frozen=True)
class MicroBatchLoss:
    """One micro-batch's loss: what backward receives (scaled by the step's LossNormalizer), and for
    the log its summed loss over its `units` (examples, or a causal LM's label tokens), so that the
    logged loss is the mean over every rank's units whatever the strategy. `terms`: the summed
    values over the same units of what the objective adds to the loss (loss.kl_to_pretrained's KL),
    logged beside it as their means."""

    backward: torch.Tensor
    total: float
    units: float
    terms: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Baseline:
    """What a run is judged against: what it is (`name`, e.g. "majority class") and its metrics per
    evaluation split."""

    name: str
    metrics: dict[str, dict[str, float]]

    def to_record(self) -> dict[str, Any]:
        return {"name": self.name, "metrics": self.metrics}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> "Baseline":
        return cls(str(record["name"]), {split: dict(m) for split, m in record["metrics"].items()})


@dataclass(frozen=True)
class TraceBatch:
    """One micro-batch as the memory plan traces it (strategies/memory_trace.py): the model's
    keyword arguments, made of fake tensors (shapes and dtypes, no data), and the loss of the
    model's outputs as training takes it. Under fake tensors no value can be read: a loss that
    counts something (a decoder's label tokens) reads zero there."""

    inputs: dict[str, Any]
    loss: Callable[[Any], torch.Tensor]


@dataclass(frozen=True)
class MemoryRow:
    """What a kind keeps for the whole run beyond the model and its optimizer (its probe's θ*
    side), or a micro-batch beyond the traced step (step_rows), as a row of the memory plan: bytes
    on the device and in host memory, per rank."""

    what: str
    device_bytes: float
    host_bytes: float


class TaskKind(ABC):
    """One kind of task (classification, regression, causal_lm); a subclass per module."""

    name: str = "base"
    # A kind registered from outside ft_framework (task_kinds.register_task_kind): the metrics its
    # evaluate() reports, in report order, the first the main one (metrics.LOWER_IS_BETTER says
    # which fall as the model improves).
    metrics: tuple[str, ...] = ()

    def __init__(self, spec: TaskSpec, cfg: "RunConfig"):
        self.spec = spec
        self.cfg = cfg

    # ---- model -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def model_class(self) -> ModelClass:
        """What models/loading.py loads for this kind."""

    # ---- data --------------------------------------------------------------------------------
    @abstractmethod
    def load_data(self, tokenizer: Any, run: RunContext) -> Any:
        """The run's tokenized data: an object with `train` (a Dataset whose items the collator
        takes) and `eval` (split -> Dataset)."""

    @abstractmethod
    def collator(self, tokenizer: Any, model_config: Any) -> Callable[[list[dict[str, Any]]], dict[str, Any]]:
        """Items of the datasets to one padded batch of tensors (`model_config`: the loaded model's,
        for what a batch must know of it, such as a decoder's attention windows)."""

    def describe_data(self, data: Any) -> dict[str, Any]:
        """What results.json records about the data beyond its size ({} when nothing)."""
        return {}

    def data_content(self, data: Any) -> dict[str, str]:
        """{config key: content id} of every data file and Hub data set the run has read (`data`: what
        load_data returned): its training and evaluation data, data.replay's file, the forgetting
        probe's file; a file read once before the first step (optimizer.importance's) once it was read.
        A file's id is the token cache's hash of its bytes (token_cache.content_hash), taken from the
        cache key where the file went through the cache (never hashed a second time); a Hub data set's
        is its revision as the cache keys it (hub_tables.HubSplit.fingerprint). A checkpoint records
        them and a resume compares them (run/fingerprint.py: check_data_content). This default: the
        files of data.files, each split by its bytes (one read of each), and the probe's file."""
        files = self.cfg.data.files or {}
        return {**self.probe_content(),
                **{f"data.files.{split}": self._hashed(f"data.files.{split}",
                                                       lambda: source_files(Path(path).expanduser(), split))
                   for split, path in files.items()}}

    def probe_content(self) -> dict[str, str]:
        """{"evaluation.forgetting.probe_file": its content id} when the probe reads a file ({} when
        not)."""
        forgetting = self.cfg.evaluation.forgetting
        if not (forgetting.enabled and forgetting.probe_file):
            return {}
        key = "evaluation.forgetting.probe_file"
        return {key: self._hashed(key, lambda: [Path(forgetting.probe_file)])}

    def _hashed(self, key: str, files: Callable[[], list[Path]]) -> str:
        """The content id of the files of config key `key`, hashed once a run (a second data_content
        call reads nothing again)."""
        done = self.__dict__.setdefault("_content_ids", {})
        if key not in done:
            done[key] = content_hash(files())
        return done[key]

    def replay(self, data: Any) -> ReplayMix | None:
        """data.replay's rows of general text and their draw (data/replay.py), which the loop adds to
        every optimizer step; None: the kind replays nothing (the config refuses data.replay for it)."""
        return None

    def build_kl_anchor(self, model: Any, data: Any) -> KLAnchor | None:
        """loss.kl_to_pretrained's stored targets (models/kl_anchor.py), keyed on `model` as loaded
        (before the strategy's wrap) and the training data; the assembly prepares it at θ* before the
        first step. None: off (the config refuses loss.kl_to_pretrained for a kind without it)."""
        return None

    # ---- loss ----------------------------------------------------------------------------------
    def model_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward for a collated batch."""
        return batch

    def step_units(self, batches: Sequence[dict[str, torch.Tensor]]) -> float | None:
        """This rank's loss units in the step's micro-batches (summed over ranks by the caller),
        or None when each micro-batch's loss is already its own mean."""
        return None

    @abstractmethod
    def loss(self, outputs: Any, batch: dict[str, torch.Tensor], normalizer: LossNormalizer) -> MicroBatchLoss:
        """The loss to back-propagate, scaled so that the step's gradient is the mean over the whole
        step on every rank, and the micro-batch's summed loss and units for the log."""

    # ---- metrics -------------------------------------------------------------------------------
    @abstractmethod
    def evaluate(self, data: Any, ctx: EvalContext) -> dict[str, dict[str, Any]]:
        """Metrics of every evaluation split (the task spec's metrics; every rank returns the
        whole). Collective."""

    @abstractmethod
    def baseline(self, data: Any, evaluate: Callable[[], dict[str, dict[str, Any]]]) -> Baseline:
        """The baseline of a fresh run, before its first step (`evaluate()` scores the model as it
        is then, collectively)."""

    def samples(self, data: Any, ctx: EvalContext) -> list[dict[str, Any]] | None:
        """A few outputs a person can read (a causal LM's greedy generations for fixed prompts),
        recorded at each evaluation; None: the kind has none."""
        return None

    def general_text(self, tokenizer: Any, run: RunContext) -> Any:
        """The general text whose next-token loss gives the Fisher of θ* (optimizer.importance,
        optim/importance.py): a dataset whose items the collator takes and whose loss() scores all
        their tokens but the first. A kind without a language model's loss has none (the config
        refuses optimizer.importance for it)."""
        raise UserError(f"optimizer.importance needs a language model's loss on general text; the {self.name} task "
                        "kind has none")

    # ---- forgetting ----------------------------------------------------------------------------
    @abstractmethod
    def build_probe(self, tokenizer: Any, run: RunContext) -> ForgettingProbe | None:
        """The functional-forgetting probe (models/probes.py; None when evaluation.forgetting is off)."""

    def build_benchmarks(self, tokenizer: Any, model: Any, run: RunContext) -> BenchmarkSuite | None:
        """The lm-evaluation-harness tasks of evaluation.benchmarks (models/lm_benchmarks.py), scored
        on θ* and the live model through the strategy's forward; None: the kind scores none (the
        config refuses them for it)."""
        return None

    # ---- the memory plan -----------------------------------------------------------------------
    @abstractmethod
    def trace_batch(self, arch: Any, *, batch_size: int, seq_len: int, device: str) -> TraceBatch:
        """One training micro-batch of (batch_size, seq_len) for a model of config `arch`, on fake
        tensors, with its loss: what the memory plan traces (ft-plan, training.memory_budget_gib)."""

    def trace_settings(self) -> tuple[Any, ...]:
        """What of the run's config `trace_batch` reads besides its arguments (a decoder's packing):
        the traces of two runs that agree on it and on the arguments are one."""
        return ()

    def memory_rows(self, arch: Any, *, world_size: int) -> list[MemoryRow]:
        """What the kind keeps on each rank for the whole run besides the model states and the
        step's activations (its forgetting probe's θ* side), for the memory plan."""
        return []

    def step_rows(self, arch: Any, *, batch_size: int, seq_len: int) -> list[MemoryRow]:
        """What one training micro-batch of (batch_size, seq_len) holds at the step's peak beyond what
        trace_batch traces (a decoder's KL anchor: its stored targets and its loss's buffers), as
        rows of the memory plan."""
        return []


def combined_content(ids: Mapping[str, str]) -> str:
    """One content id for several (a Hub data set's splits under its one config key, data.hub_id):
    the xxh3-128 hash of each name with its id, in name order."""
    return xxhash.xxh3_128(json.dumps(sorted(ids.items())).encode("utf-8")).hexdigest()


def to_device(value: Any, device: torch.device) -> Any:
    """A batch's tensors on `device`, inside dicts too (a packed batch's masks per layer type)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value
