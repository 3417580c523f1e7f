"""braid's mixture-of-experts layers against Hugging Face transformers (CPU, f32) with identical
weights: logits, loss and every parameter gradient of MixtralForCausalLM (softmax over the top
k logits), Qwen3MoeForCausalLM (norm_topk_prob true: the same router; false: the top k of a
softmax over all experts, braid's moe_router_pre_softmax) and Qwen2MoeForCausalLM (q, k, v
biases and a shared expert scaled by its sigmoid gate, under either router), also with dense
layers among the expert ones (Qwen3-MoE's mlp_only_layers, Qwen2-MoE's decoder_sparse_step:
braid's moe_layers); and the load-balancing loss against megatron-core's own
switch_load_balancing_loss_func.

Both sides must choose the same experts: the tests check on HF's router logits that no token's
k-th and (k+1)-th experts are near a tie (braid's logits agree to ~1e-6) and that every expert
of every layer is chosen (so every expert's gradient is compared). Tolerances as
test_hf_oracle.py's.
"""

import warnings

import numpy as np
import pytest
import torch

from hf_oracle import (assert_close_rel, batch, braid_grads, experts_to_braid, mixtral_pair,
                       qwen2_moe_pair, qwen3_moe_pair)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func

LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4
MARGIN = 1e-3  # the least gap between a token's k-th and (k+1)-th router logits


# Dense layers among expert ones: layer 0 dense (Qwen3-MoE's mlp_only_layers, DeepSeek-style),
# and layers 0 and 2 dense around layer 1's experts (Qwen2-MoE's decoder_sparse_step 2).
# (the pair's fields, the layers with experts)
DENSE = {"qwen3_moe-norm-topk-mlp-only-layers": ({"layers": 3, "mlp_only_layers": [0]}, [1, 2]),
         "qwen2_moe-softmax-first-sparse-step-2": ({"layers": 3, "decoder_sparse_step": 2}, [1])}


def pair(kind, **fields):
    if kind == "mixtral":
        return mixtral_pair(**fields)
    make = qwen2_moe_pair if kind.startswith("qwen2_moe") else qwen3_moe_pair
    return make(norm_topk_prob="norm-topk" in kind, **DENSE.get(kind, ({},))[0], **fields)


KINDS = ["mixtral", "qwen3_moe-norm-topk", "qwen3_moe-softmax-first", "qwen2_moe-softmax-first",
         "qwen2_moe-norm-topk", *DENSE]


def expert_layers(hf):
    return [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]


def hf_forward(hf, ids):
    """HF's logits, lm loss (labels = ids, shifted inside) and router logits [T, E] of each
    layer with experts."""
    out = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids), output_router_logits=True)
    assert len(out.router_logits) == len(expert_layers(hf))
    return out


def check_routing(router_logits, experts, topk):
    """The top k is decisive on every layer and every expert is chosen; returns the choices."""
    chosen = []
    for layer, logits in enumerate(router_logits):
        top = torch.topk(logits.detach(), topk + 1, dim=-1).values
        gap = (top[:, topk - 1] - top[:, topk]).min().item()
        assert gap > MARGIN, f"layer {layer}: a near tie in the router's top {topk} ({gap:.1e})"
        picks = torch.topk(logits.detach(), topk, dim=-1).indices
        counts = torch.bincount(picks.reshape(-1), minlength=experts)
        assert (counts > 0).all(), f"layer {layer}: experts chosen {counts.tolist()}"
        chosen.append(picks)
    return chosen


def hf_grads(hf, experts, ffn=48):
    return experts_to_braid({n: p.grad for n, p in hf.named_parameters()}, experts, ffn)


def compare_gradients(model, hf, experts, scale=1.0):
    got = braid_grads(model)
    want = hf_grads(hf, experts)
    assert sorted(got) == sorted(want)
    return max(assert_close_rel(name, got[name], scale * g.numpy(), GRAD_RTOL)
               for name, g in want.items())


