"""A decoder's supervised fine-tuning data (data.problem: causal_lm), from files or a Hub data set
(hub_tables.py) to torch datasets:
rows read and checked (sft_rows.py), tokenized once into the token cache (sft_tokenize.py,
token_cache.py), memory-mapped by every process, and packed for training when asked
(sft_packing.py); batches are sft_collate.py's.

    data = load_sft_data({"train": "train.jsonl", "validation": "dev.jsonl"}, tokenizer,
                         SFTSettings(max_seq_length=512), cache_dir=Path("~/.cache/ft_framework/tokens").expanduser())
    loader = DataLoader(data.train, batch_size=8, collate_fn=SFTCollator(tokenizer.pad_token_id))

An item is ``{"input_ids": [...], "labels": [...]}`` (labels -100 where no loss is taken); an eval
item also carries ``prompt_length`` (its tokens before the last completion or assistant turn) and
``completion_length`` (that completion's tokens, its EOS or end-of-turn tokens included), a packed
training item ``sequence_lengths`` (its rows' lengths). Eval splits are never packed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar

import numpy as np
from torch.utils.data import Dataset

from ft_framework.errors import MissingPath, UserError
from ft_framework.user_files import make_writable_directory

from ft_framework.data.hub_tables import HubSplit
from ft_framework.data.readers import Table, read_table, source_files
from ft_framework.data.sft_collate import IGNORE_INDEX, SFTCollator, attention_windows
from ft_framework.data.sft_packing import best_fit_decreasing
from ft_framework.data.sft_rows import COLUMNS, sft_rows
from ft_framework.data.sft_tokenize import TOKENIZATION_VERSION, RowTokenizer, chat_template_text
from ft_framework.data.token_cache import (DEFAULT_CACHE_DIR, FORMAT_VERSION, CacheEntry, DamagedEntry, EntryWriter,
                                           array_blocks, content_hash, entry_name, open_entry, prepare_entry,
                                           tokenizer_fingerprint)

__all__ = ["DEFAULT_CACHE_DIR", "PackedSFTDataset", "SFTCollator", "SFTData", "SFTDataset", "SFTSettings",
           "attention_windows", "load_sft_data", "load_text_rows"]

# The arrays of a split's cache entry: flat tokens, their targets (1: a loss on this token), each row's
# token offsets, its tokens before the last completion and that completion's tokens.
ARRAYS = {"input_ids": np.int32, "target_mask": np.uint8, "offsets": np.int64, "prompt_lengths": np.int32,
          "completion_lengths": np.int32}
# The counts a split reports (results.json, the log); packed training adds "packed_sequences".
STAT_KEYS = ("rows", "truncated", "dropped_no_completion", "tokens", "completion_tokens")
# Rows tokenized per batch call of the tokenizer.
CHUNK_ROWS = 2048
TRAIN = "train"
# The config key that names cache_dir (its default: DEFAULT_CACHE_DIR).
CACHE_DIR_KEY = "data.token_cache_dir"

_T = TypeVar("_T")


@dataclass(frozen=True)
class SFTSettings:
    """What changes the tokens (max_seq_length, train_on_prompt, chat_template: a template's text, or
    None for the tokenizer's own) and whether training rows are packed."""

    max_seq_length: int
    train_on_prompt: bool = False
    chat_template: str | None = None
    packing: bool = False


class SFTDataset(Dataset):
    """A split's rows, read from its cache entry's memory maps (one copy in the page cache for every
    process). ``with_lengths``: items carry prompt_length and completion_length (eval splits)."""

    def __init__(self, entry: CacheEntry, key: Mapping[str, Any], *, with_lengths: bool):
        self._entry, self._key, self.with_lengths = entry, dict(key), with_lengths
        self._arrays = entry.arrays
        self.lengths = np.diff(self._arrays["offsets"])

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def rows(self) -> "SFTDataset":
        """The rows its items are made of: itself (a PackedSFTDataset's are the rows it packs)."""
        return self

    def rows_of(self, index: int) -> list[int]:
        """The rows item `index` is made of, in its order: the row itself."""
        return [index]

    @property
    def cache_key(self) -> dict[str, Any]:
        """Its token cache entry's key: what its tokens are made of (data, tokenizer, settings)."""
        return dict(self._key)

    def target_counts(self) -> np.ndarray:
        """Each row's target tokens (its labels that count: a row's first token never does)."""
        mask = np.asarray(self._arrays["target_mask"], dtype=np.int64)
        return np.add.reduceat(mask, self._arrays["offsets"][:-1]) if len(self) else np.zeros(0, dtype=np.int64)

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Each row's tokens before its last completion (read-only; what items carry as prompt_length)."""
        return self._arrays["prompt_lengths"]

    @property
    def completion_lengths(self) -> np.ndarray:
        """Each row's last completion's tokens (read-only; items' completion_length)."""
        return self._arrays["completion_lengths"]

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        start, end = self._arrays["offsets"][index:index + 2]
        ids = np.asarray(self._arrays["input_ids"][start:end], dtype=np.int64)
        labels = np.where(self._arrays["target_mask"][start:end] != 0, ids, IGNORE_INDEX)
        item: dict[str, Any] = {"input_ids": ids.tolist(), "labels": labels.tolist()}
        if self.with_lengths:
            item["prompt_length"] = int(self._arrays["prompt_lengths"][index])
            item["completion_length"] = int(self._arrays["completion_lengths"][index])
        return item

    # Pickled (a DataLoader worker, spawn), a dataset names its entry and maps it again: a memory map
    # pickles as a copy of its bytes.
    def __getstate__(self) -> dict[str, Any]:
        return {"path": str(self._entry.path), "key": self._key, "with_lengths": self.with_lengths}

    def __setstate__(self, state: dict[str, Any]) -> None:
        entry = open_entry(Path(state["path"]), state["key"], ARRAYS, verify=False)
        self.__init__(entry, state["key"], with_lengths=state["with_lengths"])


class PackedSFTDataset(Dataset):
    """Training rows packed into sequences of at most ``capacity`` tokens (sft_packing.py); an item is a
    sequence: its rows' tokens and labels one after another, and ``sequence_lengths``."""

    def __init__(self, rows: SFTDataset, capacity: int):
        self.rows = rows
        self.order, self.offsets = best_fit_decreasing(rows.lengths, capacity)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows_of(self, index: int) -> list[int]:
        """The rows packed sequence `index` is made of, in its order."""
        return self.order[self.offsets[index]:self.offsets[index + 1]].tolist()

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        items = [self.rows[int(row)] for row in self.order[self.offsets[index]:self.offsets[index + 1]]]
        return {"input_ids": [t for item in items for t in item["input_ids"]],
                "labels": [t for item in items for t in item["labels"]],
                "sequence_lengths": [len(item["input_ids"]) for item in items]}


@dataclass
class SFTData:
    """A run's SFT data: ``train`` (packed when the settings say so), ``eval`` (split -> rows, never
    packed), and ``stats``: per split, rows read, rows truncated (cut to max_seq_length and kept),
    rows dropped for no completion token left, tokens and completion (target) tokens kept, and for
    packed training the number of packed sequences."""

    train: Dataset
    eval: dict[str, Dataset]
    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    # data.replay's rows and their draw (data/replay.py's ReplayMix); None: no replay.
    replay: Any = None


def load_sft_data(files: Mapping[str, str | Path | HubSplit], tokenizer: Any, settings: SFTSettings, *,
                  cache_dir: Path,
                  is_main: bool = True, barrier: Callable[[], None] = lambda: None,
                  max_train_examples: int | None = None, max_eval_examples: int | None = None,
                  progress: bool = False) -> SFTData:
    """The SFT data of ``files`` (split -> a file or a directory, or a Hub data set's split from
    hub_tables.py; ``train`` and at least one eval split), tokenized by ``tokenizer`` under
    ``settings``, through the token cache in ``cache_dir``.

    ``is_main``: this process tokenizes what the cache lacks and writes it, while the others wait at
    ``barrier`` (the caller's; every process calls it once) and then read it: the one process per
    cache directory (rank 0 for a shared one, each node's local rank 0 for a node-local one).
    ``max_train_examples`` / ``max_eval_examples``: the first N rows of the train / each eval file.
    ``progress``: a progress bar over the rows being tokenized."""
    if TRAIN not in files or len(files) < 2:
        raise UserError(f"data.files names the splits {sorted(files)}; supervised fine-tuning needs train and "
                        "validation (test optional)")
    if is_main:  # the one writer: a file where the directory should be is named before any row is read
        make_writable_directory(cache_dir, key=CACHE_DIR_KEY)
    template = chat_template_text(tokenizer, settings.chat_template)
    tokenizer_hash = tokenizer_fingerprint(tokenizer, template)
    splits: dict[str, tuple[_RowSource, dict[str, Any]]] = {}
    for split, name in files.items():
        source = _RowSource.of(name, split)
        limit = max_train_examples if split == TRAIN else max_eval_examples
        if limit is not None and limit < 1:
            raise UserError(f"the {split} split's example limit is {limit}; give at least 1 (or none)")
        key = {"format": FORMAT_VERSION, "tokenization": TOKENIZATION_VERSION, "split": split,
               "source": source.fingerprint, "tokenizer": tokenizer_hash,
               "max_seq_length": settings.max_seq_length, "train_on_prompt": settings.train_on_prompt, "rows": limit}
        splits[split] = (source, key)
    if is_main:
        row_tokenizer = RowTokenizer(tokenizer, max_seq_length=settings.max_seq_length,
                                     train_on_prompt=settings.train_on_prompt, chat_template=settings.chat_template)
        for split, (source, key) in splits.items():
            limit = key["rows"]
            prepare_entry(cache_dir, key, ARRAYS,
                          build=lambda writer, source=source, split=split, limit=limit: _tokenize_split(
                              writer, row_tokenizer, source, split, limit, progress),
                          check=lambda entry: _check_entry(entry, len(tokenizer)))
    barrier()
    datasets: dict[str, SFTDataset] = {}
    stats: dict[str, dict[str, int]] = {}
    for split, (source, key) in splits.items():
        entry = _open(cache_dir, key, split)
        stats[split] = {name: int(entry.facts[name]) for name in STAT_KEYS}
        if not len(entry.arrays["prompt_lengths"]):
            raise UserError(f"{source.name}: no row has a completion token left within "
                            f"max_seq_length {settings.max_seq_length} ({stats[split]['rows']} read, "
                            f"{stats[split]['dropped_no_completion']} dropped); raise data.max_seq_length")
        datasets[split] = SFTDataset(entry, key, with_lengths=split != TRAIN)
    train: Dataset = datasets.pop(TRAIN)
    if settings.packing:
        train = PackedSFTDataset(train, settings.max_seq_length)
        stats[TRAIN]["packed_sequences"] = len(train)
    return SFTData(train=train, eval=datasets, stats=stats)


def load_text_rows(name: str, fingerprint: str, table: Callable[[], Table], tokenizer: Any, max_seq_length: int, *,
                   split: str, cache_dir: Path, is_main: bool = True, barrier: Callable[[], None] = lambda: None,
                   progress: bool = False) -> tuple[SFTDataset, dict[str, int]]:
    """Rows of the text shape (the caller's ``table`` holds only those): every token a target, cut to
    ``max_seq_length``, through the token cache as a split's rows are (keyed on ``fingerprint``, the
    tokenizer and the length; ``name`` says where they come from in messages). The rows and their
    counts (STAT_KEYS)."""
    if is_main:
        make_writable_directory(cache_dir, key=CACHE_DIR_KEY)
    source = _RowSource(name, fingerprint, table)
    key = {"format": FORMAT_VERSION, "tokenization": TOKENIZATION_VERSION, "split": split, "source": fingerprint,
           "tokenizer": tokenizer_fingerprint(tokenizer, None), "max_seq_length": max_seq_length,
           "train_on_prompt": True, "rows": None}
    if is_main:
        row_tokenizer = RowTokenizer(tokenizer, max_seq_length=max_seq_length, train_on_prompt=True, chat_template=None)
        prepare_entry(cache_dir, key, ARRAYS,
                      build=lambda writer: _tokenize_split(writer, row_tokenizer, source, split, None, progress),
                      check=lambda entry: _check_entry(entry, len(tokenizer)))
    barrier()
    entry = _open(cache_dir, key, split)
    stats = {stat: int(entry.facts[stat]) for stat in STAT_KEYS}
    if not len(entry.arrays["prompt_lengths"]):
        raise UserError(f"{name}: no row has two tokens or more to predict from ({stats['rows']} read)")
    return SFTDataset(entry, key, with_lengths=False), stats


@dataclass
class _RowSource:
    """Where a split's rows come from: a file (or directory) or a Hub data set's split; ``name`` says
    which in messages, ``fingerprint`` is what the token cache keys on (a file's bytes, a data set's
    revision)."""

    name: str
    fingerprint: str
    table: Callable[[], Table]

    @classmethod
    def of(cls, source: str | Path | HubSplit, split: str) -> "_RowSource":
        if isinstance(source, HubSplit):
            return cls(source.where, source.fingerprint, lambda: source.table(COLUMNS))
        path = Path(source).expanduser()
        if not path.exists():
            raise MissingPath(f"data.files.{split}: {path} not found (relative paths start at the current directory)")
        return cls(f"data.files.{split}: {path}", content_hash(source_files(path, split)),
                   lambda: read_table(path, split, columns=COLUMNS))


def _open(cache_dir: Path, key: Mapping[str, Any], split: str) -> CacheEntry:
    path = cache_dir / entry_name(key)
    try:
        return open_entry(path, key, ARRAYS, verify=False)
    except (FileNotFoundError, DamagedEntry) as exc:
        raise UserError(f"the token cache entry of the {split} split, {path}, which the main process prepared, cannot "
                        f"be read here ({exc}); every process must see the same {CACHE_DIR_KEY}") from None


def _tokenize_split(writer: EntryWriter, row_tokenizer: RowTokenizer, source: _RowSource, split: str,
                    limit: int | None, progress: bool) -> dict[str, Any]:
    """Streams the split's rows through the tokenizer a chunk at a time into ``writer``; the counts."""
    from tqdm.auto import tqdm  # lazy, as the trainer's progress bar

    counts = dict.fromkeys(STAT_KEYS, 0)
    writer.append(offsets=np.zeros(1, dtype=np.int64))
    with tqdm(desc=f"tokenizing {split}", unit=" rows", disable=not progress, total=limit) as bar:
        for chunk in _chunks(sft_rows(source.table(), limit), CHUNK_ROWS):
            tokens = row_tokenizer.tokenize(chunk)
            writer.append(input_ids=tokens.input_ids, target_mask=tokens.target_mask,
                          offsets=counts["tokens"] + np.cumsum(tokens.lengths),
                          prompt_lengths=tokens.prompt_lengths, completion_lengths=tokens.completion_lengths)
            counts["rows"] += tokens.rows
            counts["truncated"] += tokens.truncated
            counts["dropped_no_completion"] += tokens.dropped
            counts["tokens"] += len(tokens.input_ids)
            counts["completion_tokens"] += int(np.count_nonzero(tokens.target_mask))
            bar.update(tokens.rows)
    if not counts["rows"]:
        raise UserError(f"{source.name}: no rows in the {split} split; a run needs rows to train on and to evaluate")
    return counts


def _chunks(items: Iterable[_T], size: int) -> Iterator[list[_T]]:
    chunk: list[_T] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _check_entry(entry: CacheEntry, vocab_size: int) -> None:
    """An entry's arrays agree with each other and with its counts (the writer's side, before use)."""
    arrays, facts = entry.arrays, entry.facts
    for name in STAT_KEYS:
        if not isinstance(facts.get(name), int):
            raise DamagedEntry(f"its count {name!r} is missing")
    offsets, rows = arrays["offsets"], len(arrays["prompt_lengths"])
    if len(offsets) != rows + 1 or len(arrays["completion_lengths"]) != rows:
        raise DamagedEntry("its per-row arrays differ in length")
    if offsets[0] != 0 or offsets[-1] != len(arrays["input_ids"]) or len(arrays["target_mask"]) != offsets[-1]:
        raise DamagedEntry("its offsets do not span its tokens")
    lengths = np.diff(offsets)
    if rows and lengths.min() < 1:
        raise DamagedEntry("it has a row without tokens")
    prompt, completion = arrays["prompt_lengths"], arrays["completion_lengths"]
    if rows and (prompt.min() < 0 or completion.min() < 0 or (prompt + completion > lengths).any()):
        raise DamagedEntry("its prompt and completion lengths exceed their rows")
    if facts["tokens"] != offsets[-1] or facts["rows"] - facts["dropped_no_completion"] != rows:
        raise DamagedEntry("its counts disagree with its arrays")
    # Read in blocks, not through the maps: the writer's process keeps no token page mapped.
    if any(block.min() < 0 or block.max() >= vocab_size for block in array_blocks(entry, "input_ids")):
        raise DamagedEntry(f"it holds tokens outside the tokenizer's {vocab_size}")
    if sum(int(np.count_nonzero(block)) for block in array_blocks(entry, "target_mask")) != facts["completion_tokens"]:
        raise DamagedEntry("its target count disagrees with its mask")
