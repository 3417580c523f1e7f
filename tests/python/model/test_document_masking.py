"""Document masking (GPTModel.set_document_masking: Megatron's --reset-attention-mask and
--reset-position-ids) in one process, against running each document alone:

- with both flags, the logits of a packed sequence equal, document by document, the logits of
  each document run as a sequence of its own (1e-5), for rope (llama-tiny, GQA; qwen3-tiny with
  qk_layernorm) and learned positions (gpt2-tiny); the documents are the blocks of the mask and
  position ids megatron-core's own GPTDataset helper (_get_ltor_masks_and_position_ids) builds,
  so the EOD belongs to the document it ends, as in Megatron
- training: the packed microbatch's loss and every parameter gradient equal the token-weighted
  sum of the documents' own (1e-5)
- --reset-attention-mask alone keeps positions running over the sequence: attention stays inside
  each document (changing an earlier document's tokens changes none of a later one's logits);
  under rope, which is relative, every document still equals itself alone, while learned
  (absolute) positions make later documents differ; --reset-position-ids alone turns rope's
  keys and queries by their document's positions under the plain causal mask
- switching it off gives the ordinary causal model back, bit for bit; decode ignores it
- an EOD outside the vocabulary is a ValueError naming it
"""

import os

import numpy as np
import pytest

import braid

DEVICE = os.environ.get("BRAID_TEST_DEVICE", "cpu")
EOD = 7


def tiny(preset, seed=5):
    qk_norm = preset == "qwen3-tiny"
    cfg = braid.TransformerConfig.preset("llama-tiny" if qk_norm else preset)
    cfg.qk_layernorm = qk_norm
    cfg.hidden_dropout = 0.0
    return braid.GPTModel(cfg, device=DEVICE, seed=seed)


def packed_row(lengths, seed):
    """One sequence of documents of the given lengths, each ending with EOD (the last one may
    be cut off before its EOD, as a packed sample is)."""
    rng = np.random.default_rng(seed)
    row = []
    for n in lengths:
        doc = rng.integers(8, 256, size=n).tolist()  # ids 8.. never the EOD
        row += doc + [EOD]
    return np.array(row[:-1], dtype=np.int32)  # the last document runs to the end


def megatron_documents(row):
    """[start, end) of each document, read from megatron-core's own attention mask and
    position ids of `row` (its GPTDataset's helper, reset_* both on)."""
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
    mask, _, positions = _get_ltor_masks_and_position_ids(
        torch.from_numpy(row.astype(np.int64)), EOD, True, True, False, True)
    seen = ~mask[0].numpy()  # True: the query (row) sees the key (column)
    positions = positions.numpy()
    starts = [int(i) for i in np.flatnonzero(positions == 0)]
    bounds = list(zip(starts, starts[1:] + [len(row)]))
    for a, e in bounds:  # the mask's blocks are exactly these documents, causal inside
        want = np.zeros((len(row), len(row)), dtype=bool)
        want[a:e, a:e] = np.tril(np.ones((e - a, e - a), dtype=bool))
        np.testing.assert_array_equal(seen[a:e], want[a:e])
    return bounds


def logits(model, ids):
    return np.from_dlpack(model.logits(np.ascontiguousarray(ids, dtype=np.int32)))


