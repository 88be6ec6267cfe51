"""The global-batch sampler: seeded, per-epoch permutation, every sample once per epoch."""

import pytest

from osft.trainer.data.sampler import GlobalBatchSampler


def test_each_epoch_is_a_permutation_cut_into_batches():
    sampler = GlobalBatchSampler(num_samples=10, batch_size=4, seed=7)
    assert sampler.steps_per_epoch == 3
    for epoch in range(3):
        batches = [sampler.batch(epoch, i) for i in range(3)]
        assert [len(b) for b in batches] == [4, 4, 2]
        assert sorted(i for b in batches for i in b) == list(range(10))
    assert sampler.batch(0, 0) != sampler.batch(1, 0)
    assert GlobalBatchSampler(10, 4, seed=7).batch(2, 1) == sampler.batch(2, 1)
    assert GlobalBatchSampler(10, 4, seed=8).batch(0, 0) != sampler.batch(0, 0)


def test_rejects_empty_data():
    with pytest.raises(ValueError, match="no usable training samples"):
        GlobalBatchSampler(0, 4, seed=0)
