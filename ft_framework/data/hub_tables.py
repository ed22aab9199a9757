"""A data set on the Hugging Face Hub (``data.source: hub`` with ``data.hub_id``) read as tables of
rows, as readers.py reads a file: each row named ``org/name[split][index]``.

``datasets.load_dataset_builder`` resolves the data set (online, its newest revision; offline, with
HF_HUB_OFFLINE=1, the copy an earlier download left in the Hugging Face cache). Its ``hash`` is the
revision the rows come from, which the token cache keys on instead of a file's bytes; it is known
before any row is read, so a split already tokenized is never downloaded again. A split is then
prepared as ``load_dataset`` prepares it (downloaded once into the Hugging Face cache as Arrow files,
memory-mapped, read a batch at a time) or, with ``streaming``, read from the Hub as it is tokenized
(nothing kept; for a set larger than the disk).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import xxhash

from ft_framework.errors import UserError, quoted, shortened

from ft_framework.data.readers import Table

__all__ = ["HubSource", "HubSplit", "open_hub_split"]

_BATCH_ROWS = 1024


@dataclass(frozen=True)
class HubSource:
    """A Hub data set: its id, its configuration (None: the data set's default), our split names ->
    the data set's, and whether its rows are streamed."""

    hub_id: str
    config: str | None = None
    splits: Mapping[str, str] = field(default_factory=lambda: {"train": "train", "validation": "validation"})
    streaming: bool = False

    def describe(self, split: str) -> str:
        """How a message names our ``split`` of it: ``org/name[train_sft]`` (its configuration in
        parentheses)."""
        config = f" ({self.config})" if self.config else ""
        return f"{self.hub_id}{config}[{self.splits[split]}]"


@dataclass
class HubSplit:
    """One split of a resolved data set: ``fingerprint`` (the revision, configuration and split,
    hashed) and ``table`` (its rows, read when first asked)."""

    source: HubSource
    split: str
    builder: Any

    @property
    def where(self) -> str:
        return self.source.describe(self.split)

    @property
    def fingerprint(self) -> str:
        facts = [self.source.hub_id, self.builder.config_id, self.builder.hash, self.source.splits[self.split]]
        return xxhash.xxh3_128(repr(facts).encode("utf-8")).hexdigest()

    def table(self, columns: Iterable[str] | None = None) -> Table:
        """The split's rows; ``columns``: the ones read, where the data set has them (the others are never
        decoded)."""
        name = self.source.splits[self.split]
        try:
            if self.source.streaming:
                dataset = self.builder.as_streaming_dataset(split=name)
            else:
                self.builder.download_and_prepare()
                dataset = self.builder.as_dataset(split=name)
        except (ConnectionError, OSError, ValueError) as exc:
            raise UserError(f"{self.where}: cannot read the split ({type(exc).__name__}: {shortened(str(exc))})") \
                from None
        names = dataset.column_names
        if columns is not None and names is not None:
            kept = [column for column in columns if column in names]
            if kept:
                dataset = dataset.select_columns(kept)
                names = kept
        return Table(list(names) if names is not None else None, self.where, self._records(dataset))

    def _records(self, dataset: Any) -> Iterator[tuple[str, dict[str, Any]]]:
        index = 0
        for batch in dataset.iter(batch_size=_BATCH_ROWS):
            keys = list(batch)
            for values in zip(*(batch[key] for key in keys)):
                yield f"{self.source.hub_id}[{self.source.splits[self.split]}][{index}]", dict(zip(keys, values))
                index += 1


def open_hub_split(source: HubSource, split: str) -> HubSplit:
    """Our ``split`` of ``source``, resolved (no row read yet). A data set that cannot be resolved, or
    lacks the split, is a UserError in one line."""
    import datasets  # slow to import; only a Hub source needs it

    try:
        builder = datasets.load_dataset_builder(source.hub_id, source.config)
    except (ConnectionError, OSError, ValueError) as exc:
        raise UserError(f"data.hub_id {quoted(source.hub_id)}: cannot load the data set ({type(exc).__name__}: "
                        f"{shortened(str(exc))}); offline (HF_HUB_OFFLINE=1) only a data set already in the Hugging "
                        "Face cache loads") from None
    if builder.hash is None:
        raise UserError(f"data.hub_id {quoted(source.hub_id)}: the data set names no revision, which the token "
                        "cache keys on; give a data set on the Hub")
    name = source.splits[split]
    known = list(builder.info.splits or {})
    if known and name not in known:
        raise UserError(f"data.splits.{split}: {source.hub_id} has no split {quoted(name)}; its splits: "
                        f"{', '.join(known)} (data.splits maps ours to them, e.g. {{train: train, validation: test}})")
    return HubSplit(source, split, builder)
