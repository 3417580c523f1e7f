"""PyTorch interop: torch batches go in (in place when int32 and contiguous, otherwise one int32
copy), logits, parameters and gradients come out as torch tensors sharing braid's memory, and
examples/torch_dataloader.py trains from a torch DataLoader."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import braid

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
EXAMPLE = os.path.join(REPO, "examples", "torch_dataloader.py")


# On the GPU machine (BRAID_TEST_DEVICE=cuda, scripts/gpu_check.sh) a missing CUDA is a failure.
needs_cuda = pytest.mark.skipif(
    os.environ.get("BRAID_TEST_DEVICE") != "cuda"
    and not (braid.cuda_available() and torch.cuda.is_available()),
    reason="needs braid and torch with CUDA")


def tiny_model(seed: int = 7, device: str = "cpu") -> braid.GPTModel:
    return braid.GPTModel(braid.TransformerConfig.preset("gpt2-tiny"), device=device, seed=seed)


def token_rows(n: int, length: int, seed: int = 0) -> torch.Tensor:
    """int64 rows of random byte tokens, as a torch pipeline typically makes them."""
    return torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def extra_peak_bytes(model: braid.GPTModel, ids) -> int:
    """What model.logits(ids) adds to braid's CPU allocator at its peak."""
    braid.reset_peak_memory("cpu")
    base = braid.memory_stats("cpu")["current_bytes"]
    model.logits(ids)
    return braid.memory_stats("cpu")["peak_bytes"] - base


def test_int32_batches_are_used_in_place_and_int64_costs_one_copy():
    # The token conversion allocates through braid's allocator only when it copies, so the
    # allocator's peak tells the paths apart: an int32 torch batch adds nothing over a braid
    # tensor, an int64 or strided batch exactly one int32 copy of the ids.
    model = tiny_model()
    rows = token_rows(8, 33)
    ids32 = rows[:, :32].to(torch.int32).contiguous()
    assert braid.from_dlpack(ids32).dtype == "i32"
    copy_bytes = ids32.numel() * 4
    reference = extra_peak_bytes(model, braid.from_dlpack(ids32.clone()))
    assert extra_peak_bytes(model, ids32) == reference
    assert extra_peak_bytes(model, ids32.to(torch.int64)) == reference + copy_bytes
    strided = rows.to(torch.int32)[:, 1:]  # batch[:, 1:], the usual targets slice
    assert not strided.is_contiguous()
    assert extra_peak_bytes(model, strided) == reference + copy_bytes
    # In place means the same memory: a braid tensor made from the batch is a view of it.
    view = np.from_dlpack(braid.from_dlpack(ids32))
    assert view.ctypes.data == ids32.data_ptr()
    ids32[0, 0] = 99
    assert view[0, 0] == 99


def test_dataloader_batches_train_bit_identically_to_numpy_batches():
    rows = token_rows(64, 33, seed=1)
    loader = DataLoader(TensorDataset(rows), batch_size=8, shuffle=False)
    schedule = braid.LRSchedule(lr=1e-3, warmup_iters=0, decay_iters=0, style="constant")
    optimizer = braid.AdamWConfig(lr=1e-3)
    from_torch, from_numpy = tiny_model(), tiny_model()
    trainers = [braid.Trainer(m, optimizer, schedule) for m in (from_torch, from_numpy)]
    losses_torch, losses_numpy = [], []
    for (batch,) in loader:
        assert batch.dtype == torch.int64
        # int64, and both slices strided views of the batch: the copies braid makes
        losses_torch.append(trainers[0].train_step(batch[:, :-1], batch[:, 1:], 2).loss)
        host = batch.numpy().astype(np.int32)
        ids, targets = np.ascontiguousarray(host[:, :-1]), np.ascontiguousarray(host[:, 1:])
        losses_numpy.append(trainers[1].train_step(ids, targets, 2).loss)
    assert len(losses_torch) == 8
    assert losses_torch == losses_numpy  # bit-identical, step by step
    trained = np.from_dlpack(from_torch.flat_params)
    assert np.array_equal(trained, np.from_dlpack(from_numpy.flat_params))
    assert not np.array_equal(trained, np.from_dlpack(tiny_model().flat_params))


