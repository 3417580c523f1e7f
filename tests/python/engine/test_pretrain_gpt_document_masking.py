"""pretrain_gpt.py with --reset-attention-mask and --reset-position-ids (Megatron's document
masking), as real jobs on a real Megatron dataset of short documents that each end in
NullTokenizer's end-of-document token, so every 32-token sample holds several documents:

- tp 2 x pp 2 with sequence parallelism and ZeRO, cp 2 x dp 2 (documents cut by the context
  split) and pp 2 x dp 2 with 2 virtual stages train like one process, under rope and under
  learned positions (the lm losses of 20 steps and the validation losses, rtol 2e-4)
- the flags change training, each its own way: with learned positions the four runs (neither
  flag, either, both) all differ; under rope, which is relative, --reset-position-ids adds
  nothing to --reset-attention-mask, but alone it changes the losses, as the mask does
- either flag without --tokenizer-type (which names the end-of-document token) is refused
  before any training
"""

import itertools
import os
import shutil

import numpy as np
import pytest

from braid.data import IndexedDataset, IndexedDatasetWriter
from pretrain_job import LAYOUT_3D, MODEL, assert_trains_alike, jsonl, log_lines, losses, run

pytestmark = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun")

VOCAB = 300  # NullTokenizer --vocab-size 300: tokens 0..299, its end-of-document token 300
BOTH = ("--reset-attention-mask", "--reset-position-ids")
# Runs that must differ do by more than 2.5 x the rtol 2e-4 that layouts are held to: a layout
# that dropped a flag, or applied it differently, would fail assert_trains_alike.
DIFFERS = 5e-4
# MODEL without its mock data and vocabulary (the dataset and the tokenizer give them).
_mock = MODEL.index("--mock-data")
BASE = MODEL[:_mock] + MODEL[_mock + 3:]
assert MODEL[_mock:_mock + 3] == ["--mock-data", "--vocab-size", "300"]


def model_args(prefix: str, position: str) -> list[str]:
    args = [*BASE, "--data-path", prefix, "--tokenizer-type", "NullTokenizer",
            "--vocab-size", str(VOCAB)]
    args[args.index("--position-embedding-type") + 1] = position
    return args


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    """400 documents of 3 to 25 tokens of [0, 300), each followed by the end-of-document token:
    what Megatron's preprocess_data.py writes for space-separated integers under NullTokenizer
    with --append-eod (tools/preprocess_data.py does not take NullTokenizer; its writer does)."""
    rng = np.random.default_rng(1234)
    texts = [" ".join(map(str, rng.integers(0, VOCAB, int(rng.integers(3, 26)))))
             for _ in range(400)]
    prefix = str(tmp_path_factory.mktemp("documents") / "docs_text_document")
    with IndexedDatasetWriter(prefix, "u16") as w:
        for text in texts:  # NullTokenizer.tokenize: the integers between the spaces
            w.add_document([int(t) for t in text.split(" ")] + [VOCAB])
    ds = IndexedDataset(prefix)
    tokens = np.concatenate([np.asarray(ds[i]) for i in range(ds.num_sequences)])
    assert ds.num_documents == 400 and (tokens == VOCAB).sum() == 400
    assert tokens.size / 400 < 16  # about 15 tokens a document: several to a sample of 32
    return prefix


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):
    """train(position, *flags): the metrics of 20 iterations in one process (each run once)."""
    done = {}

    def train(position: str, *flags: str) -> list[dict]:
        if (position, flags) not in done:
            tb = str(tmp_path_factory.mktemp("one_process") / "tb")
            r = run(1, [*model_args(data, position), *flags, "--train-iters", "20",
                        "--tensorboard-dir", tb])
            assert r.returncode == 0, r.stdout + r.stderr
            done[position, flags] = jsonl(os.path.join(tb, "metrics.jsonl"))
        return done[position, flags]
    return train


def loss_curve(records: list[dict]) -> np.ndarray:
    got = losses(records)
    assert sorted(got) == list(range(1, 21))
    return np.array([got[i] for i in range(1, 21)])


def largest_relative_difference(a: list[dict], b: list[dict]) -> float:
    x, y = loss_curve(a), loss_curve(b)
    return float(np.max(np.abs(x - y) / np.abs(y)))


