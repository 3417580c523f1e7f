"""The data of pretrain_gpt.py's run for one DP rank: the training, validation and test
loaders over the embedded addition problems, Megatron's mock data, --data-path (with --split) or
each split's own datasets (--train/valid/test-data-path), and the targets the loss counts
(answers only for the addition problems; --eod-mask-loss)."""

from __future__ import annotations

import os

import numpy as np

from braid import addition, validation_sets
from braid.data import (BatchLayout, DataLoader, IndexedDataset, build_gpt_datasets,
                        build_mock_gpt_datasets, mock_lengths, parse_data_path, parse_split,
                        split_documents)


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "braid", "demo")


class _Rows:
    """A batch of this DP rank's rows, shaped like braid.data.Batch."""

    def __init__(self, tokens, labels, num_microbatches, global_batch_size):
        self.tokens, self.labels, self.num_microbatches = tokens, labels, num_microbatches
        self.global_batch_size = global_batch_size


class ArrayLoader:
    """Global batches of samples from `sample(i) -> (tokens, labels)` in Megatron's order: the
    global batch at `consumed_samples` (its size from `layout`, a braid.data.BatchLayout, so
    ramps too), each microbatch step's mbs x dp samples split by DP rank. Cycles when
    `num_samples` is given (validation)."""

    def __init__(self, sample, micro_batch_size, layout, dp_rank, dp_size, consumed_samples=0,
                 num_samples=None):
        self.sample, self.mbs, self.layout = sample, micro_batch_size, layout
        self.dp_rank, self.dp = dp_rank, dp_size
        self.consumed_samples, self.num_samples = consumed_samples, num_samples
        self.wait_seconds = 0.0

    def next(self):
        gbs = self.layout.global_batch_size_at(self.consumed_samples)
        if self.num_samples and self.consumed_samples + gbs > self.num_samples:
            self.consumed_samples = 0
        rows = []
        for step in range(gbs // (self.mbs * self.dp)):
            first = self.consumed_samples + step * self.mbs * self.dp + self.dp_rank * self.mbs
            rows.extend(self.sample(i) for i in range(first, first + self.mbs))
        self.consumed_samples += gbs
        tokens = np.stack([r[0] for r in rows]).astype(np.int32)
        labels = np.stack([r[1] for r in rows]).astype(np.int32)
        return _Rows(tokens, labels, len(rows) // self.mbs, gbs)


def addition_valid_sample(seed, count):
    """Held-out addition problems (never trained on), loss on the answer alone."""
    ids, targets = addition.AdditionData(seed=seed + 1, short_fraction=0.0,
                                         padded=True).held_out_batch(count)
    return lambda i: (ids[i % count], targets[i % count])


class Data:
    """The run's train, validation and test loaders for this DP rank."""

    def __init__(self, a, dp_rank, consumed, iteration, rank, barrier, valid_consumed=None):
        train_samples = 0 if a.skip_train else a.train_data_samples
        evals = a.train_iters // a.eval_interval + 1
        # --full-validation: one epoch of each validation set (megatron-core's size None).
        valid_samples = None if a.full_validation else evals * a.eval_iters * a.global_batch_size
        test_samples = a.eval_iters * a.global_batch_size  # Megatron's: one evaluation, at the end
        # The validation position: the checkpoint's (Megatron's consumed_valid_samples), or for
        # a checkpoint before it the evaluations before the iteration (an iteration
        # --iterations-to-skip drops evaluates nothing).
        if valid_consumed is None:
            dropped = {n + 1 for n in a.iterations_to_skip
                       if (n + 1) % a.eval_interval == 0 and n + 1 <= iteration}
            valid_consumed = (iteration // a.eval_interval - len(dropped)) * a.eval_iters * \
                a.global_batch_size
        self.valid_consumed = valid_consumed  # training.py's evaluations advance it
        self.answer_only = a.addition_data
        self.eod_mask = a.eod if a.eod_mask_loss else None
        self.valid = self.test = None  # valid: the validation_sets.ValidationSet list
        self.notes = validation_sets.notes(a)  # for the log
        self.no_test = None  # why a --data-path run has no test evaluation, if it has none
        # Training steps ramp under --rampup-batch-size; evaluation takes full batches (Megatron).
        def loader(ds, consumed, rampup=None):
            return DataLoader(ds, a.micro_batch_size, a.global_batch_size, dp_rank=dp_rank,
                              dp_size=a.dp, consumed_samples=consumed, prefetch=4,
                              rampup_batch_size=rampup)
        full = BatchLayout(a.micro_batch_size, a.global_batch_size, dp_size=a.dp)
        if a.data_path and a.eval_iters and parse_split(a.split)[2] > 0:
            self.no_test = self._empty_test_split(a)
        if self.no_test or not a.eval_iters or (a.data_path and parse_split(a.split)[2] == 0):
            test_samples = 0
        samples = (train_samples, valid_samples, test_samples)
        # Rank 0 writes the data and the sample indices first; the others then map them. Its
        # error waits past the barrier, where the others meet it too: every rank exits alike
        # instead of the others waiting at the barrier for a rank that has left.
        error = None
        if rank == 0:
            try:
                datasets = self._datasets(a, samples)
            except ValueError as e:
                error = e
        barrier()
        if error is not None:
            raise error
        if rank != 0:
            datasets = self._datasets(a, samples)
        train, valid, test = datasets
        # None: --skip-train
        self.train = loader(train, consumed, a.rampup_batch_size) if train is not None else None
        sets = []  # (name, size, loader from a position)
        if a.validates and valid is not None:
            names = [" ".join(p) for p in validation_sets.valid_prefixes(a) or []] or \
                [f"{' '.join(a.data_path)} (--split {a.split})" if a.data_path else "mock data"]
            for name, ds in zip(names, valid if isinstance(valid, list) else [valid]):
                sets.append((name, len(ds), lambda at, ds=ds: loader(ds, at)))
        elif a.validates and a.addition_data:
            count = max(a.global_batch_size, 1024)
            sample = addition_valid_sample(a.seed, count)
            sets.append(("the held-out addition problems", count, lambda at: ArrayLoader(
                sample, a.micro_batch_size, full, dp_rank, a.dp, at, num_samples=count)))
        if sets:  # the same sizes on every rank: a ValueError on one is one on all
            self.valid = [validation_sets.ValidationSet(a, i, *s, valid_consumed)
                          for i, s in enumerate(sets)]
            if a.full_validation or a.multiple_validation_sets:
                self.notes += [s.describe(a.global_batch_size) for s in self.valid]
        if test is not None:
            self.test = loader(test, 0)

    @staticmethod
    def _empty_test_split(a):
        """Why --data-path's test split cannot be evaluated (it holds no documents of some
        dataset), or None."""
        prefixes, _ = parse_data_path(a.data_path)
        for prefix in prefixes:
            begin, end = split_documents(a.split, IndexedDataset(prefix).num_documents)[2]
            if begin == end:
                return f"--split {a.split} leaves no test documents of {prefix}"
        return None

    @staticmethod
    def _datasets(a, samples):
        """(train, valid, test) datasets; None where a split is absent or not asked for."""
        cache = a.data_cache_path or ""
        if a.mock_data:
            # megatron-core's MockGPTDataset: its config forces the split to 1,1,1. Without a
            # tokenizer (braid's --vocab-size alone) the last token stands for the end of document.
            eod = getattr(a, "eod", None)
            return build_mock_gpt_datasets(
                mock_lengths(), a.seq_length, list(samples), vocab_size=a.vocab_size,
                eod=a.vocab_size - 1 if eod is None else eod, split="1,1,1", seed=a.seed)
        if a.data_path:
            return build_gpt_datasets(a.data_path, a.seq_length, list(samples), split=a.split,
                                      seed=a.seed, cache_path=cache)
        if a.train_data_path or a.valid_data_path or a.test_data_path:
            # Megatron's blend per split: each split's datasets used whole.
            out = []
            paths = (a.train_data_path, a.valid_data_path, a.test_data_path)
            for i, (path, n) in enumerate(zip(paths, samples)):
                if not path or n == 0:
                    out.append(None)
                    continue
                sizes = [0, 0, 0]
                sizes[i] = n  # None: one epoch (--full-validation)
                split = ",".join("1" if j == i else "0" for j in range(3))
                each = validation_sets.valid_prefixes(a) if i == 1 else [path]
                built = [build_gpt_datasets(p, a.seq_length, sizes, split=split, seed=a.seed,
                                            cache_path=cache)[i] for p in each]
                out.append(built if a.multiple_validation_sets and i == 1 else built[0])
            return tuple(out)
        train_samples = samples[0]
        if not train_samples:  # --skip-train: the held-out problems validate
            return None, None, None
        # One problem per sample: one more problem than samples, so one epoch covers the run.
        directory = a.data_cache_path or default_cache_dir()
        prefix = addition.training_data_prefix(directory, train_samples + 1, seed=a.seed,
                                               padded=True)
        if not os.path.exists(prefix + ".idx"):  # .idx is renamed into place last
            addition.write_training_data(prefix, train_samples + 1, seed=a.seed, padded=True)
        train, _, _ = build_gpt_datasets([prefix], addition.SEQ_LENGTH, [train_samples, 0, 0],
                                         split="1", seed=a.seed, cache_path=cache)
        return train, None, None

    def targets(self, batch):
        labels = np.asarray(batch.labels)
        if self.answer_only and not isinstance(batch, _Rows):
            return addition.answer_targets(np.asarray(batch.tokens), labels)
        if self.eod_mask is not None:  # Megatron's --eod-mask-loss: by the input token
            return np.where(np.asarray(batch.tokens) == self.eod_mask, -1, labels).astype(
                labels.dtype)
        return labels
