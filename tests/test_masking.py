"""Block masks (clients/masking.py), their seeds (clients/seeds.py) and the client's choice of mask."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from clients.masking import apply_mask, block_mask, coordinate_mask, coordinate_mask_seeds, mask_scales
from clients.seeds import (
    batch_order_seed,
    derive_seed,
    independent_mask_seed,
    synchronized_mask_seed,
)
from fedmask_app.run.config import load_run_config


@pytest.fixture(scope="module")
def base_cfg(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    return load_run_config([f"data-dir='{data_dir}'"])


def _client_mask(cfg, server_round, partition_id, sync_seed, num_blocks):
    from fedmask_app.run.client_task import client_mask  # imports torch and the model; only these tests need it

    return client_mask(cfg, server_round, partition_id, sync_seed, num_blocks)


def test_block_mask_is_bool_of_block_count_and_deterministic():
    keep = block_mask(123, 62, 0.5)
    assert keep.dtype == np.bool_
    assert keep.shape == (62,)
    np.testing.assert_array_equal(keep, block_mask(123, 62, 0.5))
    assert not np.array_equal(keep, block_mask(124, 62, 0.5))


def test_keep_frequency_is_p():
    p, blocks, draws = 0.3, 8, 5000
    keeps = np.stack([block_mask(seed, blocks, p) for seed in range(draws)])
    se = np.sqrt(p * (1 - p) / (draws * blocks))
    assert abs(keeps.mean() - p) < 5 * se
    # Independent across blocks: the correlation between two blocks is ~0.
    corr = np.corrcoef(keeps[:, 0], keeps[:, 1])[0, 1]
    assert abs(corr) < 5 / np.sqrt(draws)


def test_masked_update_is_unbiased_in_the_mean():
    p, draws = 0.3, 20_000
    rng = np.random.default_rng(0)
    update = [rng.normal(size=(2, 3)), rng.normal(size=4), rng.normal(size=1), rng.normal(size=(3, 1))]
    total = [np.zeros_like(b) for b in update]
    kept = np.zeros(len(update))
    for seed in range(draws):
        keep = block_mask(derive_seed(99, seed), len(update), p)
        kept += keep
        for acc, block in zip(total, apply_mask(update, keep.tolist(), p), strict=True):
            acc += block
    # Each block's mean scale m/p has standard deviation sqrt((1 − p)/p) per draw.
    se = np.sqrt((1 - p) / p / draws)
    for acc, block in zip(total, update, strict=True):
        mean_scale = acc / draws / block  # the same factor for every entry of a block
        np.testing.assert_allclose(mean_scale, mean_scale.flat[0], rtol=1e-9)
        assert abs(mean_scale.flat[0] - 1.0) < 5 * se
    # Without the 1/p factor the mean would be p · Δ: the test above tells the two apart.
    assert 5 * se < 1 - p


def test_apply_mask_scales_kept_blocks_by_one_over_p_and_zeroes_the_rest():
    update = [np.array([1.0, -2.0]), np.array([[3.0]]), np.array([4.0, 5.0, 6.0])]
    out = apply_mask(update, [True, False, True], 0.25)
    np.testing.assert_array_equal(out[0], [4.0, -8.0])
    np.testing.assert_array_equal(out[1], [[0.0]])
    np.testing.assert_array_equal(out[2], [16.0, 20.0, 24.0])
    # The input is not changed in place.
    np.testing.assert_array_equal(update[0], [1.0, -2.0])


def test_apply_mask_keeps_float32():
    update = [np.ones(3, dtype=np.float32)]
    assert apply_mask(update, [True], 0.5)[0].dtype == np.float32


def test_apply_mask_works_on_torch_tensors():
    torch = pytest.importorskip("torch")
    update = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]
    out = apply_mask(update, [False, True], 0.5)
    assert torch.equal(out[0], torch.tensor([0.0, 0.0]))
    assert torch.equal(out[1], torch.tensor([6.0]))


def test_mask_scales_are_one_over_p_and_zero():
    assert mask_scales([True, False, True, False], 0.4) == [1 / 0.4, 0.0, 1 / 0.4, 0.0]
    assert mask_scales([], 0.5) == []
    assert all(type(s) is float for s in mask_scales(np.array([True, False]), 0.5))


def test_p_one_keeps_every_block_and_leaves_the_update_bit_identical():
    rng = np.random.default_rng(1)
    update = [rng.normal(size=(3, 3)).astype(np.float32), rng.normal(size=5)]
    for seed in range(50):
        keep = block_mask(seed, len(update), 1.0)
        assert keep.all()
        out = apply_mask(update, keep.tolist(), 1.0)
        for a, b in zip(out, update, strict=True):
            assert a.dtype == b.dtype
            assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("p", [0.0, -0.1, 1.0001, 2.0, float("nan")])
def test_keep_prob_outside_unit_interval_raises(p):
    with pytest.raises(ValueError, match="keep_prob"):
        block_mask(0, 4, p)


def test_apply_mask_rejects_wrong_block_count():
    with pytest.raises(ValueError, match="blocks"):
        apply_mask([np.ones(2), np.ones(2)], [True], 0.5)


def test_derive_seed_depends_on_every_part_and_rejects_negatives():
    seeds = {derive_seed(0, 3, r, pid) for r in range(5) for pid in range(20)}
    assert len(seeds) == 100
    assert derive_seed(1, 2) != derive_seed(2, 1)
    assert derive_seed(1, 2) != derive_seed(1, 2, 1)
    # (SeedSequence ignores trailing zero words: derive_seed(1, 2) == derive_seed(1, 2, 0). No two
    # streams of one run differ only by a trailing 0, see test_seed_streams_are_distinct_by_purpose.)
    assert derive_seed(5, 6, 7) == derive_seed(5, 6, 7)
    assert 0 <= derive_seed(2**40, 1) < 2**63
    with pytest.raises(ValueError):
        derive_seed(0, -1)


def test_seed_streams_are_distinct_by_purpose():
    run_seed, rounds, pids = 0, range(1, 6), range(12)
    streams = [derive_seed(run_seed, 0)]  # model init
    streams += [derive_seed(run_seed, 1, r) for r in rounds]  # cohort
    streams += [batch_order_seed(run_seed, r, pid) for r in rounds for pid in pids]
    streams += [independent_mask_seed(run_seed, r, pid) for r in rounds for pid in pids]
    streams += [synchronized_mask_seed(run_seed, r) for r in rounds]
    assert len(set(streams)) == len(streams)
    assert independent_mask_seed(0, 1, 0) != batch_order_seed(0, 1, 0)
    assert synchronized_mask_seed(0, 1) != batch_order_seed(0, 1, None)
    assert synchronized_mask_seed(0, 1) != synchronized_mask_seed(0, 2)
    assert synchronized_mask_seed(0, 1) != synchronized_mask_seed(1, 1)


def test_synchronized_mode_gives_every_client_the_same_mask(base_cfg):
    cfg = dataclasses.replace(base_cfg, mask_mode="synchronized", keep_prob=0.5)
    num_blocks = 62
    for server_round in (1, 2, 3):
        seed = synchronized_mask_seed(cfg.seed, server_round)
        masks = [_client_mask(cfg, server_round, pid, seed, num_blocks) for pid in range(10)]
        assert all(m == masks[0] for m in masks)
        assert masks[0] == block_mask(seed, num_blocks, 0.5).tolist()
    seeds = [synchronized_mask_seed(cfg.seed, r) for r in (1, 2)]
    assert _client_mask(cfg, 1, 0, seeds[0], num_blocks) != _client_mask(cfg, 2, 0, seeds[1], num_blocks)


def test_synchronized_mode_needs_the_server_seed(base_cfg):
    cfg = dataclasses.replace(base_cfg, mask_mode="synchronized")
    with pytest.raises(ValueError, match="seed"):
        _client_mask(cfg, 1, 0, None, 10)


def test_independent_mode_gives_clients_different_masks(base_cfg):
    cfg = dataclasses.replace(base_cfg, mask_mode="independent", keep_prob=0.5)
    num_blocks = 200  # identical masks by chance: 2^-200
    pids = range(20)
    seeds = [independent_mask_seed(cfg.seed, 1, pid) for pid in pids]
    assert len(set(seeds)) == len(seeds)
    # A broadcast synchronized seed is ignored in independent mode.
    masks = [tuple(_client_mask(cfg, 1, pid, 12345, num_blocks)) for pid in pids]
    assert len(set(masks)) == len(masks)
    assert list(masks[3]) == block_mask(seeds[3], num_blocks, 0.5).tolist()
    # Reproducible: the same client in the same round draws the same mask again.
    assert list(masks[3]) == _client_mask(cfg, 1, 3, None, num_blocks)
    # And a new one the next round.
    assert list(masks[3]) != _client_mask(cfg, 2, 3, None, num_blocks)


def test_no_mask_when_masking_is_off(base_cfg):
    cfg = dataclasses.replace(base_cfg, mask_mode="none")
    assert _client_mask(cfg, 1, 0, 7, 10) is None


def test_every_purpose_has_a_stream_of_its_own():
    """No purpose tag is 0 (SeedSequence drops trailing zeros: (seed, 0) is the bare run seed's
    stream, which the partition draws from) and no two purposes share a tag."""
    from clients.seeds import INIT, PURPOSES

    assert 0 not in PURPOSES and len(set(PURPOSES)) == len(PURPOSES) and INIT in PURPOSES
    for seed in (0, 7):
        partition_stream = np.random.SeedSequence(seed).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1)
        assert all(derive_seed(seed, tag) != int(partition_stream) for tag in PURPOSES)


def test_coordinate_mask_is_deterministic_per_seed_and_tensor():
    a = coordinate_mask(5, 0, 1000, 0.5)
    assert a.dtype == bool and a.shape == (1000,)
    np.testing.assert_array_equal(a, coordinate_mask(5, 0, 1000, 0.5))
    assert not np.array_equal(a, coordinate_mask(5, 1, 1000, 0.5))  # another tensor
    assert not np.array_equal(a, coordinate_mask(6, 0, 1000, 0.5))  # another seed
    # a tensor's mask does not depend on how big the others are: only on (seed, tensor index)
    np.testing.assert_array_equal(coordinate_mask(5, 1, 10, 0.5), coordinate_mask(5, 1, 1000, 0.5)[:10])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_coordinate_keep_frequency_is_p(p):
    kept = coordinate_mask(1, 3, 200_000, p)
    assert abs(kept.mean() - p) < 5 * np.sqrt(p * (1 - p) / kept.size)


def test_coordinate_mask_streams_differ_from_the_block_mask_of_the_same_seed():
    """Child streams (spawn keys) of the mask seed, not the seed's own stream."""
    u_block = np.random.default_rng(5).random(64, dtype=np.float32)
    assert not np.array_equal(coordinate_mask(5, 0, 64, 0.5), u_block < 0.5)


def test_coordinate_mask_keeps_everything_at_p_one_and_rejects_bad_p():
    assert coordinate_mask(2, 0, 5000, 1.0).all()
    with pytest.raises(ValueError, match="keep_prob"):
        coordinate_mask(2, 0, 10, 0.0)


def test_coordinate_mask_seeds_follow_the_mode():
    assert coordinate_mask_seeds("none", "coordinate", 0, 3, [1, 2]) is None
    assert coordinate_mask_seeds("independent", "tensor", 0, 3, [1, 2]) is None  # bits travel with replies
    sync = synchronized_mask_seed(0, 3)
    assert coordinate_mask_seeds("synchronized", "coordinate", 0, 3, [1, 2]) == {1: sync, 2: sync}
    indep = coordinate_mask_seeds("independent", "coordinate", 0, 3, [1, 2])
    assert indep == {pid: independent_mask_seed(0, 3, pid) for pid in (1, 2)}
    assert len(set(indep.values())) == 2
    with pytest.raises(ValueError, match="granularity"):
        coordinate_mask_seeds("independent", "row", 0, 3, [1])
