"""GPT samples against megatron-core's own GPTDataset, BlendedDataset and blending helpers.

The same files, split, seed and sizes give braid and megatron-core the same document, sample
and shuffle indices, the same blending order, and the same tokens and labels for every sample.
Also: the cache files are numpy's .npy, and the Python DataLoader feeds braid.Trainer.
"""

import warnings

import numpy as np
import pytest

import braid
from braid.data import (
    DataLoader,
    GPTDataset,
    IndexedDatasetWriter,
    build_blending_indices,
    build_gpt_datasets,
    parse_data_path,
    split_documents,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.datasets import helpers as mcore_helpers
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset as McoreGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig


def write_corpus(prefix, n_documents, max_length, seed, offset=0):
    """Documents of random lengths; token = offset + 7 * document + position (mod 60000)."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(str(prefix), "u16") as w:
        for d in range(n_documents):
            n = int(rng.integers(1, max_length + 1))
            w.add_document((offset + 7 * d + np.arange(n)) % 60000)
    return str(prefix)


class Tokenizer:
    """What megatron-core's GPTDatasetConfig reads from a tokenizer."""

    eod = 0
    pad = -1
    vocab_size = 60000
    unique_identifiers = {"class": "Tokenizer"}


def mcore_datasets(blend, split, sizes, seq_length, seed, cache):
    config = GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, split=split,
        tokenizer=Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, path_to_cache=cache)
    return BlendedMegatronDatasetBuilder(McoreGPTDataset, sizes, lambda: True, config).build()


def same_samples(theirs, ours, indices):
    for i in indices:
        sample = ours[i]
        assert np.array_equal(theirs[i]["tokens"].numpy(), sample[:-1]), i
        assert np.array_equal(theirs[i]["labels"].numpy(), sample[1:]), i


