"""Reading a data file into rows, each with the place a user would look for it: the 1-based line a
text editor shows (``reviews.csv:14``) or the index of a ``datasets`` row (``reviews[train][13]``).

Formats, by suffix: ``.tsv`` (tab-separated), ``.csv`` (comma-separated, quoted fields may hold
commas, quotes and line breaks), ``.jsonl`` (one JSON object a line), ``.parquet``; or a directory:
of Parquet files as the Hugging Face Hub lays a data set out (a split's files named for it, such as
``data/train-00000-of-00002.parquet``, or in a directory named for it, such as ``train/0000.parquet``;
datasets' own rules pick them), or saved with ``datasets``' ``save_to_disk``. Text files are UTF-8;
a byte-order mark and Windows line ends, as spreadsheets write them, read the same as a plain file.
Every file is opened as a file a user hands us (user_files.py): a named pipe or a device is refused
in one line, never waited on or read without end (no size bound: data files may be large).

Parquet is read one row group at a time (never a whole file at once), only the columns asked for;
a row is named by file, row group and row (``train.parquet (row group 2, row 17)``, the row
counted from 0 over the file, as pandas shows it).

A TSV file is read as GLUE's files are written: no quoting, so a quote in a sentence is a character
of it. A spreadsheet saving a TSV wraps each cell holding a quote (or a tab, or a line break) in
quotes and doubles the quotes inside; such a file is recognised (every cell with a quote is wrapped
that way) and read with quoting, so it gives the texts of the plain file.
"""

from __future__ import annotations

import csv
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from ft_framework.errors import UserError, quoted, shortened
from ft_framework.user_files import open_binary, text_stream

__all__ = ["PARQUET_SUFFIX", "Table", "TEXT_SUFFIXES", "read_table", "read_tsv_rows", "source_files"]

# Some GLUE fields (e.g. QQP questions) exceed csv's default 128 KiB field limit.
csv.field_size_limit(min(sys.maxsize, 2**31 - 1))

# The text formats, by file suffix; a directory is read as a datasets save_to_disk directory.
TEXT_SUFFIXES: tuple[str, ...] = (".csv", ".tsv", ".jsonl")
PARQUET_SUFFIX = ".parquet"

# A whole cell as a spreadsheet quotes it: wrapped in quotes, the quotes inside doubled.
_QUOTED_CELL = re.compile(r'"(?:[^"]|"")*"')


@dataclass
class Table:
    """The rows of one file: ``columns`` is the header of a CSV/TSV file or a dataset's columns (None
    for JSONL, whose objects each have their own keys); ``header`` says where the columns are named.
    ``records`` yields (where, {column: value}) in file order."""

    columns: list[str] | None
    header: str
    records: Iterable[tuple[str, dict[str, Any]]]


def read_table(path: Path, split: str, columns: Iterable[str] | None = None) -> Table:
    """The rows of ``path`` by its format (see the module doc); ``split`` picks the split of a
    directory holding several. ``columns``: the ones needed, where a format can read only those
    (Parquet); every record holds at least those the file has."""
    if path.is_dir():
        parquet = _parquet_files(path, split)
        return _dataset_table(path, split) if parquet is None else _parquet_table(parquet, columns)
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return Table(None, str(path), _jsonl_records(path))
    if suffix in (".csv", ".tsv"):
        rows = _delimited_rows(path, ",", csv.QUOTE_MINIMAL) if suffix == ".csv" else read_tsv_rows(path)
        return _header_table(path, rows)
    if suffix == PARQUET_SUFFIX:
        return _parquet_table([path], columns)
    raise UserError(f"{path}: unknown file type {quoted(path.suffix or '(no suffix)')}; valid: "
                    f"{', '.join(TEXT_SUFFIXES + (PARQUET_SUFFIX,))}, or a directory of Parquet files as the Hub "
                    "lays a split out, or one saved with datasets' save_to_disk")


def source_files(path: Path, split: str) -> list[Path]:
    """The files whose bytes make the rows that :func:`read_table` reads for ``path`` and ``split`` (what
    a cache of those rows is keyed on): the file itself; a Hub-style directory's Parquet files of the
    split; every file of a ``datasets`` directory, in name order."""
    if not path.is_dir():
        return [path]
    parquet = _parquet_files(path, split)
    return parquet if parquet is not None else sorted(f for f in path.rglob("*") if f.is_file())


def _parquet_files(directory: Path, split: str) -> list[Path] | None:
    """The Parquet files of ``split`` in ``directory``, or None for a directory without Parquet files
    (one saved with datasets' save_to_disk)."""
    if next(directory.rglob(f"*{PARQUET_SUFFIX}"), None) is None:
        return None
    return _parquet_split_files(directory, split)


