"""What each evaluation of pretrain_gpt.py reads: Megatron-LM's --full-validation and
--multiple-validation-sets (docs/data.md, "Validation sets").

- Neither: one validation dataset (--data-path's valid split, the blend of --valid-data-path, the
  mock or the addition data's) and --eval-iters global batches per evaluation, from where the
  evaluation before stopped (a position checkpoints save, Megatron's consumed_valid_samples, so
  a resumed run validates on the same batches), starting over at the end of the data.
- --multiple-validation-sets: each prefix of --valid-data-path is a set of its own, built as that
  prefix alone would be (megatron-core's builder), evaluated in turn with its own loss, log line
  and tags: ` validation-0 loss at iteration N | ...`, `lm loss validation-0`. Each set keeps its
  own position.
- --full-validation: the validation datasets are one epoch long (megatron-core builds them with no
  sample count) and each evaluation reads every full global batch of each set from its first
  sample: len(set) // --global-batch-size batches; the last len(set) % --global-batch-size
  samples are not evaluated. It validates whatever --eval-iters says, which then sizes only the
  end-of-run test evaluation.

Every rank counts the batches from the datasets' lengths, which every rank builds alike, so every
rank runs the same evaluations (each one collective); each DP rank reads its share of each
global batch through its own loader."""

from __future__ import annotations


def add_arguments(group):
    group.add_argument("--full-validation", action="store_true",
                       help="each evaluation reads the whole validation set(s): every full "
                            "global batch of one epoch, from the first sample")
    group.add_argument("--multiple-validation-sets", action="store_true",
                       help="each prefix of --valid-data-path (no weights) is evaluated as its "
                            "own set, with its own loss: validation-0, validation-1, ...")


def _blend(data_path):
    """(prefixes, weights or None) of a --data-path style list."""
    from braid.arguments import ArgumentError
    from braid.data import parse_data_path
    try:
        return parse_data_path(data_path)
    except ValueError as e:
        raise ArgumentError(f"{' '.join(data_path)}: {e}") from None


def validate(a, check):
    """Megatron's rules for the two flags, with braid's messages; sets a.validates."""
    if a.multiple_validation_sets:
        check(a.valid_data_path is not None,
              "--multiple-validation-sets evaluates each prefix of --valid-data-path as its own "
              "set: give --valid-data-path (--data-path's and --mock-data's validation split is "
              "one dataset)")
        check(_blend(a.valid_data_path)[1] is None,
              f"--multiple-validation-sets: --valid-data-path {' '.join(a.valid_data_path)} has "
              "weights; give its prefixes alone (each is its own set; Megatron: 'This argument "
              "requires that no weights are included in the list')")
    if a.full_validation and a.data_path:
        check(_blend(a.data_path)[1] is None,
              f"--full-validation reads one epoch of each validation dataset; --data-path "
              f"{' '.join(a.data_path)} is a weighted blend, whose size is a number of samples "
              "(megatron-core's builder fails on weights without one): give the prefixes alone")
    if a.full_validation and a.valid_data_path and not a.multiple_validation_sets:
        prefixes, weights = _blend(a.valid_data_path)
        check(weights is None or len(prefixes) == 1,
              f"--full-validation reads one epoch of each validation dataset; --valid-data-path "
              f"{' '.join(a.valid_data_path)} is a weighted blend, whose size is a number of "
              "samples (megatron-core's builder refuses weights without one): give the prefixes "
              "alone, or add --multiple-validation-sets")
    a.validates = a.full_validation or a.eval_iters > 0


def valid_prefixes(a):
    """The validation split's own datasets, one per set (--multiple-validation-sets: each prefix
    alone), or None. megatron-core builds a per-split blend of one prefix as that prefix, whatever
    its weight: so does --full-validation here (a weighted blend would need a size)."""
    if not a.valid_data_path:
        return None
    prefixes, _ = _blend(a.valid_data_path)
    if a.multiple_validation_sets:
        return [[p] for p in prefixes]
    return [prefixes if a.full_validation and len(prefixes) == 1 else a.valid_data_path]


class ValidationSet:
    """One validation set: `open_loader(consumed)` is a loader of this DP rank's rows of its
    global batches from sample `consumed` (next() gives None at the end of the data)."""

    def __init__(self, a, index, name, size, open_loader, consumed):
        self.suffix = f"-{index}" if a.multiple_validation_sets else ""
        self.name, self.size, self.open_loader = name, size, open_loader
        self.full = a.full_validation
        gbs = a.global_batch_size
        self.num_batches = size // gbs if self.full else a.eval_iters
        if self.full and self.num_batches == 0:
            raise ValueError(f"--full-validation: the validation set {name} holds {size} samples, "
                             f"less than one global batch ({gbs}): nothing to evaluate")
        self.loader = None if self.full else open_loader(consumed % size)

    def evaluation(self):
        """The global batches of one evaluation: the set's first `batches` (--full-validation),
        else the next --eval-iters, starting over at the end of the data."""
        if self.full:
            loader = self.open_loader(0)
            for _ in range(self.num_batches):
                yield loader.next()
            return
        for _ in range(self.num_batches):
            batch = self.loader.next()
            if batch is None:  # a set shorter than the run's evaluations: start over
                self.loader = self.open_loader(0)
                batch = self.loader.next()
            yield batch

    def describe(self, gbs) -> str:
        what = f"braid: lm loss validation{self.suffix}: {self.name} ({self.size} samples): "
        if not self.full:
            return what + f"{self.num_batches} global batches of {gbs} per evaluation"
        rest = self.size - self.num_batches * gbs
        return what + (f"all {self.num_batches} full global batches of {gbs} per evaluation"
                       + (f" (the last {rest} samples are not evaluated)" if rest else ""))


def notes(a) -> list[str]:
    if a.multiple_validation_sets and not a.full_validation and not a.skip_train:
        return ["braid: --multiple-validation-sets without --full-validation: Megatron-LM "
                "refuses this while training ('--multiple-validation-sets currently requires "
                "--full-validation'); braid evaluates --eval-iters batches of each set, each "
                "from its own position"]
    return []