@pytest.mark.parametrize("position", ["rope", "learned_absolute"])
@pytest.mark.parametrize("ranks, layout, printed", [
    (4, LAYOUT_3D, "tp=2 pp=2 dp=1"),
    # Documents cross the context split: each CP rank holds two chunks of every sample.
    (4, ["--context-parallel-size", "2", "--use-distributed-optimizer"],
     "tp=1 cp=2 pp=1 dp=2"),
    (4, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
     "tp=1 pp=2 dp=2, 2 virtual stages"),
], ids=["tp2-pp2-sp-zero", "cp2-dp2-zero", "pp2-vpp2-dp2"])
def test_document_masking_trains_like_one_process(ranks, layout, printed, position, data,
                                                   one_process, tmp_path):
    tb = str(tmp_path / "tb")
    r = run(ranks, [*model_args(data, position), *BOTH, *layout, "--train-iters", "20",
                    "--tensorboard-dir", tb])
    assert r.returncode == 0, r.stdout + r.stderr
    assert printed in r.stdout, r.stdout
    records, reference = jsonl(os.path.join(tb, "metrics.jsonl")), one_process(position, *BOTH)
    print(f"{position} {printed}: largest relative loss difference "
          f"{largest_relative_difference(records, reference):.3g}")
    assert_trains_alike(records, reference)


def test_with_learned_positions_each_flag_changes_training(one_process):
    runs = {flags: one_process("learned_absolute", *flags)
            for flags in [(), BOTH[:1], BOTH[1:], BOTH]}
    for a, b in itertools.combinations(runs, 2):
        difference = largest_relative_difference(runs[a], runs[b])
        print(f"learned_absolute {a} vs {b}: {difference:.3g}")
        assert difference > DIFFERS, (a, b)


def test_under_rope_the_mask_changes_training_and_positions_alone_do(one_process):
    plain, masked = one_process("rope"), one_process("rope", *BOTH)
    positions, mask = one_process("rope", BOTH[1]), one_process("rope", BOTH[0])
    figures = {"masked vs plain": largest_relative_difference(masked, plain),
               "positions alone vs masked": largest_relative_difference(positions, masked),
               "positions alone vs plain": largest_relative_difference(positions, plain),
               "mask alone vs masked": largest_relative_difference(mask, masked)}
    print("rope:", {k: f"{v:.3g}" for k, v in figures.items()})
    assert figures["masked vs plain"] > 1e-3
    assert figures["positions alone vs masked"] > DIFFERS
    # Restarted positions only turn what a token sees across a document boundary: a small
    # change in 20 steps, yet some 1000 x the 1e-7 by which the layouts above differ.
    assert figures["positions alone vs plain"] > 2e-5
    # Within a document rope sees the same relative positions either way.
    assert figures["mask alone vs masked"] < 1e-5


@pytest.mark.parametrize("flag", BOTH)
@pytest.mark.parametrize("data_args", [["--seq-length", "16"], ["--mock-data", "--vocab-size",
                                                                 str(VOCAB)]],
                         ids=["embedded", "mock"])
def test_document_masking_needs_a_tokenizer(flag, data_args):
    # Without the flag these run (the last --seq-length counts).
    args = [*BASE, *data_args, flag, "--train-iters", "5"]
    r = run(1, args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (f"{flag} needs --tokenizer-type (it names the end-of-document token)"
            in r.stderr), r.stderr
    assert not log_lines(r.stdout), r.stdout


def test_position_ids_alone_under_rope_say_how_megatron_differs(data):
    # megatron-core's rope ignores position ids: with the mask too nothing differs (rope is
    # relative), alone braid's rope turns by restarted positions and Megatron's does not.
    from braid.arguments import parse_args
    from braid.training import megatron_difference_notes

    def notes(position, *flags):
        return [n for n in megatron_difference_notes(parse_args(
            [*model_args(data, position), *flags, "--train-iters", "20"], 1))
                if "--reset-position-ids" in n]
    said = "braid: --reset-position-ids turns rope by each token's position in its document"
    assert any(n.startswith(said) for n in notes("rope", BOTH[1])), notes("rope", BOTH[1])
    assert notes("rope", *BOTH) == notes("learned_absolute", BOTH[1]) == []