# --------------------------------------------------------------------------------------------------
# Delimited text: TSV and CSV
# --------------------------------------------------------------------------------------------------


def read_tsv_rows(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(first line, fields) of each non-blank row of a TSV file: unquoted, or quoted the way a
    spreadsheet writes it (see the module doc). Two passes, streamed: GLUE's largest files are
    never held whole as rows."""
    quoted = _spreadsheet_quoted(row for _, row in _delimited_rows(path, "\t", csv.QUOTE_NONE))
    return _delimited_rows(path, "\t", csv.QUOTE_MINIMAL if quoted else csv.QUOTE_NONE)


def _delimited_rows(path: Path, delimiter: str, quoting: int) -> Iterator[tuple[int, list[str]]]:
    """(the line a row starts on, the row) of each non-blank row; with quoting, the standard
    (RFC 4180) rules, a quoted field spanning lines, and a malformed quote an error on its row."""
    next_start = 1
    try:
        with text_stream(path, newline="") as f:  # a regular file: a named pipe is refused, not waited on
            reader = csv.reader(f, delimiter=delimiter, quoting=quoting, strict=True)
            for row in reader:
                start, next_start = next_start, reader.line_num + 1
                if row:
                    yield start, row
    except UnicodeDecodeError:
        raise _not_utf8_error(path) from None
    except csv.Error as exc:
        # A quote left open runs to the end of the file: name the line its row starts on.
        raise UserError(f"{path}:{next_start}: malformed quoting in the row starting here ({exc}); a quoted "
                        "field ends with a quote followed by the separator or the line end, and the quotes "
                        'inside it are doubled ("")') from None


def _spreadsheet_quoted(rows: Iterable[list[str]]) -> bool:
    """Whether the rows, read without quoting, are a spreadsheet's quoted TSV: some cell holds a
    quote, and every cell that does starts or ends with one (a quoted cell that spans lines is cut
    into a piece that starts with the quote and one that ends with it), some whole cells wrapped.
    A file whose quotes stand inside its sentences, as GLUE's do, does not pass."""
    wrapped = False
    for row in rows:
        for cell in row:
            if '"' not in cell:
                continue
            if _QUOTED_CELL.fullmatch(cell):
                wrapped = True
            elif not (cell.startswith('"') or cell.endswith('"')):
                return False
    return wrapped


def _header_table(path: Path, rows: Iterator[tuple[int, list[str]]]) -> Table:
    """A CSV/TSV file's rows as records keyed by its header; every row has the header's width."""
    first = next(rows, None)
    if first is None:
        raise UserError(f"{path}: empty file; expected a header line naming the columns, then one example a line")
    header_line, header = first
    duplicates = sorted({c for c in header if header.count(c) > 1})
    if duplicates:
        raise UserError(f"{path}:{header_line}: the header names column {quoted(duplicates[0])} more than once: "
                        f"{quoted(header)}")

    def records() -> Iterator[tuple[str, dict[str, Any]]]:
        for line, row in rows:
            if len(row) != len(header):
                raise UserError(f"{path}:{line}: row has {len(row)} fields, the header has {len(header)} "
                                f"({quoted(header)}); quote a field that holds the separator")
            yield f"{path}:{line}", dict(zip(header, row))

    return Table(header, f"{path}:{header_line}", records())


# --------------------------------------------------------------------------------------------------
# JSON lines and datasets directories
# --------------------------------------------------------------------------------------------------


def _jsonl_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        with text_stream(path) as f:
            for line_no, line in enumerate(f, start=1):
                if line.strip():
                    yield _json_object(line, f"{path}:{line_no}")
    except UnicodeDecodeError:
        raise _not_utf8_error(path) from None


def _json_object(line: str, where: str) -> tuple[str, dict[str, Any]]:
    try:
        value = json.loads(line, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise UserError(f"{where}: not valid JSON at column {exc.colno} ({exc.msg}); each line must be "
                        "one JSON object") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: a JSON {type(value).__name__}, expected an object "
                        '({"column": value, ...}) on each line')
    return where, value


def _reject_constant(name: str) -> float:
    """NaN and Infinity are not JSON; Python's parser would accept them."""
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def _dataset_table(path: Path, split: str) -> Table:
    import datasets  # imported lazily: slow, and only a datasets directory needs it

    try:
        loaded = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise UserError(f"{path}: a directory, but not one saved with datasets' save_to_disk ({exc}); "
                        f"a data file must end in {', '.join(TEXT_SUFFIXES)}") from None
    where = str(path)
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise UserError(f"{path}: the saved DatasetDict has no split {split!r}; it has {quoted(list(loaded))}")
        loaded, where = loaded[split], f"{path}[{split}]"

    def records() -> Iterator[tuple[str, dict[str, Any]]]:
        for i, row in enumerate(loaded):
            yield f"{where}[{i}]", row

    return Table(list(loaded.column_names), where, records())


# --------------------------------------------------------------------------------------------------
# Parquet: files, and directories as the Hub lays splits out
# --------------------------------------------------------------------------------------------------


def _parquet_split_files(directory: Path, split: str) -> list[Path]:
    """The Parquet files of `split` in `directory`, in name order (a split's shards are numbered).
    Which files belong to which split is datasets' rule, the one the Hub applies: a split's name in
    the file name (``data/train-00000-of-00001.parquet``, ``dev.parquet``) or a directory name
    (``train/0000.parquet``), or one of datasets' other names for it (``dev`` for validation) when
    the directory has no split of our name. A directory whose names name no split at all holds one
    split's files: the one it is given as (``data.files.validation: mydata/validation``)."""
    # lazy: a slow import, needed by Parquet directories only
    from datasets.data_files import DEFAULT_PATTERNS_ALL, SPLIT_KEYWORDS, DataFilesDict, get_data_patterns

    patterns = {str(name): value for name, value in get_data_patterns(str(directory)).items()}
    if patterns == {str(name): value for name, value in DEFAULT_PATTERNS_ALL.items()}:
        patterns = {split: patterns[next(iter(patterns))]}
    names = next((list(words) for name, words in SPLIT_KEYWORDS.items() if str(name) == split), [split])
    present = [split] if split in patterns else [name for name in names if name in patterns]
    if len(present) != 1:
        found = "none of them" if not present else f"{' and '.join(present)}: more than one"
        raise UserError(f"{directory}: no Parquet files of the {split} split: the names of its files and "
                        f"directories give the splits {', '.join(sorted(patterns))}; the {split} split is named "
                        f"{' or '.join(dict.fromkeys([split, *names]))} ({found}; as the Hub reads names: e.g. "
                        f"data/{split}-00000-of-00001.parquet or {split}/0000.parquet)")
    resolved = DataFilesDict.from_patterns({split: patterns[present[0]]}, base_path=str(directory))[split]
    root = directory.resolve()
    files = sorted(directory / Path(name).resolve().relative_to(root) for name in resolved)
    others = [f for f in files if f.suffix.lower() in TEXT_SUFFIXES]
    if others:
        raise UserError(f"{others[0]}: a {others[0].suffix} file among the Parquet files of the {split} split in "
                        f"{directory}; keep one format per split")
    parquet = [f for f in files if f.suffix.lower() == PARQUET_SUFFIX]
    if not parquet:
        raise UserError(f"{directory}: no Parquet files of the {split} split (its files: "
                        f"{quoted([str(f.relative_to(directory)) for f in files])})")
    return parquet


def _parquet_table(files: list[Path], columns: Iterable[str] | None) -> Table:
    """The rows of Parquet `files` (one split's shards, in order), read a row group at a time. Every
    file must have the first one's columns; only `columns` (those of them the files have) are read."""
    import pyarrow as pa  # lazy, as datasets (whose dependency it is)
    import pyarrow.parquet as pq

    opened: list[tuple[Path, Any]] = []
    for path in files:
        try:
            opened.append((path, pq.ParquetFile(open_binary(path))))  # a regular file (user_files.py)
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"{path}: not a Parquet file that can be read ({shortened(str(exc))})") from None
    names = list(opened[0][1].schema_arrow.names)
    for path, parquet in opened[1:]:
        if list(parquet.schema_arrow.names) != names:
            raise UserError(f"{path}: its columns {quoted(list(parquet.schema_arrow.names))} differ from "
                            f"{opened[0][0]}'s {quoted(names)}; a split's files must have the same columns")
    wanted = None if columns is None else [c for c in names if c in set(columns)]

    def records() -> Iterator[tuple[str, dict[str, Any]]]:
        for path, parquet in opened:
            row = 0
            for group in range(parquet.num_row_groups):
                try:
                    rows = parquet.read_row_group(group, columns=wanted).to_pylist()
                except (pa.ArrowException, OSError) as exc:
                    raise UserError(f"{path} (row group {group}): cannot be read "
                                    f"({shortened(str(exc))})") from None
                for values in rows:
                    yield f"{path} (row group {group}, row {row})", values
                    row += 1

    return Table(names, str(files[0]), records())


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


def _not_utf8_error(path: Path) -> UserError:
    """The error for a file that is not UTF-8, naming the first bad line and byte."""
    with open_binary(path) as f:
        for line_no, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return UserError(f"{path}:{line_no}: not UTF-8 text (byte 0x{line[exc.start]:02x} at column "
                                 f"{exc.start + 1}); save the file as UTF-8")
    return UserError(f"{path}: not UTF-8 text; save the file as UTF-8")