def test_logits_are_a_torch_view_of_braids_output():
    model = tiny_model()
    rows = token_rows(4, 33, seed=2)
    ids, targets = rows[:, :-1], rows[:, 1:]
    out = model.logits(ids)
    logits = torch.from_dlpack(out)
    assert logits.shape == (4, 32, 256) and logits.dtype == torch.float32
    assert logits.data_ptr() == np.from_dlpack(out).ctypes.data  # one buffer, no copy
    expected = np.from_dlpack(model.logits(np.ascontiguousarray(ids.numpy(), dtype=np.int32)))
    assert np.array_equal(logits.numpy(), expected)
    # torch's cross-entropy over braid's logits is braid's loss; -1 (and torch's -100) ignored
    targets = targets.clone()
    targets[:, :8] = -100
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    braid_loss = torch.tensor(model.forward(ids, targets))
    torch.testing.assert_close(loss, braid_loss, rtol=1e-5, atol=1e-6)


def test_parameter_and_gradient_views_share_braids_memory():
    model = tiny_model()
    params = {name: torch.from_dlpack(t) for name, t in model.parameters().items()}
    grads = {name: torch.from_dlpack(t) for name, t in model.gradients().items()}
    assert params.keys() == grads.keys()
    assert sum(p.numel() for p in params.values()) == model.num_parameters()
    flat = np.from_dlpack(model.flat_params)
    assert params["model.embed_tokens.weight"].data_ptr() == flat.ctypes.data

    rows = token_rows(4, 33, seed=3)
    ids, targets = rows[:, :-1], rows[:, 1:]
    model.zero_grad()
    loss = model.forward(ids, targets)
    model.backward()
    assert loss > 4.0
    assert grads["model.norm.weight"].abs().sum() > 0  # backward wrote through the view
    model.zero_grad()
    assert all(bool((g == 0).all()) for g in grads.values())

    # Writes through torch change the model: with the final norm's scale and shift zeroed the
    # hidden states are zero, so are the (tied-embedding) logits, and the loss is log(V).
    with torch.no_grad():
        params["model.norm.weight"].zero_()
        params["model.norm.bias"].mul_(0.0)
    zeroed = model.forward(ids, targets, 1)
    assert zeroed != pytest.approx(loss, abs=1e-3)
    assert zeroed == pytest.approx(np.log(256.0), rel=1e-6)
    assert not torch.from_dlpack(model.logits(ids)).any()


def test_parameter_views_follow_training():
    model = tiny_model()
    schedule = braid.LRSchedule(lr=1e-2, style="constant")
    trainer = braid.Trainer(model, braid.AdamWConfig(lr=1e-2), schedule)
    weight = torch.from_dlpack(model.parameters()["model.layers.0.mlp.up_proj.weight"])
    before = weight.clone()
    rows = token_rows(4, 17, seed=4)
    trainer.train_step(rows[:, :-1], rows[:, 1:])
    assert not torch.equal(weight, before)  # the view taken before the step sees the update


def test_strided_batches_read_like_their_contiguous_copies():
    model = tiny_model()
    columns = token_rows(16, 4, seed=6)  # [S, B]: its transpose has strides (1, 16)
    expected = np.from_dlpack(model.logits(columns.t().contiguous().to(torch.int32)))
    for ids in (columns.t(), columns.to(torch.int32).t()):  # int64 and int32, transposed
        assert not ids.is_contiguous()
        assert np.array_equal(np.from_dlpack(model.logits(ids)), expected)
    every_other = token_rows(4, 32, seed=7)[:, ::2]  # strides (32, 2)
    assert np.array_equal(np.from_dlpack(model.logits(every_other)),
                          np.from_dlpack(model.logits(every_other.contiguous())))


