"""braid's MoE router options against megatron-core's own router (CPU, f32): the sigmoid score
function, the expert bias (aux-loss-free balancing) and its update, group-limited routing, the
top-k scaling factor, the z-loss, the load-balancing losses per microbatch (aux_loss) and
per sequence (seq_aux_loss), and token dropping (the expert capacity factor).

The oracle is transformers' MixtralForCausalLM with braid's weights (hf_oracle.mixtral_pair)
whose routers are replaced by `MegatronGate`: the same router weight, its logits routed by
megatron-core's TopKRouter.routing itself, run on a stand-in `self`. That method is Megatron's
wiring of the moe_utils functions: z_loss_func on the logits, topk_routing_with_score_function
(score function, expert bias, group_limited_topk, scaling factor), apply_router_token_dropping
past each expert's capacity, compute_routing_scores_for_aux_loss and
switch_load_balancing_loss_func for the balancing losses (attached to the probabilities by
MoEAuxLossAutoScaler, whose backward scale is 1: one microbatch, one process), and the tokens
per expert that get_updated_expert_bias moves the bias by. Megatron's tokens are sequence-major
([S, B]); braid's and HF's batch-major ([B, S]): the gate transposes its logits into Megatron's
order and its routing back.

Megatron's balancing losses count the tokens per expert by the top k of the plain scores
(compute_routing_scores_for_aux_loss: no expert bias, no groups), not by the router's choice;
test_load_balancing_counts_are_megatrons_top_k_of_the_scores checks braid does the same.

Token dropping: Megatron's routing drops itself (apply_router_token_dropping, wrapped by
`token_dropping` to record what it dropped and, for the position policy, to fix the order among
tied tokens as Megatron's [S, B] token order, which braid follows).

Both sides must choose the same experts: `decisive` refuses a seed whose oracle routing has any
choice (group, expert, or the aux loss's top k) within MARGIN of flipping, or with dropping by
probability two probabilities within DROP_MARGIN at an expert's capacity. Tolerances as
test_hf_moe_oracle.py's.
"""

import types
import warnings

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from hf_oracle import assert_close_rel, batch, braid_grads, experts_to_braid, mixtral_pair

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe import router as megatron_router
    from megatron.core.transformer.moe.moe_utils import (
        apply_router_token_dropping, compute_routing_scores_for_aux_loss, get_capacity,
        get_moe_layer_wise_logging_tracker, get_updated_expert_bias,
        switch_load_balancing_loss_func, topk_routing_with_score_function, z_loss_func)
    from megatron.core.transformer.moe.router import TopKRouter

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
MARGIN = 1e-3  # the least gap between any choice of the router and its runner-up
DROP_MARGIN = 1e-6  # the least gap between an expert's last kept probability and its first dropped
FFN, VOCAB = 48, 97
SEEDS = range(12)


