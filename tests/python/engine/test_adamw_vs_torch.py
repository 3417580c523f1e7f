"""braid's AdamW against torch.optim.AdamW.

1. The optimizer alone: ten steps of braid's Trainer, and torch.optim.AdamW fed braid's own
   gradients each step; parameters must agree to 1e-6 of their scale (same math in f32).
2. End to end: ten steps of braid against HF transformers + torch.optim.AdamW from the same
   weights on the same batches. Gradients differ in the last bits (different reduction
   orders), and AdamW's m / sqrt(v) amplifies that for near-zero gradients, so parameters
   agree to 1e-3 of their scale and losses to 1e-4 relative. eps = 1e-6 bounds that
   amplification to lr·|dg|/eps (with 1e-8 the worst parameter's error, 1.1e-3 of its scale on
   an AVX-512 machine, depended on which CPU computed the last bits).

Weight decay applies to linear weights (lm_head included) only: norms, biases and embeddings
are excluded, as braid does by default.
"""

import numpy as np
import pytest
import torch

import braid
from hf_oracle import batch, gpt2_pair, gpt2_to_braid, llama_pair

STEPS = 10
LR, WD, BETAS, EPS = 3e-3, 0.1, (0.9, 0.95), 1e-6


def torch_optimizer(named_parameters):
    decay, no_decay = [], []
    for name, p in named_parameters:
        excluded = name.endswith("bias") or "norm" in name or ".ln_" in name or "wte" in name \
            or "wpe" in name or "embed" in name
        (no_decay if excluded else decay).append(p)
    return torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS)


def run_both(hf, model, vocab, to_braid_names):
    trainer = braid.Trainer(model, braid.AdamWConfig(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                                     weight_decay=WD, clip_grad=0.0),
                            braid.LRSchedule(lr=LR, min_lr=LR, style="constant"))
    opt = torch_optimizer(hf.named_parameters())
    for step in range(STEPS):
        ids, targets = batch(vocab, seed=100 + step)
        stats = trainer.train_step(ids, targets)
        opt.zero_grad()
        loss = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids)).loss
        loss.backward()
        opt.step()
        assert abs(stats.loss - loss.item()) <= 1e-4 * abs(loss.item()), (step, stats.loss, loss.item())
    want = to_braid_names(hf)
    got = model.parameters()
    for name, w in want.items():
        w = w.detach().numpy()
        err = np.abs(np.from_dlpack(got[name]) - w).max() / max(np.abs(w).max(), 1e-6)
        assert err <= 1e-3, f"{name}: relative error {err:.2e} after {STEPS} steps"


def test_gpt2_ten_steps():
    hf, model = gpt2_pair()
    hf.train()
    run_both(hf, model, 97, lambda m: gpt2_to_braid(m, 2, 64))


@pytest.mark.parametrize("kv_heads", [2])
def test_llama_ten_steps(kv_heads):
    hf, model = llama_pair(kv_heads=kv_heads)
    hf.train()
    run_both(hf, model, 97, lambda m: dict(m.named_parameters()))


def test_gradient_accumulation_equals_one_big_batch():
    _, a = llama_pair(seed=5)
    _, b = llama_pair(seed=5)
    ids, targets = batch(97, b=4, seed=9)
    for model, micro in ((a, 1), (b, 2)):
        t = braid.Trainer(model, braid.AdamWConfig(lr=1e-3, clip_grad=0.0), braid.LRSchedule(lr=1e-3, style="constant"))
        t.train_step(ids, targets, num_microbatches=micro)
    pa, pb = a.parameters(), b.parameters()
    for name in pa:
        np.testing.assert_allclose(np.from_dlpack(pa[name]), np.from_dlpack(pb[name]), rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("pair", [gpt2_pair, llama_pair])
def test_optimizer_alone_matches_torch_on_the_same_gradients(pair):
    _, model = pair()
    trainer = braid.Trainer(model, braid.AdamWConfig(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS,
                                                     weight_decay=WD, clip_grad=0.0),
                            braid.LRSchedule(lr=LR, min_lr=LR, style="constant"))
    params = {n: torch.tensor(np.from_dlpack(t), requires_grad=True) for n, t in model.parameters().items()}
    opt = torch_optimizer(params.items())
    grads = model.gradients()
    for step in range(STEPS):
        ids, targets = batch(97, seed=200 + step)
        trainer.train_step(ids, targets)  # leaves this step's gradients in the buffer
        for n, p in params.items():
            p.grad = torch.tensor(np.from_dlpack(grads[n]))
        opt.step()
        for n, t in model.parameters().items():
            w = params[n].detach().numpy()
            err = np.abs(np.from_dlpack(t) - w).max() / max(np.abs(w).max(), 1e-6)
            assert err <= 1e-6, f"step {step} {n}: relative error {err:.2e}"


def test_hand_written_loop_equals_trainer():
    _, a = llama_pair(seed=4)
    _, b = llama_pair(seed=4)
    cfg = braid.AdamWConfig(lr=1e-3, weight_decay=0.1, clip_grad=0.5)
    trainer = braid.Trainer(a, cfg, braid.LRSchedule(lr=1e-3, min_lr=1e-3, style="constant"))
    opt = braid.AdamW(b, cfg)
    for step in range(3):
        ids, targets = batch(97, seed=300 + step)
        stats = trainer.train_step(ids, targets)
        b.zero_grad()
        loss = b.forward(ids, targets)
        b.backward()
        norm = opt.step(1e-3)
        assert loss == stats.loss and norm == stats.grad_norm
    assert opt.steps == 3
    for name, t in a.parameters().items():
        assert np.array_equal(np.from_dlpack(t), np.from_dlpack(b.parameters()[name])), name


def test_decay_embeddings_flag_and_config_errors():
    with pytest.raises(ValueError, match="beta2"):
        braid.AdamWConfig(beta2=1.5)
    models = []
    for flag in (False, True):
        _, m = llama_pair(seed=6)
        opt = braid.AdamW(m, braid.AdamWConfig(lr=1e-2, weight_decay=0.5, clip_grad=0.0,
                                               decay_embeddings=flag))
        m.zero_grad()  # zero gradients: only weight decay moves a parameter
        opt.step()
        models.append(m.parameters())
    off, on = models
    for name in off:
        same = np.array_equal(np.from_dlpack(off[name]), np.from_dlpack(on[name]))
        assert same == ("embed" not in name), name
