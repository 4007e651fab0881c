"""pallas_kernels/mla_attention_plan.py: how a call of the Mosaic GPU attention is cut into programs, the split
counts per stream and each split's key blocks (the kernels and their twin take the same shares)."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mla_attention_plan as P


def test_default_splits_fill_the_gpu_only_when_needed():
    assert P.default_splits(1, 1, 65536, 64) == P.MAX_SPLITS == 128
    assert P.default_splits(1, 1, 65536, 64, num_sms=16) == 16
    assert P.default_splits(16, 1, 8192, 64) == 8        # 128 programs: one wave, not 144
    assert P.default_splits(16, 256, 8192, 64) == 1
    assert P.default_splits(1, 1, 256, 64) == 2          # at least 2 blocks per split
    assert P.default_splits(1, 1, 256, 64, min_blocks=1) == 4
    # one block a split with at most 32 real rows, or over a cache of at most 1K where a wave holds a program per
    # block; else 2 (the tree adds its blocks)
    assert P.splits_for(4, 1, 8, 1024) == 17 and P.splits_for(1, 8, 8, 1024) == 18
    assert P.splits_for(1, 1, 8, 2048) == 33 and P.splits_for(1, 1, 8, 8192) == 128  # 8 rows
    assert P.splits_for(1, 4, 8, 4096) == 66 and P.splits_for(1, 8, 8, 4096) == 33  # 32 rows; 64
    assert P.splits_for(1, 1, 64, 8192) == 64 and P.splits_for(1, 8, 8, 8192) == 65  # 64 rows over 8K
    assert P.splits_for(1, 1, 64, 1032) == 8 and P.splits_for(16, 1, 64, 1024) == 8  # 1032 > 1K; a wave
    assert P.splits_for(4, 1, 64, 1024) == 17 and P.splits_for(1, 32, 8, 1024) == 18  # 68 and 72 programs
    assert P.splits_for(1, 64, 8, 1024) == 9 and P.splits_for(1, 8, 64, 1024) == 9  # 8 tiles x 18 blocks > a wave
    # T = 9, H = 8: one tile and a tail fills the wave with twice the splits of two tiles
    assert P.splits_for(1, 9, 8, 65536) == 128 and P.splits_for(1, 9, 8, 65536, tail=False) == 66
    assert P.splits_for(16, 9, 8, 8192) == 8 and P.splits_for(16, 10, 8, 8192) == 4


def test_splits_take_ceil_shares_in_order():
    """Without ``peer_merge`` the NS splits take every block once, in order, cache blocks before tree blocks,
    ceil(total / NS) each until the blocks run out: 1 025 blocks over 128 splits are 113 x 9, one 8 and 14 empty
    splits (the shipped rule: even shares were slower on the H200 at 12 of 15 points, session 48)."""
    for nb, tree_blocks, NS in [(nb, tb, ns) for nb in range(0, 70, 3) for tb in (0, 1, 4) for ns in (1, 3, 8, 17)] \
            + [(1024, 1, 128), (128, 1, 8)]:
        total = nb + tree_blocks
        ranges = [[int(x) for x in P.split_range(jnp.int32(nb), tree_blocks, jnp.int32(sp), NS)] for sp in range(NS)]
        assert ranges[0][0] == 0 and ranges[-1][2] == total, (nb, tree_blocks, NS)
        assert all(a[2] == b[0] for a, b in zip(ranges, ranges[1:])), (nb, tree_blocks, NS)
        per = -(-total // NS)
        assert [hi - lo for lo, _, hi in ranges] == [min(per, max(total - sp * per, 0)) for sp in range(NS)]
        assert all(mid == min(max(nb, lo), hi) for lo, mid, hi in ranges), (nb, tree_blocks, NS)
    ranges = (P.split_range(jnp.int32(1024), 1, jnp.int32(sp), 128) for sp in range(128))
    sizes = [int(hi - lo) for lo, _, hi in ranges]
    assert sizes == [9] * 113 + [8] + [0] * 14


@pytest.mark.parametrize("tree_blocks", [1, 2, 3])
def test_peer_merge_split_1_takes_at_least_one_block_more(tree_blocks):
    """With ``peer_merge`` split 1 takes the first total - (total - 1) // 2 blocks and split 0 the rest: together
    every block once, in order, cache blocks before tree blocks, and split 1 at least one block more (its merge
    waits for split 0's store)."""
    for nb in range(0, 40):
        total = nb + tree_blocks
        (lo1, mid1, hi1), (lo0, mid0, hi0) = (
            [int(x) for x in P.split_range(jnp.int32(nb), tree_blocks, jnp.int32(sp), 2, True)] for sp in (1, 0))
        assert (lo1, hi1, hi0) == (0, lo0, total), (nb, tree_blocks)
        assert hi1 - lo1 == (hi0 - lo0) + 1 + (total % 2 == 0), (nb, tree_blocks)
        assert (mid1, mid0) == (min(nb, hi1), max(min(nb, hi0), lo0)), (nb, tree_blocks)


@pytest.mark.parametrize("block_k", [16, 64])
def test_block_steps_walk_each_splits_blocks_whole_then_partial_then_tree(block_k):
    """``block_steps`` (the kernels' loop bounds) against a plain walk over the blocks: the prefix's whole blocks,
    then its partial block where plen % BK > 0, then the tree blocks; split sp's steps 0..n_all-1 are blocks
    lo..lo+n_all-1 of that walk, and the splits together take every block once."""
    plens = np.array([0, 1, block_k - 1, block_k, block_k + 1, 2 * block_k, 3 * block_k - 5, 5 * block_k])
    for tree_blocks, NS, peer in [(1, 1, False), (2, 2, False), (1, 3, False), (3, 5, False), (1, 2, True),
                                  (2, 2, True)]:
        out = [[np.asarray(v) for v in P.block_steps(jnp.asarray(plens, jnp.int32), tree_blocks, jnp.int32(sp), NS,
                                                     block_k, peer)] for sp in range(NS)]
        for i, plen in enumerate(plens):
            nb, rem = divmod(int(plen), block_k)
            walk = ["whole"] * nb + ["partial"] * (rem > 0) + ["tree"] * tree_blocks
            taken = []
            for sp in range(NS):
                rem_s, nbp, lo, n_whole, n_cache, n_all = (int(v[i]) for v in out[sp])
                assert (rem_s, nbp) == (rem, nb + (rem > 0)), (plen, sp)
                assert 0 <= n_whole <= n_cache <= n_all, (plen, sp, n_whole, n_cache, n_all)
                kinds = ["whole"] * n_whole + ["partial"] * (n_cache - n_whole) + ["tree"] * (n_all - n_cache)
                assert kinds == walk[lo:lo + n_all], (plen, tree_blocks, NS, peer, sp)
                taken += range(lo, lo + n_all)
            assert sorted(taken) == list(range(len(walk))), (plen, tree_blocks, NS, peer)


def test_check_valid_rows_takes_fewer_rows_of_one_tile_only():
    """valid_rows: None or Np itself give Np; fewer (a multiple of 8 below 64) only where q_rows is one 64-row tile,
    not two tiles or a tile and a tail."""
    assert [P.check_valid_rows(v, rows) for v, rows in [(None, 128), (72, 72), (64, 64)]] == [128, 72, 64]
    assert [P.check_valid_rows(v, 64) for v in (8, 16, 56)] == [8, 16, 56]
    for v, rows in [(16, 128), (8, 72), (0, 64), (12, 64), (72, 64), (-8, 64)]:
        with pytest.raises(ValueError, match=f"valid_rows={v} must be Np={rows}"):
            P.check_valid_rows(v, rows)