@pytest.fixture(scope="module", autouse=True)
def one_process_world():
    """Megatron's collectives need torch.distributed: a gloo world of this one process, whose
    group stands for the router's TP x CP group (its all-reduces pass the counts through) and
    for parallel_state's TP x DP x CP group that get_updated_expert_bias reduces over."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(moe_utils.parallel_state, "get_tensor_and_data_parallel_group",
                      lambda with_context_parallel=False: dist.group.WORLD)
        patch.setattr(megatron_router, "apply_router_token_dropping", token_dropping)
        yield
    if owned:
        dist.destroy_process_group()


class MegatronGate(torch.nn.Module):
    """Stands in for MixtralTopKRouter (same weight name): logits = hidden x weight^T, routed by
    megatron-core's TopKRouter.routing and the methods it calls, bound to this module."""

    routing = TopKRouter.routing
    apply_z_loss = TopKRouter.apply_z_loss
    get_aux_loss_coeff = TopKRouter.get_aux_loss_coeff
    is_aux_loss_enabled = TopKRouter.is_aux_loss_enabled
    _apply_aux_loss = TopKRouter._apply_aux_loss
    _apply_seq_aux_loss = TopKRouter._apply_seq_aux_loss
    _apply_global_aux_loss = TopKRouter._apply_global_aux_loss
    attach_and_log_load_balancing_loss = TopKRouter.attach_and_log_load_balancing_loss
    # torch.compile'd in megatron-core (jit_fuser); its plain body
    _apply_expert_bias = getattr(TopKRouter._apply_expert_bias, "_torchdynamo_orig_callable",
                                 TopKRouter._apply_expert_bias)

    routing_now = None  # the gate whose routing runs (token_dropping records into it)

    def __init__(self, weight, layer_number, config):
        super().__init__()
        self.weight = torch.nn.Parameter(weight.detach().clone())
        self.config = config
        self.layer_number = layer_number  # 1-based: the loss tracker's row
        self.topk = config.moe_router_topk
        self.routing_type = config.moe_router_load_balancing_type
        self.score_function = config.moe_router_score_function
        self.enable_expert_bias = config.moe_router_enable_expert_bias
        e = config.num_moe_experts
        self.expert_bias = torch.zeros(e) if self.enable_expert_bias else None
        self.local_tokens_per_expert = torch.zeros(e) if self.enable_expert_bias else None
        self.tp_cp_group = self.tp_dp_cp_group = dist.group.WORLD
        self.calculate_per_token_loss = False
        self.router_replay = None
        self.shape = None  # (B, S) of the next forward
        self.logits, self.maps = [], []  # per forward: [B*S, E] logits, routing map
        self.undropped = []  # per forward with a capacity: (probs, map) before dropping, [S*B, E]

    def forward(self, hidden):
        b, s = self.shape
        logits = F.linear(hidden, self.weight)  # [B*S, E], batch-major
        sb = logits.view(b, s, -1).transpose(0, 1).contiguous()  # Megatron's [S, B, E]
        MegatronGate.routing_now = self
        probs, routing_map = self.routing(sb)  # [S*B, E]
        probs = probs.view(s, b, -1).transpose(0, 1).reshape(b * s, -1)
        routing_map = routing_map.view(s, b, -1).transpose(0, 1).reshape(b * s, -1)
        self.logits.append(logits.detach().clone())
        self.maps.append(routing_map.clone())
        # Its k experts, any order; a token some of whose pairs were dropped past their experts'
        # capacities gets other experts in their place, of probability 0 (without gradient:
        # apply_router_token_dropping's probs * map).
        index = routing_map.float().topk(self.topk, dim=1).indices
        return logits, probs.gather(1, index), index


def token_dropping(probs, routing_map, router_topk, capacity_factor, drop_policy="probs",
                   pad_to_capacity=False):
    """megatron-core's apply_router_token_dropping in TopKRouter.routing (on Megatron's [S*B, E]
    tokens), recording the gate's probabilities and map before dropping. The position policy's
    capacity mask is built here: Megatron's, torch.topk over the 0/1 routing map, picks
    `capacity` of an expert's selected tokens in no defined order (on the CPU neither the first
    in Megatron's [S, B] token order nor in braid's [B, S]; on CUDA the first in [S, B]); braid
    keeps the first `capacity` selected tokens per expert in Megatron's [S, B] order, and so
    does this mask."""
    gate = MegatronGate.routing_now
    gate.undropped.append((probs.detach().clone(), routing_map.clone()))
    if drop_policy != "position" or pad_to_capacity:
        return apply_router_token_dropping(probs, routing_map, router_topk, capacity_factor,
                                           drop_policy, pad_to_capacity)
    t, e = routing_map.shape
    capacity = get_capacity(num_tokens=t * router_topk, num_experts=e,
                            capacity_factor=capacity_factor)
    kept = routing_map & (routing_map.int().cumsum(dim=0) <= capacity)  # rows in [S, B] order
    return probs * kept, kept  # apply_router_token_dropping's final_probs, final_map


