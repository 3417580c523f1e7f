"""braid against Hugging Face transformers (CPU, f32) with identical weights: logits, loss and
every parameter gradient of GPT2LMHeadModel, LlamaForCausalLM, Qwen2ForCausalLM (also with
sliding-window layers), Qwen3ForCausalLM, MistralForCausalLM (sliding windows), StableLM and
Nemotron.

Tolerances: f32 with different summation orders (OpenBLAS vs MKL-DNN GEMMs, flash-style vs
materialised softmax). Logits agree to ~1e-6 relative; gradients, which sum over all tokens,
to 1e-4 relative to the largest entry of each tensor.
"""

import numpy as np
import pytest
import torch

from hf_oracle import (assert_close_rel, batch, braid_grads, gpt2_grads_in_braid_names, gpt2_pair,
                       llama_pair, mistral_pair, nemotron_pair, qwen2_pair, qwen3_pair,
                       stablelm_pair)

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def check_forward(hf, model, vocab):
    ids, targets = batch(vocab)
    logits = np.from_dlpack(model.logits(ids))
    with torch.no_grad():
        want = hf(torch.from_numpy(ids)).logits.numpy()
    assert logits.shape == want.shape
    assert_close_rel("logits", logits, want, LOGITS_RTOL)
    return ids, targets


def check_loss_and_gradients(hf, model, want_grads):
    """Forward + backward in both; `want_grads(hf)` gives HF's gradients under braid's names."""
    ids, targets = check_forward(hf, model, 97)
    loss = model.forward(ids, targets)
    model.backward()
    out = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids))
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (loss, out.loss.item())
    got = braid_grads(model)
    for name, g in want_grads(hf).items():
        assert_close_rel(name, got[name], g.numpy(), GRAD_RTOL)


def test_gpt2_logits_loss_and_gradients():
    hf, model = gpt2_pair()
    check_loss_and_gradients(hf, model, lambda m: gpt2_grads_in_braid_names(m, 2, 64))


@pytest.mark.parametrize("kv_heads,tie", [(2, False), (4, False), (1, True)])
def test_llama_logits_loss_and_gradients(kv_heads, tie):
    hf, model = llama_pair(kv_heads=kv_heads, tie=tie)
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


def test_llama3_rope_scaling_logits_loss_and_gradients():
    # Llama 3.1's RoPE scaling (rope_type llama3): kept, blended and slowed frequencies.
    hf, model = llama_pair(llama3_rope=True)
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})
    _, plain = llama_pair()  # the same weights without the scaling: other logits
    ids, _ = batch(97)
    assert not np.allclose(np.from_dlpack(plain.logits(ids)), np.from_dlpack(model.logits(ids)),
                           rtol=1e-3)


def test_linear_rope_interpolation_logits_loss_and_gradients():
    # Linear position interpolation (rope_type linear, Megatron's
    # --rotary-seq-len-interpolation-factor): HF's inv_freq / factor, by a factor whose division
    # rounds (2.5), so the arithmetic itself is compared.
    hf, model = llama_pair(linear_rope=2.5)
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})
    _, plain = llama_pair()
    ids, _ = batch(97)
    assert not np.allclose(np.from_dlpack(plain.logits(ids)), np.from_dlpack(model.logits(ids)),
                           rtol=1e-3)


def test_zero_centered_norms_are_llamas_with_one_added():
    # --apply-layernorm-1p: braid's norm weights hold HF's minus one and scale by 1 + weight;
    # the logits, the loss and every gradient (d/dw of 1 + w is 1) are HF Llama's.
    hf, model = llama_pair(zero_centered_gamma=True)
    norm = np.from_dlpack(model.parameters()["model.norm.weight"])
    want = hf.model.norm.weight.detach().numpy() - 1.0
    np.testing.assert_array_equal(norm, want.astype(np.float32))
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


def test_qwen2_logits_loss_and_gradients():
    # Biases on q, k and v alone (add_qkv_bias), tied embeddings, rope_theta 1e6.
    hf, model = qwen2_pair()
    names = [n for n, _ in hf.named_parameters()]
    assert any(n.endswith("q_proj.bias") for n in names) and not any(
        n.endswith("o_proj.bias") for n in names)
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


@pytest.mark.parametrize("sliding_window", [2, 5, 12])
def test_mistral_sliding_window_logits_loss_and_gradients(sliding_window):
    # Every layer attends to the last `sliding_window` positions, its own among them (HF's
    # count; braid's window_size is one less), over 16-token sequences: 2 is a token and the one
    # before it.
    hf, model = mistral_pair(sliding_window=sliding_window)
    assert model.config.window_size == sliding_window - 1
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


def test_qwen2_sliding_window_layers_logits_loss_and_gradients():
    # use_sliding_window: layers from max_window_layers (1) on attend in the window, the first
    # attends to everything (braid's window_layers [0, 1, 1]).
    hf, model = qwen2_pair(layers=3, sliding_window=4, max_window_layers=1)
    assert hf.config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert list(model.config.window_layers) == [0, 1, 1]
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


def test_qwen3_logits_loss_and_gradients():
    # An RMSNorm on each query and key head before RoPE (qk_layernorm): q_norm, k_norm.
    hf, model = qwen3_pair()
    assert any(n.endswith("self_attn.q_norm.weight") for n, _ in hf.named_parameters())
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


def test_qwen3_wide_heads_logits_loss_and_gradients():
    # Qwen3-0.6B's shape in small: heads twice hidden / heads wide (kv_channels), so the
    # queries and the attention output are 2x the hidden size and o_proj narrows them back.
    hf, model = qwen3_pair(head_dim=32)
    assert model.config.head_dim == 32
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


@pytest.mark.parametrize("partial", [0.25, 0.5])
def test_stablelm_partial_rotary_logits_loss_and_gradients(partial):
    # RoPE on a quarter (StableLM's default) or half of each head, LayerNorms with biases, q/k/v
    # biases: what rotary_percent, layernorm and add_qkv_bias compute is HF's StableLM.
    hf, model = stablelm_pair(partial=partial)
    assert model.config.rotary_dim == int(16 * partial)
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


@pytest.mark.parametrize("bias", [False, True])
def test_nemotron_logits_loss_and_gradients(bias):
    # Nemotron-4: LayerNorm1P (zero_centered_gamma), squared ReLU, RoPE on half of each head.
    hf, model = nemotron_pair(bias=bias)
    assert model.config.activation == "squared_relu"
    check_loss_and_gradients(hf, model, lambda m: {n: p.grad for n, p in m.named_parameters()})


def test_ignored_targets_match_hf_ignore_index():
    hf, model = llama_pair()
    ids, targets = batch(97, seed=3)
    targets[:, :5] = -1
    labels = torch.from_numpy(ids).clone()
    labels[:, 1:6] = -100  # HF shifts labels inside; these mask the same positions
    loss = model.forward(ids, targets)
    model.backward()
    want = hf(torch.from_numpy(ids), labels=labels).loss.item()
    assert abs(loss - want) <= 1e-5 * abs(want)
