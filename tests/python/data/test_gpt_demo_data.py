"""The demo's data on the GPT data path: the addition problems written as .bin/.idx by braid's
writer, read back by the loader one problem per sample, the loss kept on the answers; and the
demo end to end on its own data and on a user's --data-path (tiny models, a few steps)."""

import numpy as np

from braid import addition, demo
from braid.data import DataLoader, GPTDataset, IndexedDataset, IndexedDatasetWriter


def old_style_targets(row: np.ndarray) -> np.ndarray:
    """The targets AdditionData.batch gives a row: the answer and its newline, IGNORE elsewhere."""
    text = bytes(row.tolist()).decode("ascii").rstrip("\n")
    prompt, answer = text[: text.index("=") + 1], text[text.index("=") + 1:] + "\n"
    targets = np.full(len(row), addition.IGNORE, dtype=np.int32)
    start = len(prompt) - 1
    targets[start:start + len(answer)] = list(answer.encode("ascii"))
    return targets


def test_addition_problems_are_one_sample_each(tmp_path):
    for padded in (True, False):
        prefix = addition.training_data_prefix(str(tmp_path), 257, seed=3, padded=padded)
        addition.write_training_data(prefix, 257, seed=3, padded=padded, chunk=100)
        raw = IndexedDataset(prefix)
        assert raw.num_documents == 257 and raw.token_type == "u16"
        assert set(np.asarray(raw.sequence_lengths).tolist()) == {addition.SEQ_LENGTH}

        ds = GPTDataset(prefix, addition.SEQ_LENGTH, num_samples=256, seed=3, use_cache=False)
        assert len(ds) == 256  # one epoch of 257 documents of 16 tokens
        problems = set()
        for batch in DataLoader(ds, 32, 64):
            ids, labels = np.asarray(batch.tokens), np.asarray(batch.labels)
            targets = addition.answer_targets(ids, labels)
            for r in range(len(ids)):
                text = bytes(ids[r].tolist()).decode("ascii").rstrip("\n")
                a, rest = text.split("+")
                b, c = rest.split("=")
                assert int(a) + int(b) == int(c)
                assert np.array_equal(targets[r], old_style_targets(ids[r]))
                problems.add(text)
        assert len(problems) > 240  # shuffled problems, not one repeated


def test_demo_trains_on_its_data_path(tmp_path, capsys):
    argv = ["--train-iters", "3", "--lr-warmup-iters", "1", "--micro-batch-size", "8",
            "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
            "--eval-problems", "8", "--data-cache-path", str(tmp_path)]
    assert demo.main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("demo: accuracy=") and out[-1].endswith("s")
    assert any(line.startswith("demo: waited") for line in out)
    # A second start reuses the written problems and the cached sample indices.
    before = sorted(p.name for p in tmp_path.iterdir())
    assert demo.main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_demo_trains_on_user_data(tmp_path, capsys):
    rng = np.random.default_rng(0)
    prefixes = []
    for name in ("a", "b"):
        prefix = str(tmp_path / name)
        with IndexedDatasetWriter(prefix, "u16") as w:
            for _ in range(200):
                w.add_document(rng.integers(0, 500, size=int(rng.integers(5, 60))))
        prefixes.append(prefix)
    argv = ["--data-path", "0.4", prefixes[0], "0.6", prefixes[1], "--vocab-size", "512",
            "--seq-length", "32", "--split", "90,10,0", "--train-iters", "3",
            "--lr-warmup-iters", "1", "--micro-batch-size", "4", "--num-layers", "1",
            "--hidden-size", "32", "--num-attention-heads", "2", "--eval-iters", "2",
            "--data-cache-path", str(tmp_path / "cache")]
    assert demo.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("demo: valid_loss=")
    loss = float(last.split("=")[1].split()[0])
    assert 0 < loss < 10  # about log(512) = 6.2 after three steps
