"""braid's GPT data loader against a plain numpy memmap loader of the same samples.

Writes a synthetic corpus (random documents, u16 tokens) with braid's writer, builds the
train split's indices once (the cache), then, alternating rounds in one process:

  braid  DataLoader: batches assembled on its background thread, taken by next()
  numpy  the same samples read through numpy.memmap of .bin and np.load of the cached indices,
         as megatron-core's GPTDataset.__getitem__ does, then stacked into tokens / labels

and checks that both yield the same batches. Prints samples/s of each and their ratio. Then
the step-wait figure: the CPU demo's training loop (its model, batch and data) for --demo-steps
steps, and the fraction of step time spent waiting in loader.next().

    python benchmarks/data_loader_bench.py
    python benchmarks/data_loader_bench.py --seq-length 4096 --micro-batch-size 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import braid  # noqa: E402
from braid import addition, demo  # noqa: E402
from braid.data import DataLoader, GPTDataset, IndexedDatasetWriter  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--documents", type=int, default=20000)
    p.add_argument("--max-document-length", type=int, default=2000)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=200, help="global batches per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--demo-steps", type=int, default=150)
    p.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    return p.parse_args(argv)


def write_corpus(prefix, args):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, args.max_document_length + 1, size=args.documents)
    tokens = rng.integers(0, 50000, size=int(lengths.sum()), dtype=np.int32)
    with IndexedDatasetWriter(prefix, "u16") as w:
        w.add_documents(tokens, lengths.astype(np.int64))
    return int(lengths.sum())


class NumpyLoader:
    """The peer: megatron-core's sample lookup on numpy memmaps, one global batch per call."""

    def __init__(self, prefix, cache_prefix, seq_length, rows, dtype=np.uint16):
        raw = braid.data.IndexedDataset(prefix)
        self.pointers = np.asarray(raw.sequence_pointers) // np.dtype(dtype).itemsize
        self.lengths = np.asarray(raw.sequence_lengths)
        self.bin = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
        self.documents = np.load(cache_prefix + "-document_index.npy", mmap_mode="r")
        self.samples = np.load(cache_prefix + "-sample_index.npy", mmap_mode="r")
        self.shuffle = np.load(cache_prefix + "-shuffle_index.npy", mmap_mode="r")
        self.seq_length, self.rows = seq_length, rows

    def sample(self, i):
        j = self.shuffle[i]
        (first, first_offset), (last, last_offset) = self.samples[j], self.samples[j + 1]
        parts = []
        for k in range(first, last + 1):
            d = self.documents[k]
            begin = first_offset if k == first else 0
            end = last_offset + 1 if k == last else self.lengths[d]
            parts.append(self.bin[self.pointers[d] + begin:self.pointers[d] + end])
        return np.concatenate(parts).astype(np.int32)

    def batch(self, consumed):
        rows = np.stack([self.sample(consumed + r) for r in range(self.rows)])
        return rows[:, :-1], rows[:, 1:]


def time_braid(ds, args):
    loader = DataLoader(ds, args.micro_batch_size, args.global_batch_size, prefetch=4)
    start = time.perf_counter()
    for _ in range(args.steps):
        loader.next()
    return args.steps * args.global_batch_size / (time.perf_counter() - start)


def time_numpy(peer, args):
    start = time.perf_counter()
    for step in range(args.steps):
        peer.batch(step * args.global_batch_size)
    return args.steps * args.global_batch_size / (time.perf_counter() - start)


def demo_wait(args, directory):
    """The demo's loop for --demo-steps steps: time in loader.next() vs the whole step."""
    d = demo.parse_args(["--train-iters", str(args.demo_steps), "--lr-warmup-iters", "10",
                         "--data-cache-path", directory])
    cfg = demo.demo_config(d)
    model = braid.GPTModel(cfg, seed=d.seed)
    trainer = braid.Trainer(
        model, braid.AdamWConfig(lr=d.lr, beta2=d.adam_beta2, weight_decay=d.weight_decay),
        braid.LRSchedule(lr=d.lr, warmup_iters=10, decay_iters=d.train_iters))
    train, _ = demo.training_data(d)
    loader = DataLoader(train, d.micro_batch_size, d.micro_batch_size, prefetch=4)
    waited = masked = 0.0
    start = time.perf_counter()
    for _ in range(d.train_iters):
        t0 = time.perf_counter()
        batch = loader.next()
        t1 = time.perf_counter()
        targets = addition.answer_targets(np.asarray(batch.tokens), np.asarray(batch.labels))
        t2 = time.perf_counter()
        trainer.train_step(batch.tokens, targets)
        waited += t1 - t0
        masked += t2 - t1
    total = time.perf_counter() - start
    return waited, masked, total, loader.wait_seconds


def main(argv=None):
    args = parse_args(argv)
    rows = args.global_batch_size
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        prefix = os.path.join(directory, "corpus")
        t0 = time.perf_counter()
        tokens = write_corpus(prefix, args)
        t1 = time.perf_counter()
        samples = args.steps * args.global_batch_size * args.rounds
        built = GPTDataset(prefix, args.seq_length, num_samples=samples, seed=1234)
        t2 = time.perf_counter()
        ds = GPTDataset(prefix, args.seq_length, num_samples=samples, seed=1234)
        t3 = time.perf_counter()
        assert ds.loaded_from_cache and not built.loaded_from_cache
        print(f"corpus: {args.documents:,} documents, {tokens:,} tokens (written in "
              f"{t1 - t0:.2f}s); indices for {len(ds):,} samples of {args.seq_length}: built in "
              f"{t2 - t1:.3f}s, loaded from the cache in {1000 * (t3 - t2):.1f}ms")

        peer = NumpyLoader(prefix, ds.cache_path_prefix, args.seq_length, rows)
        check = DataLoader(ds, args.micro_batch_size, args.global_batch_size)
        for step in range(3):
            b = check.next()
            tokens_np, labels_np = peer.batch(step * rows)
            assert np.array_equal(np.asarray(b.tokens), tokens_np)
            assert np.array_equal(np.asarray(b.labels), labels_np)

        braid_rates, numpy_rates = [], []
        for _ in range(args.rounds):
            braid_rates.append(time_braid(ds, args))
            numpy_rates.append(time_numpy(peer, args))
        b, n = max(braid_rates), max(numpy_rates)
        print(f"seq_length {args.seq_length}, micro batch {args.micro_batch_size}, global batch "
              f"{args.global_batch_size}: best of {args.rounds} rounds of {args.steps} steps")
        print(f"  braid DataLoader      {b:12,.0f} samples/s  {b * args.seq_length / 1e6:8.1f} "
              f"M tokens/s")
        print(f"  numpy memmap loader   {n:12,.0f} samples/s  {n * args.seq_length / 1e6:8.1f} "
              f"M tokens/s")

        if args.demo_steps > 0:
            waited, masked, total, thread_wait = demo_wait(args, directory)
            print(f"demo loop ({args.demo_steps} steps of the CPU demo): {total:.1f}s; in "
                  f"loader.next() {1000 * waited:.1f}ms ({100 * waited / total:.3f}% of step "
                  f"time; of which waiting for the thread {1000 * thread_wait:.1f}ms); answer "
                  f"masking {1000 * masked:.1f}ms ({100 * masked / total:.3f}%)")
        print(f"braid/numpy samples/s: {b / n:.2f}")


if __name__ == "__main__":
    main()
