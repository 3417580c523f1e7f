"""Megatron indexed datasets (``prefix.bin`` / ``prefix.idx``) from Python.

``IndexedDataset(prefix)`` maps both files read-only and validates the index (a ValueError names
the file and the field when something is wrong). Its arrays -- ``sequence_lengths``,
``sequence_pointers``, ``document_indices`` -- are read-only numpy views into the mapped
``.idx`` (no copy; they keep the dataset alive), ``ds[i]`` is sequence ``i``'s tokens as stored,
also a view, and ``ds.read(i, offset, length)`` copies tokens out as int32.

``IndexedDatasetWriter(prefix, token_type)`` writes the same bytes as megatron-core's
``IndexedDatasetBuilder``; as a context manager it finalizes on success and leaves nothing behind
if the block raises::

    with IndexedDatasetWriter("data/train_text_document", smallest_token_type(vocab)) as w:
        for ids in documents:
            w.add_document(ids)

The format, byte by byte: docs/formats.md.

GPT samples, in Megatron's order for a given seed (docs/data.md)::

    train, valid, test = build_gpt_datasets("0.3 A 0.7 B", seq_length=1024,
                                            num_samples=(iters * gbs, eval_samples, test_samples),
                                            split="969,30,1", seed=1234)
    loader = DataLoader(train, micro_batch_size=4, global_batch_size=64, dp_rank=r, dp_size=dp,
                        consumed_samples=consumed_from_checkpoint)
    for batch in loader:                      # loaded ahead on a background thread
        trainer.train_step(batch.tokens, batch.labels, batch.num_microbatches)
        consumed = loader.consumed_samples    # what a checkpoint stores

``GPTDataset(prefix, seq_length, ...)`` is one split of one dataset; ``BlendedDataset`` draws from
several by weight. Both cache their indices as .npy files (``cache_path``; default
``<prefix>/cache/GPTDataset_indices``), so a second start maps them instead of rebuilding.
"""

from braid._C import (  # noqa: F401
    Batch,
    BatchLayout,
    BlendedDataset,
    DataLoader,
    GPTDataset,
    IndexedDataset,
    IndexedDatasetWriter,
    SampleDataset,
    build_blending_indices,
    build_gpt_datasets,
    build_mock_gpt_datasets,
    parse_data_path,
    parse_split,
    smallest_token_type,
    split_documents,
)

__all__ = [
    "Batch",
    "BlendedDataset",
    "DataLoader",
    "GPTDataset",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "SampleDataset",
    "build_blending_indices",
    "build_gpt_datasets",
    "build_mock_gpt_datasets",
    "mock_lengths",
    "parse_data_path",
    "parse_split",
    "smallest_token_type",
    "split_documents",
]


def mock_lengths():
    """The document lengths of megatron-core's MockGPTLowLevelDataset (--mock-data): 100000
    documents, numpy's default_rng(0).integers(1, 4096) long (build_mock_gpt_datasets checks the
    count and the range)."""
    import numpy as np
    return np.random.default_rng(0).integers(1, 4096, size=100000, dtype=np.int32)
