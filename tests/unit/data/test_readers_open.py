"""A data file a user names is opened as a file a user hands us (data/readers.py through user_files.py):
a named pipe in a file's place is refused in one line, never waited on, in every format; /dev/zero
is refused unread. A blocked open of a text file is turned into a failure by an alarm; pyarrow's
own open of a Parquet file does not return to Python on a signal, so that case runs in a child
process with a deadline."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bounded import BLOCKS_AFTER_S, memory_bounded, no_block
from ft_framework.data.readers import read_table
from ft_framework.errors import UserError

@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_a_named_pipe_as_a_text_data_file_is_refused_without_blocking(tmp_path, suffix):
    path = tmp_path / f"train{suffix}"
    os.mkfifo(path)

    with no_block(f"the named pipe {path} was opened"), pytest.raises(UserError) as refused:
        list(read_table(path, "train").records)
    message = str(refused.value)
    assert "\n" not in message and f"{path} is a named pipe, not a regular file" in message, message


def test_a_link_to_dev_zero_is_refused_unread(tmp_path):
    (tmp_path / "train.jsonl").symlink_to("/dev/zero")
    with memory_bounded(), pytest.raises(UserError, match="is a character device, not a regular file"):
        list(read_table(tmp_path / "train.jsonl", "train").records)


READ_IN_A_CHILD = """
import sys
from ft_framework.data.readers import read_table
from ft_framework.errors import UserError
try:
    list(read_table(__import__("pathlib").Path(sys.argv[1]), "train").records)
except UserError as exc:
    print(exc)
"""


def test_a_named_pipe_as_a_parquet_file_is_refused_without_blocking(tmp_path):
    path = tmp_path / "train.parquet"
    os.mkfifo(path)
    try:
        done = subprocess.run([sys.executable, "-c", READ_IN_A_CHILD, str(path)], capture_output=True, text=True,
                              timeout=BLOCKS_AFTER_S * 3)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading {path} still blocked after {BLOCKS_AFTER_S * 3} s: the named pipe was opened")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == f"{path} is a named pipe, not a regular file: refused without reading it " \
                                  "(ft_framework reads regular files only)", done.stdout
