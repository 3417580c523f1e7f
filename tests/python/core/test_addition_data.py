"""The embedded addition dataset: format, loss mask, held-out split, and greedy decoding."""

import numpy as np

from braid import addition


def test_batch_format_and_loss_mask():
    data = addition.AdditionData(seed=1)
    ids, targets = data.batch(32)
    assert ids.shape == targets.shape == (32, addition.SEQ_LENGTH)
    assert ids.dtype == np.int32
    for row in range(32):
        text = bytes(ids[row].tolist()).decode("ascii").rstrip("\n")
        a, rest = text.split("+")
        b, c = rest.split("=")
        assert int(a) + int(b) == int(c)
        supervised = targets[row][targets[row] >= 0]
        assert bytes(supervised.tolist()).decode("ascii") == c + "\n"
        # each supervised target is the next input token
        pos = np.nonzero(targets[row] >= 0)[0]
        assert np.array_equal(targets[row][pos[:-1]], ids[row][pos[:-1] + 1])


def test_held_out_pairs_never_appear_in_training():
    data = addition.AdditionData(seed=2)
    held = set(data.held_out_problems(500))
    assert len(held) > 400
    ids, _ = data.batch(4000)
    for row in ids:
        a, rest = bytes(row.tolist()).decode("ascii").rstrip("\n").split("+")
        assert (int(a), int(rest.split("=")[0])) not in held


def test_greedy_decoding_with_an_oracle():
    problems = [(364, 58), (0, 0), (999, 999)]

    def oracle_logits(ids):  # a "model" that knows the answer: logit 1 on the right byte
        out = np.zeros(ids.shape + (addition.VOCAB_SIZE,), dtype=np.float32)
        for r, (a, b) in enumerate(problems):
            text = addition.encode("".join(addition.problem_text(a, b)))
            for t in range(len(text) - 1):
                out[r, t, text[t + 1]] = 1.0
        return out

    assert addition.greedy_answers(oracle_logits, problems) == ["422", "0", "1998"]


def test_padded_format():
    data = addition.AdditionData(seed=3, padded=True)
    assert addition.problem_text(7, 58, data.width) == ("007+058=", "0065\n")
    ids, targets = data.batch(8)
    for row in range(8):
        text = bytes(ids[row].tolist()).decode("ascii").rstrip("\n")
        assert len(text) == 12 and text[3] == "+" and text[7] == "="
        supervised = bytes(targets[row][targets[row] >= 0].tolist()).decode("ascii")
        assert supervised == text[8:] + "\n"
    assert addition.expected_answer(999, 999, 3) == "1998"
