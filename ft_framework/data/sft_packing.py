"""Packing: rows grouped into sequences of at most ``capacity`` tokens, once, when the data loads.

Best-fit decreasing: the rows are taken longest first (ties in file order), and each goes into the
open sequence with the least room that still holds it (the first opened among equals); when none
does, a new sequence opens. It is deterministic (a function of the row lengths alone), so every rank
and every resumed run packs the same sequences, and data/sharding.py deals them out as it deals
rows. A row is never split: the rows are already cut to capacity.

Rows of one length are placed together: while a sequence has room for several of them, it takes
them in one step, so the loop runs once per sequence touched rather than once per row.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

__all__ = ["best_fit_decreasing"]


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """(row order, sequence offsets): sequence k holds the rows ``order[offsets[k]:offsets[k + 1]]``,
    longest first. Every length must be in 1..capacity."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if len(lengths) and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"row lengths must be in 1..{capacity}, got {lengths.min()}..{lengths.max()}")
    by_length = np.lexsort((np.arange(len(lengths)), -lengths))  # longest first, ties in file order
    sorted_lengths = lengths[by_length]
    sequence_of = np.empty(len(lengths), dtype=np.int64)  # the sequence of each row, in by_length order
    with_room: dict[int, list[int]] = {}   # room left -> a heap of the sequences with exactly that room
    rooms: list[int] = []                   # the keys of with_room, sorted
    opened = 0
    placed = 0
    group_ends = np.flatnonzero(np.diff(sorted_lengths)) + 1
    for start, end in zip(np.concatenate([[0], group_ends]), np.concatenate([group_ends, [len(lengths)]])):
        length, waiting = int(sorted_lengths[start]), int(end - start)
        while waiting:
            best = bisect.bisect_left(rooms, length)
            if best < len(rooms):  # the fullest sequence that holds it takes as many as fit
                room = rooms[best]
                sequence = heapq.heappop(with_room[room])
                if not with_room[room]:
                    del with_room[room]
                    rooms.pop(best)
                taken = min(waiting, room // length)
                sequence_of[placed:placed + taken] = sequence
                _give_room(with_room, rooms, room - taken * length, [sequence])
            else:  # none holds it: new sequences, each filled with as many as fit
                per_sequence = capacity // length
                full, rest = divmod(waiting, per_sequence)
                taken = waiting
                new = np.arange(opened, opened + full + (rest > 0))
                sequence_of[placed:placed + taken] = np.repeat(new, [per_sequence] * full + ([rest] if rest else []))
                opened += len(new)
                _give_room(with_room, rooms, capacity - per_sequence * length, new[:full].tolist())
                if rest:
                    _give_room(with_room, rooms, capacity - rest * length, [int(new[-1])])
            placed += taken
            waiting -= taken
    order = by_length[np.argsort(sequence_of, kind="stable")]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(sequence_of, minlength=opened))]).astype(np.int64)
    return order.astype(np.int64), offsets


def _give_room(with_room: dict[int, list[int]], rooms: list[int], room: int, sequences: list[int]) -> None:
    if room <= 0 or not sequences:
        return
    if room not in with_room:
        with_room[room] = []
        bisect.insort(rooms, room)
    for sequence in sequences:
        heapq.heappush(with_room[room], int(sequence))
