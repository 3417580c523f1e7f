"""Regenerates tests/fuzz/idx_corpus/: seeds for the .idx fuzz target (tests/fuzz/idx_fuzz.cpp).

Each seed is the .bin's size (8 bytes, little-endian) followed by an .idx. The valid ones are
written by megatron-core's own IndexedDatasetBuilder; the invalid ones are those with one field
broken. Run from the repository root with the test venv:
    .venv/bin/python tests/fuzz/make_idx_corpus.py
"""

import os
import struct
import sys
import tempfile

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "idx_corpus")


def build(dtype, documents, multimodal=False):
    """(bin size, idx bytes) of a dataset; documents is a list of lists of sequences."""
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "seed")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype, multimodal=multimodal)
        for document in documents:
            for k, sequence in enumerate(document):
                builder.add_item(torch.tensor(sequence, dtype=torch.int64), mode=k % 2)
            builder.end_document()
        builder.finalize(prefix + ".idx")
        with open(prefix + ".idx", "rb") as f:
            return os.path.getsize(prefix + ".bin"), f.read()


def save(name, bin_size, idx):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(struct.pack("<Q", bin_size) + idx)


def patched(idx, offset, fmt, value):
    b = bytearray(idx)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


def main():
    os.makedirs(OUT, exist_ok=True)
    docs = [[[1, 2, 3], [4]], [], [[5, 6]]]
    size, small = build(numpy.uint16, docs)
    save("valid_u16", size, small)
    save("valid_i32", *build(numpy.int32, [[[7] * 5], [[8, 9]]]))
    save("valid_u8_many", *build(numpy.uint8, [[[i % 256] * (i % 4)] for i in range(40)]))
    save("valid_i64", *build(numpy.int64, [[[1 << 40, -1]]]))
    save("valid_f32", *build(numpy.float32, [[[1, 2]], [[3]]]))
    save("valid_empty", *build(numpy.uint16, []))
    save("valid_multimodal", *build(numpy.int32, [[[1, 2], [3]], [[4]]], multimodal=True))
    # small: 3 sequences, 4 document indices; lengths at 34, pointers at 46, documents at 70
    save("bad_magic", size, b"MMIDIDY" + small[7:])
    save("bad_version", size, patched(small, 9, "<Q", 2))
    save("bad_dtype", size, patched(small, 17, "<B", 9))
    save("bad_count", size, patched(small, 18, "<Q", 1 << 62))
    save("bad_length", size, patched(small, 38, "<i", -3))
    save("bad_pointer", size, patched(small, 62, "<q", 4))
    save("bad_document", size, patched(small, 86, "<q", 1))
    save("bad_truncated_bin", size - 2, small)
    save("bad_truncated_idx", size, small[:60])
    print(f"wrote {len(os.listdir(OUT))} seeds to {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