def test_bad_token_inputs_are_value_errors():
    model = tiny_model()
    with pytest.raises(ValueError, match="ids must be int32 or int64, got f32"):
        model.logits(torch.zeros(2, 4))
    big = torch.zeros(2, 4, dtype=torch.int64)
    big[1, 2] = 2**40
    with pytest.raises(ValueError, match=r"ids\[6\] = 1099511627776 does not fit in int32"):
        model.logits(big)
    with pytest.raises(ValueError, match=r"targets\[0\] = -4294967296 does not fit"):
        model.forward(torch.zeros(1, 4, dtype=torch.int32), torch.full((1, 4), -2**32))


@needs_cuda
def test_cuda_torch_batches_train_like_host_batches():
    rows = token_rows(16, 33, seed=5)
    schedule = braid.LRSchedule(lr=1e-3, style="constant")
    models = [tiny_model(device="cuda") for _ in range(3)]
    trainers = [braid.Trainer(m, braid.AdamWConfig(lr=1e-3), schedule) for m in models]
    host = rows.numpy().astype(np.int32)
    batches = [
        (np.ascontiguousarray(host[:, :-1]), np.ascontiguousarray(host[:, 1:])),  # numpy
        (rows[:, :-1].to(torch.int32).contiguous().cuda(),  # CUDA int32: used in place
         rows[:, 1:].to(torch.int32).contiguous().cuda()),
        (rows[:, :-1].contiguous().cuda(), rows[:, 1:].contiguous().cuda()),  # CUDA int64
    ]
    losses = [[t.train_step(*b).loss for _ in range(3)] for t, b in zip(trainers, batches)]
    # Same tokens, same device: equal up to the GPU's run-to-run reduction order (a wrong or
    # unordered hand-over would change the loss in its first digits).
    for other in losses[1:]:
        np.testing.assert_allclose(other, losses[0], rtol=1e-5)
    ids = batches[1][0]
    view = braid.from_dlpack(ids)
    assert view.device == "cuda:0" and torch.from_dlpack(view).data_ptr() == ids.data_ptr()
    weight = torch.from_dlpack(models[1].parameters()["model.norm.weight"])
    assert weight.device.type == "cuda"
    logits = torch.from_dlpack(models[1].logits(ids))
    torch.testing.assert_close(logits, torch.from_dlpack(models[0].logits(batches[0][0])),
                               rtol=1e-4, atol=1e-4)


@needs_cuda
def test_cuda_batch_written_on_a_side_stream_is_read_after_the_write():
    # braid asks torch for the batch on the legacy default stream (DLPack stream=1), so torch
    # makes that stream wait for the side stream's write, which lands ~30 ms late here.
    model = tiny_model(device="cuda")
    rows = token_rows(4, 32, seed=8).to(torch.int32)
    expected = np.from_dlpack(model.logits(rows))
    source = rows.cuda()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ids = torch.zeros_like(source)
        torch.cuda._sleep(50_000_000)
        ids.copy_(source)
        logits = np.from_dlpack(model.logits(ids))
    np.testing.assert_allclose(logits, expected, rtol=1e-4, atol=1e-4)


def test_example_trains_from_a_torch_dataloader():
    result = subprocess.run(
        [sys.executable, EXAMPLE, "--steps", "60", "--log-interval", "20", "--int64",
         "--eval-problems", "64"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [os.path.join(REPO, "python"), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr
    losses = [float(x) for x in re.findall(r"^step +\d+ +loss ([0-9.]+)", result.stdout, re.M)]
    assert len(losses) == 4, result.stdout  # steps 1, 20, 40, 60
    assert losses[-1] < losses[0] - 2.0, result.stdout  # from about ln 256 = 5.5
    assert "int64 batches" in result.stdout
    held_out = re.search(r"held-out: loss ([0-9.]+)", result.stdout)
    assert held_out and float(held_out.group(1)) < 4.0, result.stdout
