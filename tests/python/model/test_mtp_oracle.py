"""braid's multi-token prediction (DeepSeek-V3's MTP, megatron-core 0.16's
MultiTokenPredictionBlock and GPTModel._postprocess) against a plain PyTorch reference (CPU, f32)
on Hugging Face transformers' models with identical weights: the main loss, each depth's summed
cross-entropy and target count (take_mtp_losses) and every parameter gradient.

The reference: h_0 is HF's final-norm output (model.norm after the last layer; the LM head's
input). Depth k = 1..D reads the ids and targets shifted one further left than depth k - 1's
(megatron-core's roll_tensor: position p holds position p + k's, the last k positions get id 0
and no target), and computes
    h_k = shared_head.norm(layer(eh_proj([enorm(embed_tokens(ids_k)) | hnorm(h_{k-1})])))
with layer the HF decoder layer class of the model's last layer built as layer num_layers + k - 1
(DeepseekV3DecoderLayer: experts, as the last layer has them), under the plain causal mask and
RoPE positions 0..S-1 (megatron-core shifts position ids only for learned absolute positions,
which braid refuses with MTP; RoPE sees relative positions alone, which a shift keeps),
and its loss ce_k is the shared LM head's cross-entropy (lm_head, or embed_tokens when tied) on
the shifted targets. The objective
    J = main mean loss + mtp_loss_scaling_factor / D * sum_k (sum of ce_k) / N_main,
N_main the main loss's target count (megatron-core's calculate_per_token_loss: each depth's
per-token losses through MTPLossAutoScaler, divided like the main loss by its token count), is
what torch's autograd differentiates; braid's backward must give its gradient.

HF's model is built with num_layers + D decoder layers, the last D of which become the depths
(hf_oracle.add_mtp_depths): their parameters carry the names of HF DeepSeek-V3's MTP layer 61
(model.layers.{i}.enorm.weight, .hnorm, .eh_proj, .shared_head.norm, the decoder layer's own),
which are braid's, and load_into_braid checks that braid holds exactly these.

Models: Llama (2 layers, hidden 64; tied and untied embeddings) and test_hf_deepseek_v3_oracle.py's
DeepSeek-V3 (multi-latent attention, a dense first layer, then 8 experts in 4 groups with expert
biases, a shared expert, no token dropping), D = 1 and 2, targets with ignored (-1) runs in the
middle as well as the last position's. test_the_comparison_rejects_wrong_mtp checks that
reference variants with one plausible mistake each (the concatenation's order, the shift's
direction, unshifted targets, the hidden state before the final norm, the scale not divided by
D, each depth divided by its own count, the final norm for shared_head.norm) are rejected by far.
Tolerances as the other oracle tests'.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

import braid
from hf_oracle import (add_mtp_depths, batch, braid_grads, check_deepseek_routing,
                       deepseek_grads, deepseek_routers, eager_model, llama_pair,
                       load_deepseek_into_braid)
from test_hf_deepseek_v3_oracle import LAYERS as DEEPSEEK_LAYERS
from test_hf_deepseek_v3_oracle import braid_config as deepseek_braid_config
from test_hf_deepseek_v3_oracle import hf_config as deepseek_hf_config

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
MARGIN = 1e-3  # the least gap between a token's last chosen and first unchosen group or expert
VOCAB = 97
LLAMA_LAYERS = 2
SCALE = 0.3  # mtp_loss_scaling_factor other than the default, so that braid must read it


def llama_grads(hf):
    return {n: p.grad for n, p in hf.named_parameters()}


def llama_mtp_pair(depths, tie, scale=SCALE):
    hf, model = llama_pair(layers=LLAMA_LAYERS, tie=tie, mtp=depths,
                           mtp_loss_scaling_factor=scale)
    return hf, model, llama_grads


def deepseek_mtp_pair(depths, scale=SCALE, seed=2):
    """test_hf_deepseek_v3_oracle.py's q-latent model with `depths` MTP depths (each a layer with
    experts, as its last layer). Seed 2: no near tie in any layer's routing of batch(97) at
    D = 1 or 2 (seed 0 has one in the depth's layer)."""
    torch.manual_seed(seed)
    hf_cfg = deepseek_hf_config(num_hidden_layers=DEEPSEEK_LAYERS + depths)
    hf = eager_model(transformers.DeepseekV3ForCausalLM, hf_cfg)
    hf = deepseek_routers(add_mtp_depths(hf, DEEPSEEK_LAYERS))
    cfg = deepseek_braid_config(hf.config)
    cfg.mtp_num_layers, cfg.mtp_loss_scaling_factor = depths, scale
    model = braid.GPTModel(cfg, device="cpu", seed=1)
    load_deepseek_into_braid(model, hf)
    return hf, model, deepseek_grads


def with_ignored_targets(ids, targets):
    """Ignored runs in the middle, and one first position: each depth's count then falls by
    other than the batch size per shift."""
    targets = targets.copy()
    targets[0, 0] = -1
    targets[1, 6:9] = -1
    targets[2, 11] = -1
    return ids, targets


def shifted(x, fill, wrong_way=False):
    """x [B, S] one position left (megatron-core's roll_tensor(x, shifts=-1) with the vacated last
    position set): position p holds x[p + 1], the last `fill`. wrong_way: right instead."""
    pad = torch.full_like(x[:, :1], fill)
    return torch.cat([pad, x[:, :-1]], 1) if wrong_way else torch.cat([x[:, 1:], pad], 1)


def reference(hf, ids, targets, scale, wrong=()):
    """The reference's main mean loss, each depth's (sum of ce_k, its target count) and the router
    logits of each expert layer (the main layers', then the depths'); the gradients of J left in
    hf's .grad. `wrong`: names of mistakes to make (test_the_comparison_rejects_wrong_mtp)."""
    layers = hf.config.num_hidden_layers
    hf.zero_grad(set_to_none=True)
    routers = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "experts")]
    router_logits, before_norm = [], []
    hooks = [r.register_forward_hook(lambda m, i, out: router_logits.append(out[0].detach()))
             for r in routers]
    hooks.append(hf.model.norm.register_forward_hook(lambda m, i, out: before_norm.append(i[0])))

    def cross_entropy(hidden, t):  # per token, 0 where ignored
        return F.cross_entropy(hf.lm_head(hidden).flatten(0, 1), t.flatten(), ignore_index=-1,
                               reduction="none")

    try:
        ids, targets = torch.from_numpy(ids), torch.from_numpy(targets)
        main_targets, n_main = targets, (targets >= 0).sum()
        h = hf.model(ids).last_hidden_state  # h_0: model.norm's output, the LM head's input
        main = cross_entropy(h, targets).sum() / n_main
        if "hidden_before_final_norm" in wrong:
            h = before_norm[0]
        positions = torch.arange(ids.shape[1])[None]
        rope = hf.model.rotary_emb(h, positions)
        s = ids.shape[1]
        mask = torch.full((s, s), torch.finfo(torch.float32).min).triu(1)[None, None]
        losses, mtp = [], 0.0
        for depth in hf.model.layers[layers:]:
            ids = shifted(ids, 0, wrong_way="ids_shifted_right" in wrong)
            targets = main_targets if "targets_unshifted" in wrong else shifted(targets, -1)
            e = depth.enorm(hf.model.embed_tokens(ids))
            both = [depth.hnorm(h), e] if "concat_hidden_first" in wrong else [e, depth.hnorm(h)]
            x = depth(depth.eh_proj(torch.cat(both, -1)), attention_mask=mask,
                      position_ids=positions, position_embeddings=rope)
            wrong_norm = "final_norm_for_shared_head" in wrong
            h = (hf.model.norm if wrong_norm else depth.shared_head.norm)(x)
            ce, count = cross_entropy(h, targets).sum(), (targets >= 0).sum()
            losses.append((ce.item(), int(count)))
            mtp = mtp + (ce / count * n_main if "per_depth_count" in wrong else ce)
        factor = scale if "scale_not_over_depths" in wrong else scale / len(losses)
        (main + factor * mtp / n_main).backward()
    finally:
        for hook in hooks:
            hook.remove()
    return main.item(), losses, router_logits


