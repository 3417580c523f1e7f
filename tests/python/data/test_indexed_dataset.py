"""braid's indexed datasets against megatron-core's own IndexedDatasetBuilder / IndexedDataset.

Files megatron-core writes, braid reads token for token; files braid writes, megatron-core reads,
and they are byte-identical to what megatron-core writes for the same input. megatron-core is
imported as megatron.core.datasets.indexed_dataset (it needs only torch, numpy and packaging; the
import pulls in megatron.core's __init__, a few seconds, once per file).
"""

import os
import pickle
import struct
import sys
import warnings

import numpy as np
import pytest
import torch

from braid.data import IndexedDataset, IndexedDatasetWriter, smallest_token_type

# megatron-core's add_document passes torch tensors to numpy.array (its own deprecation).
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.datasets import indexed_dataset as mcore

# megatron-core's DType codes and the numpy types it writes with them.
DTYPES = {
    "u8": np.uint8,
    "i8": np.int8,
    "i16": np.int16,
    "i32": np.int32,
    "i64": np.int64,
    "f64": np.float64,
    "f32": np.float32,
    "u16": np.uint16,
}


def random_documents(rng, n_documents, max_sequences, max_length, low, high):
    """Documents as lists of int64 sequences; some documents and sequences are empty."""
    documents = []
    for _ in range(n_documents):
        n = int(rng.integers(0, max_sequences + 1))
        documents.append(
            [rng.integers(low, high, size=int(rng.integers(0, max_length + 1))) for _ in range(n)]
        )
    return documents


def token_range(name):
    if name in ("f32", "f64"):
        return 0, 1 << 20
    info = np.iinfo(DTYPES[name])
    return max(int(info.min), -(1 << 31)), min(int(info.max), (1 << 31) - 1) + 1


def write_megatron(prefix, name, documents, by_document=False):
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=DTYPES[name])
    for document in documents:
        if by_document:
            flat = np.concatenate(document) if document else np.zeros(0, np.int64)
            builder.add_document(torch.from_numpy(flat), [len(s) for s in document])
        else:
            for sequence in document:
                builder.add_item(torch.from_numpy(sequence))
            builder.end_document()
    builder.finalize(prefix + ".idx")


def write_braid(prefix, name, documents):
    with IndexedDatasetWriter(prefix, name) as writer:
        for document in documents:
            for sequence in document:
                writer.add_sequence(sequence)
            writer.end_document()


def read_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def assert_same_dataset(ours, theirs):
    """A braid dataset and a megatron-core dataset of the same files agree on everything."""
    assert len(ours) == len(theirs)
    np.testing.assert_array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    np.testing.assert_array_equal(ours.sequence_pointers, theirs.index.sequence_pointers)
    np.testing.assert_array_equal(ours.document_indices, theirs.document_indices)
    assert ours.num_documents == len(theirs.document_indices) - 1
    assert ours.dtype == theirs.index.dtype
    for i in range(len(ours)):
        expected = theirs[i]
        assert ours[i].dtype == expected.dtype
        np.testing.assert_array_equal(ours[i], expected)
        np.testing.assert_array_equal(ours.read(i), expected.astype(np.int64))


@pytest.mark.parametrize("name", list(DTYPES))
def test_both_directions_every_token_type(tmp_path, name):
    rng = np.random.default_rng(list(DTYPES).index(name))
    documents = random_documents(rng, 60, 4, 50, *token_range(name))
    theirs_prefix, ours_prefix = str(tmp_path / "mcore"), str(tmp_path / "braid")
    write_megatron(theirs_prefix, name, documents)
    write_braid(ours_prefix, name, documents)
    # The same bytes for the same input.
    assert read_bytes(ours_prefix + ".bin") == read_bytes(theirs_prefix + ".bin")
    assert read_bytes(ours_prefix + ".idx") == read_bytes(theirs_prefix + ".idx")
    # braid reads megatron-core's files; megatron-core reads braid's.
    ours = IndexedDataset(theirs_prefix)
    assert ours.token_type == name
    assert_same_dataset(ours, mcore.IndexedDataset(theirs_prefix))
    assert_same_dataset(IndexedDataset(ours_prefix), mcore.IndexedDataset(ours_prefix))