@pytest.mark.parametrize("kind", KINDS)
def test_logits_loss_and_gradients(kind):
    hf, model = pair(kind)
    ids, targets = batch(97)
    out = hf_forward(hf, ids)
    check_routing(out.router_logits, 4, 2)
    logits = np.from_dlpack(model.logits(ids))
    assert logits.shape == out.logits.shape
    assert_close_rel("logits", logits, out.logits.detach().numpy(), LOGITS_RTOL)
    loss = model.forward(ids, targets)
    model.backward()
    out.loss.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (loss, out.loss.item())
    compare_gradients(model, hf, 4)
    assert model.take_moe_losses()[0] == 0.0  # moe_aux_loss_coeff 0: none computed
    grads = braid_grads(model)
    if kind.startswith("qwen2_moe"):  # the shared expert and its gate were compared
        for name in ("model.layers.1.mlp.shared_expert.down_proj.weight",
                     "model.layers.1.mlp.shared_expert_gate.weight",
                     "model.layers.1.self_attn.k_proj.bias"):
            assert np.abs(grads[name]).max() > 0, name
    assert expert_layers(hf) == DENSE.get(kind, (None, [0, 1]))[1]
    for i in range(hf.config.num_hidden_layers):  # dense layers: their MLP of intermediate_size
        if i not in expert_layers(hf):
            assert grads[f"model.layers.{i}.mlp.down_proj.weight"].shape == (64, 256)
            assert np.abs(grads[f"model.layers.{i}.mlp.gate_proj.weight"]).max() > 0


@pytest.mark.parametrize("qwen", ["qwen3_moe", "qwen2_moe"])
def test_router_kinds_differ(qwen):
    # The same weights under the two routers: renormalising the top k changes the output far
    # beyond the logits' tolerance, so the tests above tell them apart.
    ids, _ = batch(97)
    _, renormalised = pair(f"{qwen}-norm-topk")
    _, softmax_first = pair(f"{qwen}-softmax-first")
    a, b = np.from_dlpack(renormalised.logits(ids)), np.from_dlpack(softmax_first.logits(ids))
    assert np.abs(a - b).max() > 100 * LOGITS_RTOL * np.abs(a).max()



def megatron_aux_loss(router_logits, experts, topk, chosen):
    """sum over layers of megatron-core's Switch loss of one microbatch (coefficient 1): the
    softmax over all experts of each layer's logits, tokens_per_expert from the top k."""
    total = 0.0
    for logits, picks in zip(router_logits, chosen):
        probs = torch.softmax(logits.float(), dim=-1)
        counts = torch.bincount(picks.reshape(-1), minlength=experts).float()
        total = total + switch_load_balancing_loss_func(
            probs, counts, logits.shape[0], topk, experts, moe_aux_loss_coeff=1.0)
    return total


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe-softmax-first", "qwen2_moe-softmax-first",
                                  "qwen2_moe-softmax-first-sparse-step-2"])
def test_load_balancing_loss_and_its_gradients_are_megatrons(kind):
    # moe_aux_loss_coeff c: braid's gradients are those of lm loss + c x (the sum over the
    # layers with experts of megatron's aux_loss), T = the microbatch's 48 tokens;
    # take_moe_losses()[0] is that sum without c. backward(grad_scale=s) scales both
    # parts by s.
    coeff = 0.5
    hf, model = pair(kind, moe_aux_loss_coeff=coeff)
    ids, targets = batch(97)
    out = hf_forward(hf, ids)
    chosen = check_routing(out.router_logits, 4, 2)
    aux = megatron_aux_loss(out.router_logits, 4, 2, chosen)
    first = expert_layers(hf)[0]
    router = dict(hf.named_parameters())[f"model.layers.{first}.mlp.gate.weight"]
    aux_part, = torch.autograd.grad(coeff * aux, router, retain_graph=True)
    (out.loss + coeff * aux).backward()
    # The aux loss matters: its share of the router's gradient is far above the tolerance.
    assert aux_part.abs().max() > 100 * GRAD_RTOL * router.grad.abs().max()

    loss = model.forward(ids, targets)
    model.backward()
    assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item())  # the lm loss alone
    taken = model.take_moe_losses()[0]
    assert abs(taken - aux.item()) <= 1e-5 * aux.item(), (taken, aux.item())
    assert model.take_moe_losses()[0] == 0.0  # taken
    compare_gradients(model, hf, 4)

    model.zero_grad()
    model.forward(ids, targets)
    model.backward(grad_scale=0.5)
    compare_gradients(model, hf, 4, scale=0.5)
    assert abs(model.take_moe_losses()[0] - aux.item()) <= 1e-5 * aux.item()


def test_load_balancing_loss_sums_microbatches():
    # Two microbatches' backwards before one take: the sum of their losses, each over its own
    # tokens (T = 48 each, not 96).
    hf, model = pair("mixtral", moe_aux_loss_coeff=0.01)
    want = 0.0
    for mb, seed in enumerate((0, 1)):
        ids, targets = batch(97, seed=seed)
        out = hf_forward(hf, ids)
        want += megatron_aux_loss(out.router_logits, 4, 2,
                                  check_routing(out.router_logits, 4, 2)).item()
        model.forward(ids, targets, microbatch=mb)
    model.backward(microbatch=0)
    model.backward(microbatch=1)
    got = model.take_moe_losses()[0]
    assert abs(got - want) <= 1e-5 * want, (got, want)