def megatron_config(layers, experts, topk, fields):
    """The megatron TransformerConfig fields TopKRouter.routing reads, from braid's `fields`."""
    z = fields.get("moe_z_loss_coeff", 0.0)
    return types.SimpleNamespace(
        num_layers=layers, mtp_num_layers=None, num_moe_experts=experts, moe_router_topk=topk,
        moe_router_load_balancing_type=fields.get("moe_router_load_balancing_type", "aux_loss"),
        moe_aux_loss_coeff=fields.get("moe_aux_loss_coeff", 0.0),
        moe_z_loss_coeff=z or None,  # None: off (0.0 would log z_loss / 0)
        moe_router_score_function=fields.get("moe_router_score_function", "softmax"),
        moe_router_pre_softmax=fields.get("moe_router_pre_softmax", False),
        moe_router_num_groups=fields.get("moe_router_num_groups") or None,
        moe_router_group_topk=fields.get("moe_router_group_topk") or None,
        moe_router_topk_scaling_factor=fields.get("moe_router_topk_scaling_factor"),
        moe_router_enable_expert_bias=fields.get("moe_router_enable_expert_bias", False),
        moe_router_fusion=False,
        moe_expert_capacity_factor=fields.get("moe_expert_capacity_factor") or None,
        moe_token_drop_policy=fields.get("moe_token_drop_policy", "probs"),
        moe_pad_expert_input_to_capacity=False)


def gates(hf):
    return [layer.mlp.gate for layer in hf.model.layers]


def oracle_pair(seed, layers, experts, topk, fields, bias_std):
    """The braid model of `fields` and its oracle, with the same expert bias (each expert's
    drawn from N(0, bias_std) per layer) when the router has one."""
    hf, model = mixtral_pair(layers=layers, experts=experts, topk=topk, ffn=FFN, seed=seed,
                             **fields)
    cfg = megatron_config(layers, experts, topk, fields)
    for i, layer in enumerate(hf.model.layers):
        layer.mlp.gate = MegatronGate(layer.mlp.gate.weight, i + 1, cfg)
    if cfg.moe_router_enable_expert_bias:
        rng = np.random.default_rng(1000 + seed)
        for i, gate in enumerate(gates(hf)):
            bias = rng.normal(0.0, bias_std, size=experts).astype(np.float32)
            gate.expert_bias = torch.from_numpy(bias.copy())
            model.expert_biases()[f"model.layers.{i}.mlp.gate.e_score_correction_bias"].copy_(bias)
    return hf, model


def oracle_forward(hf, ids):
    """HF's output (its loss the mean lm loss, labels = ids shifted inside) with the router losses
    attached; Megatron's loss tracker starts empty."""
    get_moe_layer_wise_logging_tracker().clear()
    for gate in gates(hf):
        gate.shape = ids.shape
    return hf(torch.from_numpy(ids), labels=torch.from_numpy(ids))


def tracked(name):
    """Megatron's logged router loss `name` (without its coefficient), summed over layers."""
    tracker = get_moe_layer_wise_logging_tracker()
    return tracker[name]["values"].sum().item() if name in tracker else 0.0


def selection_scores(gate, logits):
    """What megatron's top k chooses on (topk_routing_with_score_function)."""
    if gate.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        return scores if gate.expert_bias is None else scores + gate.expert_bias
    return torch.softmax(logits, dim=-1) if gate.config.moe_router_pre_softmax else logits


def gap(scores, k):
    """min over rows of the k-th minus the (k+1)-th largest (inf where the (k+1)-th is -inf:
    nothing to confuse)."""
    top = torch.topk(scores, k + 1, dim=-1).values
    least = (top[:, k - 1] - top[:, k]).min().item()
    assert least == least, "a NaN score"
    return least


