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
"""

from braid._C import IndexedDataset, IndexedDatasetWriter, smallest_token_type

__all__ = ["IndexedDataset", "IndexedDatasetWriter", "smallest_token_type"]
