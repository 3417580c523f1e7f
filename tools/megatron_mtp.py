"""Multi-token prediction between Megatron-LM and braid (docs/convert_megatron.md):
megatron-core's MultiTokenPredictionBlock (--mtp-num-layers D) <-> braid's MTP depths
(mtp_num_layers).

megatron-core's depth k (0-based) is mtp.layers.{k}.*: enorm, hnorm, eh_proj [H, 2H] (its input
[enorm(embedding of the ids shifted by k + 1) | hnorm(the previous depth's output, or the final
norm's)]), transformer_layer.* (a layer of the decoder's last layer's spec, named as a decoder
layer's tensors are, per depth rather than stacked) and final_layernorm; the output layer (or the
tied embedding) is the model's. braid's depth k + 1 is layer L + k of an L-layer model under HF
DeepSeek-V3's names: model.layers.{L+k}.enorm, .hnorm, .eh_proj, the layer's usual names and
.shared_head.norm, the same computation."""

import re

from hf_configs import check

MTP = "mtp.layers."
LAYER = "transformer_layer."
# braid's name (after model.layers.{L+k}.) -> megatron-core's (after mtp.layers.{k}.)
MTP_NAMES = {"enorm.weight": "enorm.weight", "enorm.bias": "enorm.bias",
             "hnorm.weight": "hnorm.weight", "hnorm.bias": "hnorm.bias",
             "eh_proj.weight": "eh_proj.weight",
             "shared_head.norm.weight": "final_layernorm.weight",
             "shared_head.norm.bias": "final_layernorm.bias"}
BRAID_MTP_NAMES = {name: braid_name for braid_name, name in MTP_NAMES.items()}
# The depth's own modules that have an _extra_state under the local or the Transformer Engine
# spec (TE's norms are modules with one).
MTP_EXTRA_STATE = ("eh_proj", "enorm", "hnorm", "final_layernorm")


def depths(c):
    return c.get("mtp_num_layers") or 0  # absent in checkpoints before MTP


def split_mtp(megatron, c, layers, out):
    """Takes megatron-core's MTP tensors out of `megatron`: each depth's transformer layer into
    `layers` ({(layer, name): Tensor}) as layer L + k, its norms and eh_proj into `out` under
    braid's names. Depths past the args' stay in `megatron` (unexpected)."""
    first = c["num_layers"]
    for key in [k for k in megatron if k.startswith(MTP)]:
        m = re.match(r"(\d+)\.(.+)$", key[len(MTP):])
        if not m or int(m.group(1)) >= depths(c):
            continue
        k, rest = int(m.group(1)), m.group(2)
        if rest.startswith(LAYER):
            layers[(first + k, rest[len(LAYER):])] = megatron.pop(key)
        elif rest in BRAID_MTP_NAMES:
            out[f"model.layers.{first + k}.{BRAID_MTP_NAMES[rest]}"] = megatron.pop(key)


def braid_mtp_tensors(t, c, layer_of):
    """braid's MTP depths' tensors under megatron-core's names; `layer_of(i)`: layer i's tensors
    under megatron-core's layer names."""
    out, first = {}, c["num_layers"]
    for k in range(depths(c)):
        p = f"model.layers.{first + k}."
        for braid_name, name in MTP_NAMES.items():
            if p + braid_name in t:
                out[f"{MTP}{k}.{name}"] = t[p + braid_name]
        out.update({f"{MTP}{k}.{LAYER}{name}": x for name, x in layer_of(first + k).items()})
    return out


def mtp_names_of(c, i, rest):
    """Where an import looks for braid's model.layers.{i}.{rest} of an MTP depth (its own
    tensors; None for its layer's)."""
    if rest in MTP_NAMES:
        return f"{MTP}{i - c['num_layers']}.{MTP_NAMES[rest]}"
    return None


def mtp_extra_state_keys(c, layer_modules):
    """The _extra_state objects (ShardedObject unique keys) of the MTP depths: their own modules'
    and their layers' (`layer_modules(i)`: (module, whether per expert) of layer i)."""
    keys, experts = [], c.get("num_experts") or 0
    for k in range(depths(c)):
        modules = [(m, False) for m in MTP_EXTRA_STATE] + [
            (LAYER + m, e) for m, e in layer_modules(c["num_layers"] + k)]
        for module, per_expert in modules:
            for j in range(experts if per_expert else 1):
                shard = f"shard_{j}_{experts}" if per_expert else "shard_0_1"
                keys.append(f"{MTP}{k}.{module}._extra_state/{shard}")
    return keys


def check_mtp_args(c, where):
    """braid's MTP depths need RoPE (they do not shift learned positions)."""
    check(isinstance(depths(c), int) and depths(c) >= 0, f"{where}: args.mtp_num_layers should "
          f"be a layer count, is {depths(c)!r}")
    check(not depths(c) or c["position_embedding"] == "rope", f"{where}: args.mtp_num_layers "
          f"{depths(c)} with learned positions is not supported (braid's multi-token prediction "
          "depths need RoPE)")