@pytest.mark.parametrize("preset", ["llama-tiny", "qwen3-tiny", "gpt2-tiny"])
def test_each_document_of_a_packed_sequence_is_computed_as_if_alone(preset):
    model = tiny(preset)
    rows = np.stack([packed_row([9, 20, 1, 30, 36], seed=1), packed_row([60, 39], seed=2)])
    model.set_document_masking(EOD, reset_attention_mask=True, reset_position_ids=True)
    got = logits(model, rows)
    documents = 0
    for r, row in enumerate(rows):
        for a, e in megatron_documents(row):
            alone = logits(model, row[None, a:e])[0]
            np.testing.assert_allclose(got[r, a:e], alone, rtol=0, atol=1e-5,
                                       err_msg=f"row {r} document [{a}, {e})")
            documents += 1
    assert documents == 7
    model.set_document_masking(EOD, reset_attention_mask=False, reset_position_ids=False)
    plain = logits(model, rows)
    assert np.abs(plain - got).max() > 1e-2  # the masking changed the later documents
    np.testing.assert_array_equal(plain, logits(tiny(preset), rows))  # off: the causal model


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_packed_loss_and_gradients_are_the_documents_weighted_sum(preset):
    row = packed_row([11, 25, 6, 21], seed=3)
    targets = np.roll(row, -1)
    targets[-1] = -1
    bounds = [(0, 12), (12, 38), (38, 45), (45, len(row))]
    assert [int(row[e - 1]) for _, e in bounds[:-1]] == [EOD] * 3

    def loss_and_grads(model, ids, tgt):
        model.zero_grad()
        loss = model.forward(ids[None].copy(), tgt[None].copy())
        model.backward()
        return loss, np.from_dlpack(model.flat_grads).copy()

    model = tiny(preset)
    model.set_document_masking(EOD, reset_attention_mask=True, reset_position_ids=True)
    loss, grads = loss_and_grads(model, row, targets)
    count = int((targets >= 0).sum())
    want_loss, want_grads = 0.0, np.zeros_like(grads)
    for a, e in bounds:
        tgt = targets[a:e].copy()
        tgt[-1] = -1 if e == len(row) else tgt[-1]  # the last token's target is cut off
        n = int((tgt >= 0).sum())
        part_loss, part_grads = loss_and_grads(model, row[a:e], tgt)
        want_loss += part_loss * n / count
        want_grads += part_grads * n / count
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grads, want_grads, rtol=0, atol=1e-5 * np.abs(want_grads).max())


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_attention_mask_alone_keeps_positions_running_but_attention_inside(preset):
    model = tiny(preset)
    row = packed_row([10, 30], seed=4)  # documents [0, 11) and [11, 41)
    model.set_document_masking(EOD, reset_attention_mask=True, reset_position_ids=False)
    got = logits(model, row[None])[0]
    np.testing.assert_allclose(got[:11], logits(model, row[None, :11])[0], rtol=0, atol=1e-5)
    later = np.abs(got[11:] - logits(model, row[None, 11:])[0]).max()
    if preset == "llama-tiny":  # rope is relative: shifting a whole document changes nothing
        assert later < 1e-5, later
    else:  # learned positions are absolute
        assert later > 1e-3, later
    other = row.copy()
    other[:10] = np.random.default_rng(9).integers(8, 256, size=10)
    np.testing.assert_allclose(logits(model, other[None])[0][11:], got[11:], rtol=0, atol=1e-5)


def test_position_ids_alone_restart_rope_under_the_causal_mask():
    model = tiny("llama-tiny")
    row = packed_row([10, 30], seed=4)
    plain = logits(model, row[None])[0]
    model.set_document_masking(EOD, reset_attention_mask=False, reset_position_ids=True)
    got = logits(model, row[None])[0]
    np.testing.assert_array_equal(got[:11], plain[:11])  # the first document's positions
    assert np.abs(got[11:] - plain[11:]).max() > 1e-3  # later ones see earlier keys, turned


def test_decode_treats_the_prompt_as_one_document():
    model = tiny("llama-tiny")
    row = packed_row([6, 9], seed=6)
    want = logits(model, row[None])
    model.set_document_masking(EOD, reset_attention_mask=True, reset_position_ids=True)
    cache = model.kv_cache(1)
    np.testing.assert_allclose(np.from_dlpack(model.decode(row[None].copy(), cache)), want,
                               rtol=0, atol=1e-5)


def test_an_eod_outside_the_vocabulary_is_refused():
    model = tiny("llama-tiny")
    with pytest.raises(ValueError, match="end-of-document token 256 is not in the vocabulary "
                                         r"\[0, 256\)"):
        model.set_document_masking(256, reset_attention_mask=True, reset_position_ids=False)
    model.set_document_masking(-1, reset_attention_mask=False, reset_position_ids=False)  # off