def braid_step(model, ids, targets, grad_scale=1.0):
    """braid's main loss, MTP losses and gradients of one training step (forward, backward)."""
    loss = model.forward(ids, targets)
    model.backward(grad_scale=grad_scale)
    return loss, [(s, n) for s, n in model.take_mtp_losses()], braid_grads(model)


def errors(got, want, hf_grads, hf):
    """name -> (relative error, tolerance) of each quantity braid's step `got` and the
    reference's `want` (hf's gradients, hf_grads(hf) under braid's names) compare: the main
    loss, each depth's loss sum and count (inf error when they differ) and each gradient (max
    |error| over max |reference|)."""
    (loss, mtp, grads), (want_loss, want_mtp, _) = got, want
    out = {"main loss": (abs(loss - want_loss) / abs(want_loss), LOSS_RTOL)}
    assert len(mtp) == len(want_mtp), (len(mtp), len(want_mtp))
    for k, ((s, n), (want_s, want_n)) in enumerate(zip(mtp, want_mtp), 1):
        out[f"depth {k} loss sum"] = (abs(s - want_s) / abs(want_s), LOSS_RTOL)
        out[f"depth {k} count {n} vs {want_n}"] = (0.0 if n == want_n else np.inf, 0.0)
    want_grads = hf_grads(hf)
    assert sorted(grads) == sorted(want_grads)
    for name, g in want_grads.items():  # None: the reference left it out of J
        g = np.zeros(grads[name].shape) if g is None else g.numpy().astype(np.float64)
        out[name] = (np.abs(grads[name] - g).max() / max(np.abs(g).max(), 1e-6), GRAD_RTOL)
    return out