def test_splits_match_megatron(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", 1000, 80, seed=1)
    sizes = [1500, 60, 10]  # train needs two epochs (the last on its own), test five
    theirs = mcore_datasets(([prefix], None), "969,30,1", sizes, 32, 1234, str(tmp_path / "mc"))
    ours = build_gpt_datasets([prefix], 32, sizes, split="969,30,1", seed=1234,
                              cache_path=str(tmp_path / "braid"))
    for t, o in zip(theirs, ours):
        assert isinstance(o, GPTDataset)
        assert len(o) == len(t)
        assert np.array_equal(np.asarray(o.document_index), t.document_index)
        assert np.array_equal(np.asarray(o.sample_index), t.sample_index)
        assert np.array_equal(np.asarray(o.shuffle_index), t.shuffle_index)
        same_samples(t, o, [0, 1, len(o) // 2, len(o) - 1])
    assert split_documents("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]


def test_weighted_blend_matches_megatron(tmp_path):
    a = write_corpus(tmp_path / "a", 400, 60, seed=2)
    b = write_corpus(tmp_path / "b", 700, 60, seed=3, offset=30000)
    words = ["0.3", a, "0.7", b]
    assert parse_data_path(words) == ([a, b], [0.3, 0.7])
    assert parse_data_path([a, b, a]) == ([a, b, a], None)  # Megatron's: prefixes alone
    for broken in (["0.3", a, "0.7"], ["0.3", a, b, "0.7"]):  # a weight without its pair
        with pytest.raises(ValueError, match="starting with the weight 0.3: give WEIGHT PREFIX "
                           "pairs, or prefixes alone"):
            parse_data_path(broken)
    sizes = [3000, 100, 0]
    # megatron-core's BlendedDataset caches only under torch.distributed; its members cache
    # under each prefix.
    theirs = mcore_datasets(([a, b], [0.3, 0.7]), "90,10,0", sizes, 16, 5, None)
    ours = build_gpt_datasets(" ".join(words), 16, sizes, split="90,10,0", seed=5,
                              cache_path=str(tmp_path / "braid"))
    assert ours[2] is None
    for t, o in zip(theirs[:2], ours[:2]):
        assert len(o) == len(t)
        assert np.array_equal(np.asarray(o.dataset_index), t.dataset_index)
        assert np.array_equal(np.asarray(o.dataset_sample_index), t.dataset_sample_index)
        for tm, om in zip(t.datasets, o.datasets):
            assert len(om) == len(tm)
            assert np.array_equal(np.asarray(om.shuffle_index), tm.shuffle_index)
        same_samples(t, o, [0, 5, len(o) - 1])
    # The blend draws in proportion: within one sample per 1000 of 30% / 70%.
    counts = np.bincount(np.asarray(ours[0].dataset_index), minlength=2)
    assert abs(counts[0] - 0.3 * len(ours[0])) <= len(ours[0]) / 1000


def test_size_weighted_blend_matches_megatron(tmp_path):
    a = write_corpus(tmp_path / "a", 300, 40, seed=4)
    b = write_corpus(tmp_path / "b", 500, 40, seed=5, offset=20000)
    sizes = [1000, 50, None]
    theirs = mcore_datasets(([a, b], None), "95,5", sizes, 8, 9, None)
    ours = build_gpt_datasets([a, b], 8, sizes, split="95,5", seed=9,
                              cache_path=str(tmp_path / "braid"))
    for t, o in zip(theirs[:2], ours[:2]):
        assert len(o) == len(t)
        assert np.array_equal(np.asarray(o.dataset_index), t.dataset_index)
        assert np.array_equal(np.asarray(o.dataset_sample_index), t.dataset_sample_index)
        same_samples(t, o, [0, len(o) - 1])


def test_blending_indices_match_megatron_helpers():
    for weights in ([0.3, 0.7], [0.2, 0.5, 0.3], [1 / 3] * 3, [0.001, 0.009, 0.99]):
        size = 20000
        theirs_d = np.zeros(size, dtype=np.int16)
        theirs_s = np.zeros(size, dtype=np.int64)
        mcore_helpers.build_blending_indices(theirs_d, theirs_s, np.array(weights), len(weights),
                                             size, False)
        d, s = build_blending_indices(weights, size)
        assert np.array_equal(d, theirs_d)
        assert np.array_equal(s, theirs_s)


def test_cache_files_are_npy_and_reload(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", 200, 50, seed=6)
    first = GPTDataset(prefix, 16, num_samples=500, seed=3)
    assert not first.loaded_from_cache
    base = first.cache_path_prefix
    assert base.startswith(prefix + "/cache/GPTDataset_indices/")
    for name in ("document_index", "sample_index", "shuffle_index"):
        on_disk = np.load(f"{base}-{name}.npy", mmap_mode="r")
        assert np.array_equal(on_disk, np.asarray(getattr(first, name)))
    with open(f"{base}-description.txt") as f:
        description = f.read()
    assert "seq_length: 16" in description and "seed: 3" in description
    second = GPTDataset(prefix, 16, num_samples=500, seed=3)
    assert second.loaded_from_cache
    assert np.array_equal(second[7], first[7])
    with pytest.raises(ValueError, match="no documents"):
        GPTDataset(prefix, 16, documents=(5, 5))


def test_loader_feeds_the_trainer_and_resumes(tmp_path):
    prefix = write_corpus(tmp_path / "corpus", 300, 40, seed=7)
    (train, _, _) = build_gpt_datasets(prefix, 16, [64 * 8, None, None], split="98,2,0", seed=1)
    loader = DataLoader(train, micro_batch_size=4, global_batch_size=8, prefetch=3)
    assert loader.num_microbatches == 2
    seen = []
    for step, batch in enumerate(loader):
        tokens, labels = np.asarray(batch.tokens), np.asarray(batch.labels)
        assert tokens.shape == labels.shape == (8, 16) and tokens.dtype == np.int32
        assert np.array_equal(tokens[:, 1:], labels[:, :-1])
        rows = [train[step * 8 + r] for r in range(8)]
        assert np.array_equal(tokens, np.stack([r[:-1] for r in rows]))
        assert batch.consumed_samples == loader.consumed_samples == (step + 1) * 8
        mb_tokens, mb_labels = batch.microbatch(1)
        assert np.array_equal(np.asarray(mb_tokens), tokens[4:])
        seen.append(labels.copy())
    assert len(seen) == len(train) // 8 and loader.steps_left == 0
    assert loader.next() is None

    resumed = DataLoader(train, 4, 8, consumed_samples=5 * 8)
    for step in range(5, 9):
        assert np.array_equal(np.asarray(resumed.next().labels), seen[step])

    # Two DP ranks split each global batch: in each group of micro_batch_size x 2 samples rank 0
    # takes the first micro_batch_size, rank 1 the rest (Megatron's pretraining sampler).
    r0, r1 = (DataLoader(train, 2, 8, dp_rank=r, dp_size=2) for r in (0, 1))
    b0, b1 = r0.next(), r1.next()
    first_batch = [train[i][:-1] for i in range(8)]
    assert np.array_equal(np.asarray(b0.tokens), np.stack([first_batch[i] for i in (0, 1, 4, 5)]))
    assert np.array_equal(np.asarray(b1.tokens), np.stack([first_batch[i] for i in (2, 3, 6, 7)]))

    middle = DataLoader(train, 4, 8, needs_tokens=False, needs_labels=False)
    assert middle.next().tokens is None

    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        DataLoader(train, 3, 8)

    cfg = braid.TransformerConfig.preset("gpt2-tiny")
    cfg.vocab_size = 60000 // 8 * 8 + 8
    cfg.max_position_embeddings = 16
    cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads = 1, 32, 2
    cfg.num_query_groups, cfg.ffn_hidden_size = 2, 64
    model = braid.GPTModel(cfg, seed=1)
    trainer = braid.Trainer(model, braid.AdamWConfig(lr=1e-3),
                            braid.LRSchedule(lr=1e-3, decay_iters=10))
    batch = DataLoader(train, 4, 8).next()
    stats = trainer.train_step(batch.tokens, batch.labels, batch.num_microbatches)
    assert np.isfinite(stats.loss)