def margin(gate, logits):
    """The least gap of any decision megatron's router takes on these logits: the groups, the
    experts within them, and the top k of the aux loss's scores. Softmax probabilities are
    compared by their logs (relative gaps, in the logits' units: probabilities of 16 experts
    are small, and so are their absolute gaps and errors)."""
    cfg, k = gate.config, gate.topk
    scores = selection_scores(gate, logits)
    units = torch.log if cfg.moe_router_pre_softmax else (lambda x: x)
    experts = units(scores)
    least = float("inf")
    if cfg.moe_router_group_topk:
        t, g, gk = scores.shape[0], cfg.moe_router_num_groups, cfg.moe_router_group_topk
        groups = scores.view(t, g, -1).topk(k // gk, dim=-1).values.sum(dim=-1)
        least = min(least, gap(units(groups), gk))
        chosen = torch.zeros_like(groups).scatter(1, groups.topk(gk, dim=-1).indices, 1)
        keep = chosen.unsqueeze(-1).expand(t, g, scores.shape[1] // g).reshape(t, -1).bool()
        experts = experts.masked_fill(~keep, float("-inf"))
    least = min(least, gap(experts, k))
    if cfg.moe_aux_loss_coeff > 0:  # compute_routing_scores_for_aux_loss's top k
        least = min(least, gap(logits, k))  # softmax and sigmoid keep the logits' order
    return least


def capacity_gap(gate):
    """The least gap, over the experts past their capacity under the probs policy, between the
    probability of the last pair kept and of the first dropped (inf: nothing to confuse)."""
    cfg = gate.config
    if not cfg.moe_expert_capacity_factor or cfg.moe_token_drop_policy != "probs":
        return float("inf")
    probs, routing_map = gate.undropped[-1]
    t, e = routing_map.shape
    capacity = get_capacity(t * gate.topk, e, cfg.moe_expert_capacity_factor)
    least = float("inf")
    for column, chosen in zip(probs.T, routing_map.T):
        routed = column[chosen].sort(descending=True).values
        if len(routed) > capacity:
            least = min(least, (routed[capacity - 1] - routed[capacity]).item())
    return least


def decisive(layers=2, experts=8, topk=4, b=3, s=16, bias_std=0.1, accept=None, **fields):
    """The first seed whose oracle routing is decisive (MARGIN; with token dropping by
    probability, DROP_MARGIN at each capacity) and chooses every expert of every layer (and
    that `accept(hf)`): (hf, model, ids, targets, out) with `out` HF's output of that forward."""
    for seed in SEEDS:
        hf, model = oracle_pair(seed, layers, experts, topk, fields, bias_std)
        ids, targets = batch(VOCAB, b=b, s=s, seed=seed)
        out = oracle_forward(hf, ids)
        least = min(margin(gate, gate.logits[-1]) for gate in gates(hf))
        counts = [gate.maps[-1].sum(dim=0) for gate in gates(hf)]
        if (least > MARGIN and all((c > 0).all() for c in counts)
                and all(capacity_gap(gate) > DROP_MARGIN for gate in gates(hf))
                and (accept is None or accept(hf))):
            return hf, model, ids, targets, out
    pytest.fail(f"no seed in {SEEDS} routes decisively")


def compare_gradients(model, hf, experts, scale=1.0):
    got = braid_grads(model)
    want = experts_to_braid({n: p.grad for n, p in hf.named_parameters()}, experts, FFN)
    assert sorted(got) == sorted(want)
    return max(assert_close_rel(name, got[name], scale * g.numpy(), GRAD_RTOL)
               for name, g in want.items())


def check_step(hf, model, ids, targets, out, experts=8):
    """braid's loss and every gradient of one forward and backward against the oracle's (its
    autograd of the lm loss with the router losses attached). Returns the max errors."""
    out.loss.backward()
    loss = model.forward(ids, targets)
    model.backward()
    loss_err = abs(loss - out.loss.item()) / abs(out.loss.item())
    assert loss_err <= LOSS_RTOL, (loss, out.loss.item())
    return loss_err, compare_gradients(model, hf, experts)


def differs(gate, logits, **override):
    """Whether megatron's routing map of `logits` changes under `override` of its arguments."""
    cfg = gate.config
    args = dict(topk=gate.topk, use_pre_softmax=cfg.moe_router_pre_softmax,
                num_groups=cfg.moe_router_num_groups, group_topk=cfg.moe_router_group_topk,
                scaling_factor=cfg.moe_router_topk_scaling_factor,
                score_function=gate.score_function, expert_bias=gate.expert_bias)
    _, base = topk_routing_with_score_function(logits, **args)
    _, other = topk_routing_with_score_function(logits, **{**args, **override})
    return bool((base != other).any())


def assert_router_losses_matter(hf, ids):
    """The router losses' share of the first router's gradient (the oracle's gradients with
    them minus those without) is far above the tolerance: a braid that dropped or misscaled
    them fails the gradient comparison."""
    router = hf.model.layers[0].mlp.gate.weight
    with_losses = router.grad.clone()
    config = gates(hf)[0].config
    for gate in gates(hf):
        gate.config = types.SimpleNamespace(**{**vars(config), "moe_aux_loss_coeff": 0.0,
                                               "moe_z_loss_coeff": None})
    hf.zero_grad()
    oracle_forward(hf, ids).loss.backward()
    for gate in gates(hf):
        gate.config = config
    share = (with_losses - router.grad).abs().max().item()
    assert share > 100 * GRAD_RTOL * with_losses.abs().max().item(), share


GROUPS = {  # (experts, topk, num_groups, group_topk)
    # 2 experts a group, 2 groups of 4 chosen: the group choice decides everything
    "8-experts-4-groups-top-2": (8, 4, 4, 2),
    # 4 experts a group scored by their top 2: the choice within the groups matters too
    "16-experts-4-groups-top-2": (16, 4, 4, 2),
    # no groups, one expert a token: sigmoid's probability is its score, not renormalised
    "8-experts-top-1": (8, 1, 0, 0),
}
ROUTERS = {
    "sigmoid-bias": {"moe_router_score_function": "sigmoid",
                     "moe_router_enable_expert_bias": True},
    "softmax": {},  # choice on the logits, softmax over the chosen (Megatron's default)
    "softmax-pre": {"moe_router_pre_softmax": True},  # top k of the softmax over all
}


@pytest.mark.parametrize("groups", GROUPS)
@pytest.mark.parametrize("router", ROUTERS)
def test_routing_with_groups_and_scaling_is_megatrons(router, groups):
    experts, topk, num_groups, group_topk = GROUPS[groups]
    hf, model, ids, targets, out = decisive(
        experts=experts, topk=topk, moe_router_num_groups=num_groups,
        moe_router_group_topk=group_topk, moe_router_topk_scaling_factor=2.5, **ROUTERS[router])
    for gate in gates(hf):  # each option changes some choice: a braid that ignored it differs
        logits = gate.logits[-1]
        if num_groups:
            assert differs(gate, logits, num_groups=None, group_topk=None), "groups matter"
        if gate.expert_bias is not None:
            assert differs(gate, logits, expert_bias=None), "the bias matters"
    loss_err, grad_err = check_step(hf, model, ids, targets, out, experts)
    print(f"{router} {groups}: loss {loss_err:.1e}, gradients {grad_err:.1e}")


def test_z_loss_is_megatrons():
    # moe_z_loss_coeff c: braid's gradients are those of lm loss + the sum over layers of
    # z_loss_func(logits, c); take_moe_losses()[1] is that sum at c = 1.
    coeff = 0.05
    hf, model, ids, targets, out = decisive(
        moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5,
        moe_z_loss_coeff=coeff)
    want = sum(z_loss_func(gate.logits[-1], 1.0).item() for gate in gates(hf))
    assert abs(tracked("z_loss") - want) <= 1e-6 * want  # the oracle logged what it attached
    loss_err, grad_err = check_step(hf, model, ids, targets, out)
    got = model.take_moe_losses()
    assert got[0] == 0.0 and abs(got[1] - want) <= LOSS_RTOL * want, (got, want)
    assert model.take_moe_losses() == (0.0, 0.0)  # taken
    # A microbatch weighted s in its step (backward's grad_scale): the z-loss's share too.
    model.zero_grad()
    model.forward(ids, targets)
    model.backward(grad_scale=0.5)
    compare_gradients(model, hf, 8, scale=0.5)
    assert abs(model.take_moe_losses()[1] - want) <= LOSS_RTOL * want  # not scaled
    assert_router_losses_matter(hf, ids)
    print(f"z-loss: loss {loss_err:.1e}, gradients {grad_err:.1e}, "
          f"z {abs(got[1] - want) / want:.1e}")


BALANCING = {
    "aux-softmax": {"moe_router_load_balancing_type": "aux_loss"},
    "aux-sigmoid": {"moe_router_load_balancing_type": "aux_loss",
                    "moe_router_score_function": "sigmoid"},
    "seq-softmax": {"moe_router_load_balancing_type": "seq_aux_loss"},
    "seq-sigmoid": {"moe_router_load_balancing_type": "seq_aux_loss",
                    "moe_router_score_function": "sigmoid",
                    "moe_router_topk_scaling_factor": 2.5},
}
TRACKED = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


@pytest.mark.parametrize("kind", BALANCING)
def test_load_balancing_loss_is_megatrons(kind):
    # moe_aux_loss_coeff c, one microbatch of B = 3 sequences: braid's gradients are those of
    # lm loss + c x (the sum over layers of Megatron's aux_loss: switch_load_balancing_loss_func
    # of compute_routing_scores_for_aux_loss over the microbatch; seq_aux_loss: over each
    # sequence, averaged); take_moe_losses()[0] is that sum without c.
    coeff = 0.5
    fields = {**BALANCING[kind], "moe_aux_loss_coeff": coeff}
    hf, model, ids, targets, out = decisive(**fields)
    want = tracked(TRACKED[fields["moe_router_load_balancing_type"]])
    assert want > 0
    loss_err, grad_err = check_step(hf, model, ids, targets, out)
    got = model.take_moe_losses()
    assert abs(got[0] - want) <= LOSS_RTOL * want and got[1] == 0.0, (got, want)
    assert_router_losses_matter(hf, ids)
    print(f"{kind}: loss {loss_err:.1e}, gradients {grad_err:.1e}, "
          f"balancing {abs(got[0] - want) / want:.1e}")


def test_sequence_loss_is_per_braid_sequence():
    # The oracle's per-sequence loss (Megatron's [S, B] reshape in _apply_seq_aux_loss) is that
    # of braid's sequences, rows of [B, S], taken one by one; it differs far beyond the
    # tolerance from the microbatch's loss and from that of sequences cut in the wrong token
    # order ([B, S] read as [S, B]): a braid that balanced over either fails above.
    hf, _, ids, _, _ = decisive(moe_router_load_balancing_type="seq_aux_loss",
                                moe_aux_loss_coeff=0.5)
    b, s = ids.shape
    tracked_seq = tracked("seq_load_balancing_loss")
    seq = whole = strided = 0.0
    for gate in gates(hf):
        logits, k = gate.logits[-1], gate.topk
        seq += sum(switch_loss(logits.view(b, s, -1)[i], k) for i in range(b)) / b
        strided += sum(switch_loss(logits.view(s, b, -1)[:, i], k) for i in range(b)) / b
        whole += switch_loss(logits, k)
    assert abs(seq - tracked_seq) <= 1e-6 * seq, (seq, tracked_seq)
    assert abs(seq - whole) > 1e-3 * seq and abs(seq - strided) > 1e-3 * seq, (seq, whole, strided)


def switch_loss(logits, k):
    """Megatron's aux loss of these tokens alone, coefficient 1."""
    routing_map, scores = compute_routing_scores_for_aux_loss(logits, k, "softmax")
    return switch_load_balancing_loss_func(scores, routing_map.sum(dim=0), logits.shape[0], k,
                                           logits.shape[1], 1.0).item()


CHOICE = {  # routers whose choice is not the top k of the scores over all experts
    "sigmoid-bias": {"moe_router_score_function": "sigmoid",
                     "moe_router_enable_expert_bias": True},
    "sigmoid-groups": {"moe_router_score_function": "sigmoid", "moe_router_num_groups": 4,
                       "moe_router_group_topk": 2},
    "softmax-groups": {"moe_router_num_groups": 4, "moe_router_group_topk": 2},
}


@pytest.mark.parametrize("balancing", TRACKED)
@pytest.mark.parametrize("router", CHOICE)
def test_load_balancing_counts_are_megatrons_top_k_of_the_scores(router, balancing):
    # Megatron's balancing losses count each expert's tokens by
    # compute_routing_scores_for_aux_loss: the top k of the scores over all experts, without
    # the expert bias and the groups, not the experts the router chose with them.
    fields = {**CHOICE[router], "moe_router_load_balancing_type": balancing,
              "moe_aux_loss_coeff": 0.5}
    hf, model, ids, targets, out = decisive(**fields)
    chosen = [gate.maps[-1].sum(dim=0).tolist() for gate in gates(hf)]
    counted = [compute_routing_scores_for_aux_loss(gate.logits[-1], gate.topk,
                                                   gate.score_function)[0].sum(dim=0).tolist()
               for gate in gates(hf)]
    assert chosen != counted  # else this test could not tell the two apart
    want = tracked(TRACKED[balancing])
    model.forward(ids, targets)
    model.backward()
    got = model.take_moe_losses()[0]
    assert abs(got - want) <= LOSS_RTOL * want, (
        f"braid {got:.7g}, megatron {want:.7g}: megatron counts each layer's tokens per expert "
        f"{counted}, the router chose {chosen}")
    out.loss.backward()
    compare_gradients(model, hf, 8)


def test_expert_bias_update_is_megatrons():
    # Two microbatches' forwards and backwards, then update_expert_bias(): each layer's bias is
    # get_updated_expert_bias of the tokens per expert the oracle's routers counted over both
    # (with the bias of the step: it moves after the step), bit for bit in f32.
    rate = 1e-3
    hf, model, ids, targets, out = decisive(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_num_groups=4, moe_router_group_topk=2, moe_router_bias_update_rate=rate)
    out.loss.backward()
    model.forward(ids, targets, microbatch=0)
    ids2, targets2 = batch(VOCAB, seed=77)
    oracle_forward(hf, ids2)
    assert min(margin(gate, gate.logits[-1]) for gate in gates(hf)) > MARGIN
    model.forward(ids2, targets2, microbatch=1)
    model.backward(microbatch=0)
    model.backward(microbatch=1)
    biases = model.expert_biases()
    before = {n: np.from_dlpack(b).copy() for n, b in biases.items()}
    model.update_expert_bias()
    for i, gate in enumerate(gates(hf)):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        assert np.array_equal(before[name], gate.expert_bias.numpy())
        tokens = gate.local_tokens_per_expert.clone()
        assert tokens.sum().item() == 2 * ids.size * gate.topk  # both microbatches counted
        want = get_updated_expert_bias(tokens, gate.expert_bias, rate).numpy()
        got = np.from_dlpack(biases[name]).copy()
        assert got.dtype == np.float32 and np.array_equal(got, want), (i, got - want)
        moved = np.sign(got - before[name])
        assert (moved > 0).any() and (moved < 0).any(), moved
    # No backward since: no tokens, no move (Megatron's sign(0)).
    after = {n: np.from_dlpack(b).copy() for n, b in biases.items()}
    model.update_expert_bias()
    for name, b in model.expert_biases().items():
        assert np.array_equal(np.from_dlpack(b), after[name])


def dropped_pairs(gate):
    """The (token, choice) pairs megatron's routing dropped past their experts' capacities in
    the gate's last forward."""
    return int(gate.undropped[-1][1].sum() - gate.maps[-1].sum())


def dropless_run(hf, ids):
    """The oracle's loss and gradients of `ids` without a capacity (its gates' configs restored
    after; its gradients replaced)."""
    configs = [gate.config for gate in gates(hf)]
    for gate in gates(hf):
        gate.config = types.SimpleNamespace(**{**vars(gate.config),
                                               "moe_expert_capacity_factor": None})
    hf.zero_grad()
    out = oracle_forward(hf, ids)
    out.loss.backward()
    for gate, config in zip(gates(hf), configs):
        gate.config = config
    return out.loss.item(), {n: p.grad.clone() for n, p in hf.named_parameters()}


DROPPING_ROUTERS = {
    "softmax": {},
    "sigmoid": {"moe_router_score_function": "sigmoid", "moe_router_topk_scaling_factor": 2.5},
}


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("factor", [0.5, 1.0])
@pytest.mark.parametrize("router", DROPPING_ROUTERS)
def test_token_dropping_is_megatrons(router, factor, policy):
    # moe_expert_capacity_factor F: each expert keeps at most ceil(T k / E F) of its pairs (here
    # T 48, k 4, E 8: 12 at F 0.5, 24 at F 1.0), by probability or by position in Megatron's
    # [S, B] token order (token_dropping says why the oracle's position mask is built here).
    # The loss and every gradient are the oracle's; the evaluation forward (model.logits) drops
    # too; the dropless gradients are far from both.
    fields = {**DROPPING_ROUTERS[router], "moe_expert_capacity_factor": factor,
              "moe_token_drop_policy": policy}
    hf, model, ids, targets, out = decisive(**fields)
    dropped = [dropped_pairs(gate) for gate in gates(hf)]
    assert all(d > 0 for d in dropped), dropped
    logits = np.asarray(model.logits(ids.astype(np.int32)))
    logits_err = assert_close_rel("logits", logits, out.logits.detach().numpy(), LOSS_RTOL)
    loss_err, grad_err = check_step(hf, model, ids, targets, out)
    dropped_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}
    loss, grads = dropless_run(hf, ids)
    loss_moved = abs(loss - out.loss.item()) / abs(out.loss.item())
    grad_moved = max((grads[n] - g).abs().max().item() / g.abs().max().item()
                     for n, g in dropped_grads.items())
    # The routed experts move the loss of random weights little (1e-4 here); their gradients
    # tell dropping apart.
    assert grad_moved > 100 * GRAD_RTOL, (loss_moved, grad_moved)
    print(f"{router} F {factor} {policy}: dropped {dropped} of {ids.size * 4} pairs per layer, "
          f"loss {loss_err:.1e}, gradients {grad_err:.1e}, logits {logits_err:.1e}; dropless: "
          f"loss {loss_moved:.1e}, gradients {grad_moved:.1e} away")


def test_token_dropping_leaves_the_aux_loss_its_own_top_k():
    # Megatron's balancing loss counts its own top k of the scores (compute_routing_scores_
    # for_aux_loss), before any dropping: braid's loss and gradients with both are the oracle's.
    fields = {"moe_expert_capacity_factor": 0.5, "moe_aux_loss_coeff": 0.5}
    hf, model, ids, targets, out = decisive(**fields)
    assert all(dropped_pairs(gate) > 0 for gate in gates(hf))
    want = tracked("load_balancing_loss")
    loss_err, grad_err = check_step(hf, model, ids, targets, out)
    got = model.take_moe_losses()[0]
    assert abs(got - want) <= LOSS_RTOL * want, (got, want)
    kept = sum(switch_load_balancing_loss_func(
        torch.softmax(gate.logits[-1], dim=-1), gate.maps[-1].sum(dim=0), ids.size, gate.topk,
        gate.maps[-1].shape[1], 1.0).item() for gate in gates(hf))
    assert abs(kept - want) > 100 * LOSS_RTOL * want, (kept, want)  # the kept pairs' counts differ
    print(f"aux loss with dropping: loss {loss_err:.1e}, gradients {grad_err:.1e}, "
          f"balancing {abs(got - want) / want:.1e}")


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_expert_bias_update_counts_the_kept_pairs(policy):
    # With a capacity, Megatron's _apply_expert_bias counts the routing map after dropping: each
    # layer's bias moves by get_updated_expert_bias of the pairs the experts kept, bit for bit.
    rate = 1e-3
    hf, model, ids, targets, out = decisive(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=rate, moe_expert_capacity_factor=1.0,
        moe_token_drop_policy=policy)
    out.loss.backward()
    model.forward(ids, targets)
    model.backward()
    biases = model.expert_biases()
    model.update_expert_bias()
    for i, gate in enumerate(gates(hf)):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        tokens = gate.local_tokens_per_expert.clone()
        assert tokens.sum().item() == ids.size * gate.topk - dropped_pairs(gate) < ids.size * 4
        want = get_updated_expert_bias(tokens, gate.expert_bias, rate).numpy()
        got = np.from_dlpack(biases[name]).copy()
        assert got.dtype == np.float32 and np.array_equal(got, want), (i, got - want)
        routed = gate.undropped[-1][1].sum(dim=0).float()  # the counts before dropping
        assert not np.array_equal(get_updated_expert_bias(routed, gate.expert_bias, rate).numpy(),
                                  want), "the dropped pairs' counts would move the bias alike"


def test_capacity_is_megatrons_where_a_float32_factor_would_round_it_up():
    # Megatron's capacity is math.ceil(T k / E x F) in double. For F 1.2 and T k / E = 5 (10
    # tokens, top 4 of 8) that is 6; a float32 F = 1.2000000477 would make it 7, which is why
    # TransformerConfig.moe_expert_capacity_factor is a double. A seed where some expert has
    # more than 6 pairs routed to it tells the two apart.
    def past_six(hf):
        return any(gate.undropped[-1][1].sum(dim=0).max() > 6 for gate in gates(hf))

    hf, model, ids, targets, out = decisive(b=1, s=10, moe_expert_capacity_factor=1.2,
                                            accept=past_six)
    assert get_capacity(ids.size * 4, 8, 1.2) == 6
    check_step(hf, model, ids, targets, out)