def over(errs):
    """How many times its tolerance the worst quantity misses by, and its name."""
    ratios = {n: (e / tol if tol else (0.0 if e == 0 else np.inf)) for n, (e, tol) in errs.items()}
    worst = max(ratios, key=ratios.get)
    return ratios[worst], worst


def check(hf, model, hf_grads, ids, targets, want):
    """braid's step on (ids, targets) against the reference's `want` (hf's gradients set): every
    quantity within its tolerance, every gradient non-zero. Returns the largest relative error
    of the losses and of the gradients."""
    got = braid_step(model, ids, targets)
    errs = errors(got, want, hf_grads, hf)
    bad = {n: f"{e:.2e} > {tol:.0e}" for n, (e, tol) in errs.items() if e > tol}
    assert not bad, f"braid and the reference differ: {bad}"
    for name, g in got[2].items():  # every parameter takes part
        assert np.abs(g).max() > 0, name
    losses = max(e for n, (e, tol) in errs.items() if tol == LOSS_RTOL)
    grads = max(e for n, (e, tol) in errs.items() if tol == GRAD_RTOL)
    return losses, grads


def test_config_defaults_are_megatrons():
    cfg = braid.TransformerConfig()
    assert cfg.mtp_num_layers == 0
    assert cfg.mtp_loss_scaling_factor == pytest.approx(0.1)


@pytest.mark.parametrize("depths", [1, 2])
@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("ignored", [False, True])
def test_llama_mtp_losses_and_gradients(depths, tie, ignored):
    hf, model, hf_grads = llama_mtp_pair(depths, tie)
    assert model.config.mtp_num_layers == depths and model.config.tie_embeddings == tie
    assert model.config.mtp_loss_scaling_factor == pytest.approx(SCALE)
    ids, targets = batch(VOCAB)
    if ignored:
        ids, targets = with_ignored_targets(ids, targets)
    want = reference(hf, ids, targets, SCALE)
    # depth k's targets: those of positions k.., fewer than the main loss's (so that the scale's
    # count, N_main, is told from each depth's own)
    counts = [int((targets[:, k:] >= 0).sum()) for k in range(1, depths + 1)]
    assert [n for _, n in want[1]] == counts
    assert all(n < int((targets >= 0).sum()) for n in counts)
    losses, grads = check(hf, model, hf_grads, ids, targets, want)
    print(f"D={depths} tie={tie} ignored={ignored}: losses {losses:.1e}, gradients {grads:.1e} "
          "(max relative error)")