def test_add_document_and_merged_datasets(tmp_path):
    """megatron-core's add_document (sentence lengths) and add_index (merging shards)."""
    rng = np.random.default_rng(7)
    shards = []
    for k in range(3):
        prefix = str(tmp_path / f"shard{k}")
        write_megatron(prefix, "u16", random_documents(rng, 40, 3, 30, 0, 65535), by_document=True)
        shards.append(prefix)
    merged = str(tmp_path / "merged")
    builder = mcore.IndexedDatasetBuilder(merged + ".bin", dtype=np.uint16)
    for prefix in shards:
        builder.add_index(prefix)
    builder.finalize(merged + ".idx")
    ours = IndexedDataset(merged)
    assert_same_dataset(ours, mcore.IndexedDataset(merged))
    assert ours.num_sequences == sum(IndexedDataset(p).num_sequences for p in shards)


def test_partial_reads_match_megatron_get(tmp_path):
    prefix = str(tmp_path / "ds")
    rng = np.random.default_rng(3)
    write_megatron(prefix, "i32", random_documents(rng, 20, 2, 40, -(1 << 31), (1 << 31) - 1))
    ours, theirs = IndexedDataset(prefix), mcore.IndexedDataset(prefix)
    for i in range(len(ours)):
        n = int(ours.sequence_lengths[i])
        for offset in {0, n // 3, n}:
            for length in {0, (n - offset) // 2, n - offset}:
                np.testing.assert_array_equal(
                    ours.read(i, offset, length), theirs.get(i, offset=offset, length=length)
                )
        np.testing.assert_array_equal(ours.read(i, n // 2), theirs.get(i, offset=n // 2))


def test_multimodal_files_are_read_with_their_modes(tmp_path):
    prefix = str(tmp_path / "mm")
    builder = mcore.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32, multimodal=True)
    modes = [0, 1, 1, 0, 2]
    for k, mode in enumerate(modes):
        builder.add_item(torch.arange(k + 1), mode=mode)
        if k % 2:
            builder.end_document()
    builder.end_document()
    builder.finalize(prefix + ".idx")
    ours, theirs = IndexedDataset(prefix), mcore.IndexedDataset(prefix, multimodal=True)
    assert ours.multimodal
    np.testing.assert_array_equal(ours.sequence_modes, modes)
    np.testing.assert_array_equal(ours.sequence_modes, theirs.index.sequence_modes)
    for i in range(len(ours)):
        np.testing.assert_array_equal(ours[i], theirs[i][0])


def test_empty_dataset(tmp_path):
    theirs_prefix, ours_prefix = str(tmp_path / "mcore"), str(tmp_path / "braid")
    write_megatron(theirs_prefix, "u16", [])
    write_braid(ours_prefix, "u16", [])
    assert read_bytes(ours_prefix + ".idx") == read_bytes(theirs_prefix + ".idx")
    ds = IndexedDataset(theirs_prefix)
    assert (len(ds), ds.num_documents, ds.num_tokens) == (0, 0, 0)
    assert ds.sequence_lengths.shape == (0,)


def test_views_are_zero_copy_read_only_and_keep_the_dataset_alive(tmp_path):
    prefix = str(tmp_path / "ds")
    write_braid(prefix, "u16", [[np.arange(5)], [np.arange(3), np.arange(2)]])
    ds = IndexedDataset(prefix)
    lengths, tokens = ds.sequence_lengths, ds[1]
    for view in (lengths, ds.sequence_pointers, ds.document_indices, tokens):
        assert not view.flags.writeable and not view.flags.owndata
        with pytest.raises(ValueError):
            view[0] = 1
    # The same memory each time (the mapping), and it outlives the Python name of the dataset.
    address = lengths.__array_interface__["data"][0]
    assert address == ds.sequence_lengths.__array_interface__["data"][0]
    del ds
    np.testing.assert_array_equal(lengths, [5, 3, 2])
    np.testing.assert_array_equal(tokens, [0, 1, 2])
    # The .idx arrays sit at odd offsets (34 + ...): numpy knows they are unaligned.
    assert not lengths.flags.aligned


def test_python_api(tmp_path):
    prefix = str(tmp_path / "ds")
    with IndexedDatasetWriter(prefix, np.dtype("int16")) as w:
        assert w.token_type == "i16"
        w.add_document(np.array([1, -2, 3], dtype=np.int8))
        w.add_document(np.array([70, 71], dtype=np.uint64))
        w.add_sequence([5])  # left open: closed on exit
        assert (w.num_sequences, w.num_documents, w.num_tokens) == (3, 2, 6)
    ds = IndexedDataset(prefix)
    assert repr(ds) == f"IndexedDataset('{prefix}', i16, 3 sequences, 3 documents, 6 tokens)"
    assert [list(s) for s in ds] == [[1, -2, 3], [70, 71], [5]]
    assert list(ds[-1]) == [5] and ds.read(0).dtype == np.int32
    assert pickle.loads(pickle.dumps(ds)).num_tokens == 6
    with pytest.raises(IndexError):
        ds[3]
    with pytest.raises(ValueError, match="out of range"):
        ds.read(0, 2, 5)
    with pytest.raises(ValueError, match="tokens must be integers"):
        IndexedDatasetWriter(str(tmp_path / "x"), "u8").add_sequence([1.5])
    with pytest.raises(ValueError, match="unknown token type 'bf16'"):
        IndexedDatasetWriter(str(tmp_path / "x"), "bf16")
    assert smallest_token_type(50257) == "u16" and smallest_token_type(128256) == "i32"


def test_add_documents_in_one_call(tmp_path):
    documents = [[np.arange(3), np.arange(2)], [], [np.arange(4)]]
    one_by_one, batched = str(tmp_path / "one"), str(tmp_path / "batch")
    write_braid(one_by_one, "u16", documents)
    with IndexedDatasetWriter(batched, "u16") as w:
        w.add_documents(np.concatenate([np.arange(3), np.arange(2)]), [3, 2], [2, 0])
        w.add_documents(np.arange(4, dtype=np.int64), [4])  # one sequence per document
        with pytest.raises(ValueError, match="add up to 3, but there are 4 tokens"):
            w.add_documents(np.arange(4), [3])
        with pytest.raises(ValueError, match="documents hold 2 sequences, but there are 1"):
            w.add_documents(np.arange(4), [4], [2])
        with pytest.raises(ValueError, match="token 70000 .* u16"):
            w.add_documents([1, 70000], [2])
        with pytest.raises(ValueError, match="do not fit int32"):
            w.add_documents([1 << 40], [1])
        assert w.num_sequences == 3  # the bad batches added nothing
    for ext in (".bin", ".idx"):
        assert read_bytes(one_by_one + ext) == read_bytes(batched + ext)


def test_a_failed_write_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "ds")
    with pytest.raises(ValueError, match="token 256 .* does not fit the dataset's token type u8"):
        with IndexedDatasetWriter(prefix, "u8") as w:
            w.add_document([1, 2])
            w.add_document([256])
    assert os.listdir(tmp_path) == []


def test_corrupt_files_are_value_errors_naming_the_file(tmp_path):
    prefix = str(tmp_path / "ds")
    write_braid(prefix, "i32", [[np.arange(4)], [np.arange(2)]])
    idx = bytearray(read_bytes(prefix + ".idx"))
    bad = bytearray(idx)
    struct.pack_into("<i", bad, 34 + 4, -1)  # the second sequence length
    with open(prefix + ".idx", "wb") as f:
        f.write(bad)
    with pytest.raises(ValueError, match=r"ds\.idx: sequence_lengths\[1\] = -1 is negative"):
        IndexedDataset(prefix)
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(ValueError, match=r"past the end of .*ds\.bin \(20 bytes\)"):
        IndexedDataset(prefix)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
