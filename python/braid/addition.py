"""The embedded default dataset: integer addition written as text, byte-level tokens.

Problems look like ``364+58=422``; a row of the training batch holds one problem followed by a
newline, padded to ``SEQ_LENGTH``. Only the answer (the digits after ``=`` and the newline)
carries loss, so the model learns to add, not to guess the operands. Pairs are split by a
fixed hash into a training set and a held-out set that training never sees.

Held-out problems draw both operands uniformly from [0, 10^digits). Training draws a quarter
of its operands from the shorter numbers [0, 10^(digits-1)) instead: with uniform operands
only one in ten is shorter than the rest, and the model is slow to learn to line up digits
of operands of different lengths.

The training problems reach the model the way any dataset does: ``write_training_data`` writes
them with braid's IndexedDatasetWriter as Megatron ``.bin``/``.idx`` files, one document of
exactly ``SEQ_LENGTH`` tokens per problem, and the GPT data loader reads them. Because every
document is one sample long, sample i of the loader is exactly one problem (its labels end with
the next problem's first token, which is never supervised), and ``answer_targets`` keeps the
loss on the answer alone.
"""

from __future__ import annotations

import os

import numpy as np

VOCAB_SIZE = 256          # one token per byte
SEQ_LENGTH = 16           # "999+999=1998\n" is 13 bytes
PAD = ord("\n")
IGNORE = -1


