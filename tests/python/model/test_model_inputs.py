"""What a caller hands the model: bad input is a ValueError naming the problem, buffers may be
reused between forward and backward, and the config a model reports cannot change it."""

import numpy as np
import pytest

import braid
from hf_oracle import batch


def tiny_model(seed=1):
    return braid.GPTModel(braid.TransformerConfig.preset("llama-tiny"), device="cpu", seed=seed)


def test_caller_may_refill_its_buffers_before_backward():
    a, b = tiny_model(), tiny_model()
    vocab = a.config.vocab_size
    ids, targets = batch(vocab, seed=1)
    ids, targets = ids.astype(np.int32), targets.astype(np.int32)  # int32: passed zero-copy
    a.forward(ids, targets)
    a.backward()
    ids_buf, targets_buf = ids.copy(), targets.copy()
    b.forward(ids_buf, targets_buf)
    ids_buf[:] = 0          # a loader refilling its buffer for the next batch
    targets_buf[:] = 1
    b.backward()
    ga, gb = a.gradients(), b.gradients()
    for name in ga:
        assert np.array_equal(np.from_dlpack(ga[name]), np.from_dlpack(gb[name])), name


def test_bad_inputs_are_value_errors():
    m = tiny_model()
    vocab, seq = m.config.vocab_size, m.config.max_position_embeddings
    ids = np.zeros((2, 8), dtype=np.int32)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        m.forward(ids + vocab, ids)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        m.forward(np.zeros((1, seq + 1), dtype=np.int32), np.zeros((1, seq + 1), dtype=np.int32))
    with pytest.raises(ValueError, match="targets"):
        m.forward(ids, np.zeros((2, 7), dtype=np.int32))
    with pytest.raises(ValueError, match="int32 or int64"):
        m.forward(ids.astype(np.float32), ids)
    trainer = braid.Trainer(m, braid.AdamWConfig(), braid.LRSchedule(lr=1e-3, style="constant"))
    with pytest.raises(ValueError, match="num_microbatches"):
        trainer.train_step(np.zeros((3, 8), dtype=np.int32), np.zeros((3, 8), dtype=np.int32), 2)


def test_config_property_is_a_copy():
    m = tiny_model()
    cfg = m.config
    cfg.vocab_size = 7
    assert m.config.vocab_size != 7
