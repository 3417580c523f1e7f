"""--mock-data is megatron-core's mock data: braid.data.build_mock_gpt_datasets over
braid.data.mock_lengths() gives megatron-core's MockGPTDataset splits (BlendedMegatronDatasetBuilder
without a blend: split 1,1,1) - the same sizes, and the same tokens and labels at every sampled
index of every split - for several sequence lengths, seeds and sample counts (one epoch, and more
than one). pretrain_gpt.py's run on it: test_pretrain_gpt_megatron.py."""

import numpy as np
import pytest
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset

from braid.data import build_mock_gpt_datasets, mock_lengths


class Tokenizer:
    """What megatron-core's mock dataset reads from a tokenizer: NullTokenizer --vocab-size 300."""

    eod = 300
    pad = -1
    vocab_size = 301
    unique_identifiers = {"class": "NullTokenizer"}


def megatrons(sizes, seq_length, seed):
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, tokenizer=Tokenizer(),
                              reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False)
    assert config.mock and config.split == "1,1,1"  # what megatron-core does without a blend
    return BlendedMegatronDatasetBuilder(MockGPTDataset, sizes, lambda: True, config).build()


@pytest.mark.parametrize("sizes, seq_length, seed", [
    ([320, 64, 16], 32, 1234),
    ([5000, 100, 0], 4096, 7),       # no test samples asked: no test split (braid)
    ([4_000_000, 10, 10], 256, 3),   # the train split needs a second epoch
])
def test_mock_splits_are_megatrons(sizes, seq_length, seed):
    theirs = megatrons(sizes, seq_length, seed)
    ours = build_mock_gpt_datasets(mock_lengths(), seq_length, sizes, vocab_size=301, eod=300,
                                   split="1,1,1", seed=seed)
    rng = np.random.default_rng(seed)
    for name, n, t, o in zip(("train", "valid", "test"), sizes, theirs, ours):
        if n == 0:  # megatron-core builds an epoch nobody reads; braid builds nothing
            assert o is None, name
            continue
        assert len(o) == len(t), name
        for i in [0, 1, len(o) - 1, *rng.integers(0, len(o), 100)]:
            sample = o[int(i)]
            want = t[int(i)]
            assert np.array_equal(want["tokens"].numpy(), sample[:-1]), (name, i)
            assert np.array_equal(want["labels"].numpy(), sample[1:]), (name, i)
    # The documents end with the end-of-document token: the train split's samples hold some.
    assert any((ours[0][i] == 300).any() for i in range(50))


def test_mock_lengths_are_megatrons():
    from megatron.core.datasets.gpt_dataset import MockGPTLowLevelDataset
    want = MockGPTLowLevelDataset(Tokenizer()).sequence_lengths
    assert np.array_equal(mock_lengths(), want)


def test_bad_mock_inputs_are_refused():
    with pytest.raises(ValueError, match="the end-of-document token 301 must be in the "
                                         r"vocabulary \[0, 301\)"):
        build_mock_gpt_datasets(mock_lengths(), 32, [8, 0, 0], vocab_size=301, eod=301)
    with pytest.raises(ValueError, match="mock data: 10 document lengths, expected 100000"):
        build_mock_gpt_datasets(np.ones(10, np.int32), 32, [8, 0, 0], vocab_size=301, eod=300)
