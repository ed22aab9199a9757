"""Which examples each rank sees: epoch order, per-rank micro-batches, padded eval slices."""

from __future__ import annotations

import numpy as np
import pytest

from ft_framework.data.sharding import (batches_per_epoch, epoch_batches, epoch_permutation, eval_shard,
                                        rank_batches, restore_order)


def test_epoch_order_is_pinned_by_seed_and_epoch():
    # Literal orders: a change here reorders the data of every saved run and breaks their resumes.
    assert epoch_permutation(10, data_seed=42, epoch=0) == [8, 4, 0, 7, 5, 2, 6, 1, 9, 3]
    assert epoch_permutation(10, data_seed=42, epoch=1) == [1, 2, 3, 7, 0, 8, 4, 9, 5, 6]
    assert epoch_permutation(10, data_seed=7, epoch=0) == [3, 1, 8, 7, 6, 2, 0, 5, 9, 4]
    assert sorted(epoch_permutation(1000, 3, 5)) == list(range(1000))


@pytest.mark.parametrize("n, batch_size, world", [(10, 3, 1), (12, 3, 2), (13, 2, 3), (5, 4, 2), (1, 8, 2)])
def test_every_rank_gets_the_same_number_of_batches_and_rounds_partition_the_epoch(n, batch_size, world):
    order = epoch_permutation(n, data_seed=1, epoch=0)
    per_rank = [rank_batches(order, batch_size, rank, world) for rank in range(world)]
    assert {len(b) for b in per_rank} == {batches_per_epoch(n, batch_size, world)}
    seen = []
    for r in range(len(per_rank[0])):
        round_ = [i for rank in range(world) for i in per_rank[rank][r]]
        assert all(per_rank[rank][r] for rank in range(world)), "a rank got an empty batch"
        assert len(per_rank[0][r]) <= batch_size
        seen += round_
    # Each example once, plus the wrap-around's repeats when the last round has fewer than `world`.
    assert set(seen) == set(range(n))
    last_round = n % (batch_size * world)
    repeats = world - last_round if 0 < last_round < world else 0
    assert len(seen) == n + repeats


def test_rank_k_takes_every_world_size_th_example_of_a_round():
    order = list(range(100, 112))  # 12 examples, rounds of 3 * 2
    assert rank_batches(order, 3, rank=0, world_size=2) == [[100, 102, 104], [106, 108, 110]]
    assert rank_batches(order, 3, rank=1, world_size=2) == [[101, 103, 105], [107, 109, 111]]


def test_a_last_round_shorter_than_the_world_wraps_to_the_start_of_the_epoch():
    order = list(range(100, 109))  # 9 examples, rounds of 2 * 4: the last round holds one example
    last = [rank_batches(order, 2, rank, 4)[-1] for rank in range(4)]
    assert last == [[108], [100], [101], [102]]
    # A last round with at least one example per rank is split as is (some ranks get fewer).
    order = list(range(10))
    assert [rank_batches(order, 4, rank, 2)[-1] for rank in range(2)] == [[8], [9]]


def test_epoch_batches_is_rank_batches_of_the_epoch_order():
    order = epoch_permutation(11, data_seed=5, epoch=2)
    assert epoch_batches(11, batch_size=2, data_seed=5, epoch=2, rank=1, world_size=3) == rank_batches(order, 2, 1, 3)


@pytest.mark.parametrize("n, world", [(10, 1), (10, 3), (2, 3), (0, 2), (7, 7)])
def test_eval_shards_pad_to_one_length_and_restore_example_order(n, world):
    shards = [eval_shard(n, rank, world) for rank in range(world)]
    assert {len(s.padded) for s in shards} == {-(-n // world)}
    assert all(s.padded[:s.num_real] == s.indices for s in shards)
    assert sorted(i for s in shards for i in s.indices) == list(range(n))
    # Each rank "predicts" its example ids (padding included); gathering the real ones and
    # restoring the order must give 0..n-1.
    predicted = np.concatenate([np.asarray(s.padded[:s.num_real], dtype=np.int64) for s in shards])
    assert predicted[restore_order([s.indices for s in shards])].tolist() == list(range(n))


def test_a_rank_without_eval_examples_pads_with_example_zero():
    assert eval_shard(1, rank=2, world_size=3).padded == [0] and eval_shard(1, 2, 3).indices == []
    assert eval_shard(5, rank=1, world_size=3).padded == [1, 4]
    assert eval_shard(4, rank=1, world_size=3).padded == [1, 1]


def test_a_rank_outside_the_world_is_an_error():
    with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
        eval_shard(4, rank=2, world_size=2)
    with pytest.raises(ValueError, match="rank -1 is outside"):
        rank_batches([0, 1], 1, rank=-1, world_size=2)