@pytest.mark.parametrize("depths", [1, 2])
def test_deepseek_v3_mtp_losses_and_gradients(depths):
    hf, model, hf_grads = deepseek_mtp_pair(depths)
    experts = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert experts == list(range(1, DEEPSEEK_LAYERS + depths))  # the depths' layers have experts
    assert sorted(model.expert_biases()) == [f"model.layers.{i}.mlp.gate.e_score_correction_bias"
                                            for i in experts]
    ids, targets = with_ignored_targets(*batch(VOCAB))
    want = reference(hf, ids, targets, SCALE)
    # both sides choose the same experts: every expert layer's routing, the depths' too, is
    # clear of ties
    check_deepseek_routing(hf, want[2], MARGIN)
    losses, grads = check(hf, model, hf_grads, ids, targets, want)
    print(f"D={depths}: losses {losses:.1e}, gradients {grads:.1e} (max relative error)")


def test_mtp_losses_sum_over_training_forwards_and_reset():
    # take_mtp_losses sums the depths' losses of the training forwards since the last call, then
    # starts again from zero; logits() (inference) runs the main head alone and adds nothing.
    hf, model, _ = llama_mtp_pair(2, tie=False)
    a, b = batch(VOCAB, seed=1), with_ignored_targets(*batch(VOCAB, seed=2))
    model.forward(*a)
    model.backward()
    with torch.no_grad():
        want_logits = hf(torch.from_numpy(b[0])).logits.numpy()
    logits = np.from_dlpack(model.logits(b[0]))
    assert np.abs(logits - want_logits).max() <= LOSS_RTOL * np.abs(want_logits).max()
    model.forward(*b)
    model.backward()
    want = [(sa + sb, na + nb) for (sa, na), (sb, nb) in
            zip(reference(hf, *a, SCALE)[1], reference(hf, *b, SCALE)[1])]
    got = [(s, n) for s, n in model.take_mtp_losses()]
    assert [n for _, n in got] == [n for _, n in want]
    for (s, _), (want_s, _) in zip(got, want):
        assert abs(s - want_s) <= LOSS_RTOL * want_s, (s, want_s)
    assert [(s, n) for s, n in model.take_mtp_losses()] == [(0.0, 0), (0.0, 0)]


def test_grad_scale_scales_the_mtp_gradients_too():
    # backward(grad_scale=s) adds the gradient of s x J (a microbatch's weight in its step): the
    # depths' share as well as the main loss's.
    hf, model, _ = llama_mtp_pair(2, tie=False)
    ids, targets = with_ignored_targets(*batch(VOCAB))
    got = braid_step(model, ids, targets, grad_scale=0.5)
    want = reference(hf, ids, targets, SCALE)
    half = {n: 0.5 * g for n, g in llama_grads(hf).items()}
    worst, name = over(errors(got, want, lambda _: half, hf))
    assert worst <= 1, f"{name}: {worst:.1f} x the tolerance"


WRONG = ["concat_hidden_first", "ids_shifted_right", "targets_unshifted",
         "hidden_before_final_norm", "scale_not_over_depths", "per_depth_count",
         "final_norm_for_shared_head"]


def test_the_comparison_rejects_wrong_mtp():
    # braid matches the reference, and misses each variant with one mistake by more than 10 x the
    # tolerance on some loss or gradient: the comparisons above tell each of these from MTP.
    hf, model, hf_grads = llama_mtp_pair(2, tie=False)
    ids, targets = with_ignored_targets(*batch(VOCAB))
    got = braid_step(model, ids, targets)
    right, worst = over(errors(got, reference(hf, ids, targets, SCALE), hf_grads, hf))
    assert right <= 1, f"{worst}: {right:.1f} x the tolerance"
    for wrong in WRONG:
        ratio, worst = over(errors(got, reference(hf, ids, targets, SCALE, (wrong,)), hf_grads,
                                   hf))
        assert ratio > 10, f"{wrong}: braid within {ratio:.1f} x the tolerance ({worst})"
        print(f"{wrong}: {worst} off by {ratio:.0f} x the tolerance")
