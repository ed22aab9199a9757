"""One interface for the functional-forgetting probes of every task kind, and the one builder of
them. A probe owns θ*'s side of its comparison: where it comes from (the pretrained checkpoint, for
an encoder's probe, read when the probe is built; or the run's own model before its first step,
for a decoder's), what it keeps in the run's directory, and how a resumed run (or ft-interpolate)
reads it back. Its callers (the trainer, ft-interpolate) call the same methods whatever the probe,
and never ask which kind of probe they hold.

    probe = build_probe(LMForgettingProbe, cfg.evaluation.forgetting, tokenizer=..., batch_size=...)
    probe.reference_from_model(forward, keep_in=run_paths.forgetting_reference, ...)   # a fresh run
    probe.reference_from_run(saved_in, keep_in=run_paths.forgetting_reference, ...)    # a resumed one
    probe.measure(forward)   # -> {measure name: value}
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

import torch

from ft_framework.models.forgetting import DEFAULT_PROBE_SOURCE, default_probe_sentences, read_probe_file

__all__ = ["ForgettingProbe", "build_probe", "probe_text"]

Forward = Callable[[dict[str, torch.Tensor]], Any]


@runtime_checkable
class ForgettingProbe(Protocol):
    """What every forgetting probe does. Every method is collective under sharding: each rank calls
    it, with the strategy's forward, and every rank gets the whole answer."""

    # The names of the measures `measure` returns, in report order (the tables' columns).
    measures: tuple[str, ...]

    def reference_from_model(self, forward: Forward, keep_in: Path | None, *, is_main: bool,
                             barrier: Callable[[], None]) -> None:
        """θ*'s side from the model `forward` runs now (a fresh run's, before its first step; or θ*
        itself), kept in directory `keep_in` (None: kept nowhere) for a resumed run. A probe whose
        θ*'s side comes from elsewhere does nothing."""

    def reference_from_run(self, saved_in: Path, keep_in: Path | None, *, is_main: bool,
                           barrier: Callable[[], None]) -> None:
        """θ*'s side as the run kept it in `saved_in` (by `reference_from_model`), kept in `keep_in` too
        when that is another directory. A probe that keeps nothing does nothing."""

    def keeps_reference(self, directory: Path) -> bool:
        """Whether `directory` holds θ*'s side as `reference_from_model` keeps it."""

    def measure(self, forward: Forward) -> dict[str, float]:
        """θ's forgetting: `forward(batch)` runs θ (with hidden states)."""

    def describe(self) -> dict[str, Any]:
        """What results.json says about the probe."""


def probe_text(forgetting_cfg: Any) -> tuple[list[str], str]:
    """(the probe's sentences, where they come from): evaluation.forgetting.probe_file's, or the
    default probe text's."""
    num = forgetting_cfg.num_sentences
    if forgetting_cfg.probe_file is None:
        return default_probe_sentences(num), DEFAULT_PROBE_SOURCE
    return read_probe_file(forgetting_cfg.probe_file, num), forgetting_cfg.probe_file


P = TypeVar("P")


def build_probe(probe_class: Callable[..., P], forgetting_cfg: Any, *, tokenizer: Any, batch_size: int,
                rank: int = 0, world_size: int = 1, device: torch.device | str = "cpu",
                gather: Callable[[Any], list[Any]] = lambda obj: [obj], **kind_arguments: Any) -> P | None:
    """The probe an `evaluation.forgetting` config section describes, of the kind's `probe_class`
    (None when disabled): the same text, length and batches for every kind; `kind_arguments` are
    what only that class reads (an encoder's checkpoint and mask seed). Collective when `gather` is."""
    if not forgetting_cfg.enabled:
        return None
    sentences, source = probe_text(forgetting_cfg)
    return probe_class(sentences=sentences, source=source, tokenizer=tokenizer, max_length=forgetting_cfg.max_length,
                       batch_size=batch_size, rank=rank, world_size=world_size, device=torch.device(device),
                       gather=gather, **kind_arguments)
