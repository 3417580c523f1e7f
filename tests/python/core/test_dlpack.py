"""Tensors cross into and out of braid through DLPack, zero-copy on the CPU."""

import numpy as np
import pytest
import torch

import braid


def test_numpy_in_and_out_share_memory():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = braid.from_dlpack(a)
    assert t.shape == [3, 4] and t.dtype == "f32" and t.device == "cpu"
    back = np.from_dlpack(t)
    a[1, 2] = 42.0  # one buffer: the change shows through both views
    assert back[1, 2] == 42.0
    assert back.__array_interface__["data"][0] == a.__array_interface__["data"][0]


def test_torch_in_and_out_share_memory():
    x = torch.arange(6, dtype=torch.int32)
    t = braid.from_dlpack(x)
    y = torch.from_dlpack(t)
    assert y.data_ptr() == x.data_ptr()
    x[0] = 7
    assert int(y[0]) == 7
    bf = torch.ones(4, dtype=torch.bfloat16)
    assert braid.from_dlpack(bf).dtype == "bf16"


def test_a_read_only_array_is_copied(tmp_path):
    # numpy exports no read-only array over DLPack 0.x: braid copies it (a memmap'd token file
    # is the usual case) and never hands out a writable view of that memory.
    np.save(tmp_path / "ids.npy", np.arange(16, dtype=np.int32).reshape(2, 8))
    ids = np.load(tmp_path / "ids.npy", mmap_mode="r")
    assert not ids.flags.writeable
    t = braid.from_dlpack(ids)
    assert t.shape == [2, 8] and np.array_equal(np.from_dlpack(t), ids)
    assert np.from_dlpack(t).__array_interface__["data"][0] != \
        ids.__array_interface__["data"][0]
    model = braid.GPTModel(braid.TransformerConfig.preset("gpt2-tiny"), device="cpu", seed=1)
    assert np.array_equal(np.from_dlpack(model.logits(ids)),
                          np.from_dlpack(model.logits(np.array(ids))))


def test_buffer_protocol_is_a_writable_view():
    t = braid.from_dlpack(np.zeros(4, dtype=np.float32))
    v = np.asarray(t)
    v[2] = 5.0
    assert np.from_dlpack(t)[2] == 5.0
    bits = np.asarray(braid.from_dlpack(torch.ones(2, dtype=torch.bfloat16)))
    assert bits.dtype == np.uint16 and bits[0] == 0x3F80


def test_tensor_outlives_its_producer():
    t = braid.from_dlpack(np.full(5, 3.0, dtype=np.float32))  # the array has no other reference
    assert np.from_dlpack(t).sum() == 15.0


def test_non_contiguous_and_unsupported_inputs_are_rejected():
    with pytest.raises(ValueError, match="not contiguous"):
        braid.from_dlpack(np.zeros((4, 4), dtype=np.float32)[:, ::2])
    with pytest.raises(ValueError, match="unsupported dtype"):
        braid.from_dlpack(np.zeros(3, dtype=np.float64))
    with pytest.raises(ValueError, match="DLPack"):
        braid.from_dlpack([1, 2, 3])


def test_parameters_are_views_into_the_model():
    cfg = braid.TransformerConfig.preset("llama-tiny")
    model = braid.GPTModel(cfg, device="cpu", seed=3)
    name = "model.norm.weight"
    w = np.asarray(model.parameters()[name])  # buffer protocol: a writable view
    w[:] = 2.5
    assert np.all(np.from_dlpack(model.parameters()[name]) == 2.5)
    flat = np.from_dlpack(model.flat_params)
    assert flat.size >= model.num_parameters()


def test_config_errors_are_value_errors():
    cfg = braid.TransformerConfig.preset("gpt2-tiny")
    cfg.num_attention_heads = 5
    with pytest.raises(ValueError, match="num_attention_heads|hidden_size"):
        cfg.validate()
    with pytest.raises(ValueError, match="preset"):
        braid.TransformerConfig.preset("gpt5")
    with pytest.raises(ValueError):
        cfg.normalization = "batchnorm"


def test_too_many_dims_is_a_value_error_and_keeps_no_reference():
    import sys
    a = np.zeros((1, 1, 1, 1, 1, 2), dtype=np.float32)
    before = sys.getrefcount(a)
    for _ in range(3):
        with pytest.raises(ValueError, match="at most 5"):
            braid.from_dlpack(a)
    assert sys.getrefcount(a) == before