def is_held_out(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One pair in 64, chosen by a multiplicative hash of (a, b): never trained on."""
    key = (a.astype(np.uint64) * np.uint64(1000) + b.astype(np.uint64)) * np.uint64(0x9E3779B97F4A7C15)
    return (key >> np.uint64(58)) == 0


def encode(text: str) -> list[int]:
    return list(text.encode("ascii"))


def problem_text(a: int, b: int, width: int = 0) -> tuple[str, str]:
    """The prompt and the answer the model must produce (with its closing newline).

    width > 0 zero-pads the operands to `width` digits and the sum to width + 1.
    """
    if width:
        return f"{a:0{width}d}+{b:0{width}d}=", f"{a + b:0{width + 1}d}\n"
    return f"{a}+{b}=", f"{a + b}\n"


class AdditionData:
    """Batches of training problems and the held-out evaluation problems."""

    def __init__(self, digits: int = 3, seed: int = 1234, short_fraction: float = 0.25,
                 padded: bool = False):
        self.max_operand = 10**digits
        self.width = digits if padded else 0
        self.short_fraction = short_fraction
        self.rng = np.random.default_rng(seed)

    def _operands(self, n: int, held_out: bool) -> np.ndarray:
        x = self.rng.integers(0, self.max_operand, size=n)
        if not held_out:
            short = self.rng.random(n) < self.short_fraction
            x[short] = self.rng.integers(0, self.max_operand // 10, size=int(short.sum()))
        return x

    def _sample_pairs(self, n: int, held_out: bool) -> tuple[np.ndarray, np.ndarray]:
        a_out, b_out = [], []
        need = n
        while need > 0:
            a = self._operands(2 * need + 64, held_out)
            b = self._operands(2 * need + 64, held_out)
            keep = is_held_out(a, b) == held_out
            a_out.append(a[keep][:need])
            b_out.append(b[keep][:need])
            need -= len(a_out[-1])
        return np.concatenate(a_out), np.concatenate(b_out)

    def batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """ids [B, S] and next-token targets [B, S] (int32); IGNORE except on the answer."""
        return self._rows(*self._sample_pairs(batch_size, held_out=False))

    def held_out_batch(self, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """Like batch, of held-out problems (validation)."""
        return self._rows(*self._sample_pairs(batch_size, held_out=True))

    def _rows(self, first: np.ndarray, second: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full((len(first), SEQ_LENGTH), PAD, dtype=np.int32)
        targets = np.full((len(first), SEQ_LENGTH), IGNORE, dtype=np.int32)
        for row, (a, b) in enumerate(zip(first, second)):
            prompt, answer = problem_text(int(a), int(b), self.width)
            tokens = encode(prompt + answer)
            ids[row, : len(tokens)] = tokens
            # position t predicts token t + 1: the answer starts after the prompt's last byte
            start = len(prompt) - 1
            targets[row, start : start + len(answer)] = tokens[len(prompt) :]
        return ids, targets

    def held_out_problems(self, n: int) -> list[tuple[int, int]]:
        a, b = self._sample_pairs(n, held_out=True)
        return [(int(x), int(y)) for x, y in zip(a, b)]


def training_data_prefix(directory: str, n_problems: int, digits: int = 3, seed: int = 1234,
                         short_fraction: float = 0.0, padded: bool = False) -> str:
    """Where write_training_data puts these problems: a name that records every parameter."""
    style = "padded" if padded else "natural"
    name = f"addition-{digits}d-{style}-short{short_fraction:g}-seed{seed}-{n_problems}"
    return os.path.join(directory, name)


def write_training_data(prefix: str, n_problems: int, digits: int = 3, seed: int = 1234,
                        short_fraction: float = 0.0, padded: bool = False,
                        chunk: int = 8192) -> str:
    """Writes n_problems training problems to prefix.bin / prefix.idx (one document each).

    The files are written under a name of this process's own and renamed into place, .idx last,
    so that two demos starting at once never mix their files (they write the same bytes).
    """
    from braid.data import IndexedDatasetWriter, smallest_token_type

    data = AdditionData(digits, seed, short_fraction, padded)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = f"{prefix}.tmp{os.getpid()}"
    with IndexedDatasetWriter(tmp, smallest_token_type(VOCAB_SIZE)) as writer:
        for start in range(0, n_problems, chunk):
            ids, _ = data.batch(min(chunk, n_problems - start))
            writer.add_documents(ids.ravel(), np.full(len(ids), SEQ_LENGTH, dtype=np.int64))
    os.replace(tmp + ".bin", prefix + ".bin")
    os.replace(tmp + ".idx", prefix + ".idx")
    return prefix


def answer_targets(ids: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """The loader's labels with IGNORE everywhere but the answer and its closing newline.

    Row r of ids is one problem padded with newlines; position t predicts labels[r, t]. The
    answer is predicted from the positions of "=" and of the answer's digits: t at or after "="
    whose input is not padding.
    """
    ids = np.asarray(ids)
    equals = np.argmax(ids == ord("="), axis=1)
    keep = (np.arange(ids.shape[1])[None, :] >= equals[:, None]) & (ids != PAD)
    return np.where(keep, np.asarray(labels), IGNORE).astype(np.int32)


def greedy_answers(logits_fn, problems: list[tuple[int, int]], width: int = 0,
                   max_answer: int = 5) -> list[str]:
    """Greedy decoding of every problem's answer in one batch.

    ``logits_fn(ids)`` maps int32 [N, SEQ_LENGTH] to logits [N, SEQ_LENGTH, V]. Rows are padded
    on the right; causal attention makes each row's next token depend only on its prefix.
    """
    prompts = [encode(problem_text(a, b, width)[0]) for a, b in problems]
    ids = np.full((len(problems), SEQ_LENGTH), PAD, dtype=np.int32)
    lengths = np.array([len(p) for p in prompts])
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = p
    answers = [bytearray() for _ in problems]
    done = np.zeros(len(problems), dtype=bool)
    for _ in range(max_answer):
        logits = logits_fn(ids)
        rows = np.arange(len(problems))
        positions = np.minimum(lengths - 1, SEQ_LENGTH - 1)
        next_tokens = np.argmax(logits[rows, positions], axis=-1)
        for row in np.nonzero(~done)[0]:
            token = int(next_tokens[row])
            if token == PAD or lengths[row] >= SEQ_LENGTH:
                done[row] = True
                continue
            answers[row].append(token)
            ids[row, lengths[row]] = token
            lengths[row] += 1
        if done.all():
            break
    return [bytes(a).decode("ascii", errors="replace") for a in answers]


def expected_answer(a: int, b: int, width: int = 0) -> str:
    return problem_text(a, b, width)[1].rstrip("\n")
