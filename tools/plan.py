#!/usr/bin/env python3
"""Plan a braid training run on a GPU cluster: predicted step time, tokens/s, MFU, memory per
GPU, scaling efficiency, days and cost for every parallel layout that fits, best first.

    python tools/plan.py --model llama3-70b --gpu h100-80g --gpus-per-node 8 --num-gpus 512 \\
        --nvlink-bw 450GB/s --net-bw 400Gb/s --global-batch 1024 --train-tokens 15e12 \\
        --gpu-hour-price 2.5 [--tp 8 --pp 4 ...] [--json] [--top 10]

Any of --tp --pp --dp --micro-batch-size --virtual-stages --decoder-first/last-pipeline-num-layers
--pipeline-model-parallel-layout (with --pp) --account-for-embedding/loss-in-pipeline-split
--recompute [--recompute-method --recompute-num-layers | --recompute-modules mla_up_proj]
--sequence-parallel --zero --expert-model-parallel-size --expert-tensor-parallel-size fixes that
choice; the rest are searched. --num-experts E [--moe-router-topk K --moe-ffn-hidden-size F
--moe-shared-expert-intermediate-size S --moe-shared-expert-gate] make every layer a mixture of
experts (or --model mixtral-8x7b), --moe-layer-freq N|LIST only some (the others dense); their
expert parallelism is searched too, and at TP > 1 with SP whole experts (etp 1) beside split ones.
--multi-latent-attention [--q-lora-rank --kv-lora-rank --qk-head-dim --qk-pos-emb-head-dim
--v-head-dim --qk-layernorm] is DeepSeek's attention (or --model deepseek-v3), --mtp-num-layers D
its multi-token prediction: D more layers (of the last one's kind) with their logits and loss on
the last pipeline stage. --grad-reduce-in-bf16 (never searched) times the data-parallel gradient
reductions in bf16, with their bf16 staging copy in memory.
The model behind the numbers is in docs/planner.md (python/braid/planner.py).

Or the run's own training arguments after `--`, as pretrain_gpt.py takes them: the model, the
layout, the batch, the recomputation, the iterations (-> tokens) and --gpu-hour-price all come
from them (giving one here as well is an error; --gpu-hour-price may come here when they have
none), and the prediction is for exactly that run (--search: every layout for its model
and batch instead):

    python tools/plan.py --gpu h100-80g --num-gpus 64 --nvlink-bw 450GB/s --net-bw 400Gb/s \\
        -- --num-layers 80 --hidden-size 8192 ... --tensor-model-parallel-size 8 ...
"""

import argparse
import dataclasses
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "python"))

from braid import (attention_args, moe_args, pipeline_args, planner,  # noqa: E402
                   planner_split, recompute_args, window_args)
from braid.arguments import without_source  # noqa: E402
from braid.arguments import parse_args as parse_training_args  # noqa: E402


def _bool(text):
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: true or false")


def _positive(kind):
    """An argparse type: a `kind` (int or float) above 0, finite."""
    def parse(text):
        value = kind(text)
        if not 0 < value < math.inf:
            raise argparse.ArgumentTypeError(f"must be > 0{' and finite' if kind is float else ''}"
                                             f", got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


_positive_int, _positive_float = _positive(int), _positive(float)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_argument_group("model (a preset, or the shape)")
    g.add_argument("--model", choices=sorted(planner.PRESETS))
    g.add_argument("--num-layers", type=_positive_int)
    g.add_argument("--hidden-size", type=_positive_int)
    g.add_argument("--num-attention-heads", type=_positive_int)
    g.add_argument("--num-query-groups", type=_positive_int,
                   help="KV heads (GQA); default: the heads")
    g.add_argument("--kv-channels", type=_positive_int,
                   help="each head's width; default --hidden-size / --num-attention-heads")
    g.add_argument("--ffn-hidden-size", type=_positive_int)
    g.add_argument("--vocab-size", type=_positive_int)
    g.add_argument("--seq-length", type=_positive_int)
    g.add_argument("--activation", choices=["swiglu", "quick_geglu", "gelu", "squared_relu"],
                   default=None, help="quick_geglu (GPT-OSS's) is gated like swiglu")
    g.add_argument("--tie-embeddings", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="norms on each query and key head (Qwen3); with --multi-latent-attention "
                        "the two latent norms (DeepSeek's)")
    g.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V2/V3's multi-latent attention (kv heads = heads); its ranks and "
                        "widths default to Megatron's, or a preset's")
    for flag, what in (("q-lora-rank", "the queries' latent rank (default none: q_proj)"),
                       ("kv-lora-rank", "the keys' and values' latent rank"),
                       ("qk-head-dim", "each query/key head's channels without RoPE"),
                       ("qk-pos-emb-head-dim", "each query/key head's RoPE channels"),
                       ("v-head-dim", "each value head's width")):
        g.add_argument(f"--{flag}", type=_positive_int,
                       help=f"with --multi-latent-attention: {what}")
    g.add_argument("--mtp-num-layers", type=_positive_int, metavar="D",
                   help="DeepSeek-V3's multi-token prediction: D depths on the last pipeline "
                        "stage, each a layer of the last layer's kind, eh_proj and its own logits "
                        "and loss (default: none)")
    g.add_argument("--window-size", type=window_args.window_size,
                   help="sliding-window attention W,0 as pretrain_gpt.py takes it")
    g.add_argument("--window-attn-skip-freq", type=window_args.skip_freq,
                   help="with --window-size: every Nth layer attends to everything, or a list")
    g.add_argument("--num-experts", type=_positive_int,
                   help="mixture of experts: every layer's MLP is this many experts")
    g.add_argument("--moe-router-topk", type=_positive_int, help="experts per token (default 2)")
    g.add_argument("--moe-ffn-hidden-size", type=_positive_int,
                   help="each expert's hidden size (default --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=_positive_int, metavar="S",
                   help="a shared expert of hidden size S every token goes through")
    g.add_argument("--moe-shared-expert-gate", action="store_true",
                   help="the shared expert's output scaled by a sigmoid gate")
    g.add_argument("--moe-layer-freq", type=window_args.skip_freq, metavar="N|LIST",
                   help="which layers have experts: layers 0, N, 2N, ... (0-based), or one 1 "
                        "(experts) or 0 (dense MLP) per layer, e.g. \"[0]+[1]*31\" (default: "
                        "all)")
    g = ap.add_argument_group("cluster")
    g.add_argument("--gpu", choices=sorted(planner.GPUS), required=True)
    g.add_argument("--gpus-per-node", type=_positive_int, default=8)
    g.add_argument("--num-gpus", type=_positive_int, required=True)
    g.add_argument("--nvlink-bw", required=True, help="per GPU per direction, e.g. 300GB/s")
    g.add_argument("--net-bw", required=True, help="per GPU (RoCE/IB), e.g. 200Gb/s")
    g = ap.add_argument_group("run")
    g.add_argument("--global-batch", type=_positive_int,
                   help="sequences per step (required without training arguments after --)")
    g.add_argument("--train-tokens", type=_positive_float)
    g.add_argument("--gpu-hour-price", type=_positive_float)
    g = ap.add_argument_group("layout (fixed when given, searched otherwise)")
    g.add_argument("--tp", type=_positive_int)
    g.add_argument("--pp", type=_positive_int)
    g.add_argument("--cp", type=_positive_int,
                   help="context parallelism (--context-parallel-size); searched where each "
                   "sequence splits into 2 x cp chunks of 2048 tokens or more")
    g.add_argument("--dp", type=_positive_int)
    g.add_argument("--micro-batch-size", type=_positive_int)
    g.add_argument("--virtual-stages", type=_positive_int)
    g.add_argument("--decoder-first-pipeline-num-layers", type=_positive_int, metavar="N",
                   help="uneven stages: the first stage's layers (searched otherwise)")
    g.add_argument("--decoder-last-pipeline-num-layers", type=_positive_int, metavar="N",
                   help="uneven stages: the last stage's layers (searched otherwise)")
    g.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                   help=pipeline_args.LAYOUT_HELP + "; needs --pp, and fixes the virtual stages")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="split the layers with the embedding counted as one (the first model "
                        "chunk one layer lighter), pp and v searched where it divides")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="split the layers with the LM head and loss counted as one (the last "
                        "model chunk one layer lighter)")
    g.add_argument("--recompute", choices=["none", "selective", "full"])
    g.add_argument("--recompute-method", choices=["uniform", "block"],
                   help="with --recompute full (searched otherwise: uniform 1, and block with "
                        "the fewest layers that fit)")
    g.add_argument("--recompute-num-layers", type=_positive_int, metavar="N")
    g.add_argument("--recompute-modules", nargs="+", choices=recompute_args.RECOMPUTE_MODULES,
                   metavar="MODULE",
                   help="with --recompute selective, as pretrain_gpt.py takes it: mla_up_proj "
                        "recomputes multi-latent attention's up projections too (searched "
                        "beside plain selective otherwise); core_attn, layernorm, moe_act are "
                        "braid's selective")
    g.add_argument("--sequence-parallel", type=_bool, metavar="true|false")
    g.add_argument("--zero", type=_bool, metavar="true|false",
                   help="ZeRO-1 (--use-distributed-optimizer)")
    g.add_argument("--expert-model-parallel-size", type=_positive_int, metavar="EP",
                   help="expert parallelism: EP of the dp x cp ranks split each layer's experts "
                        "and exchange their tokens all-to-all; must divide --num-experts and "
                        "dp x cp (searched for a model with experts, over the divisors of "
                        "--num-experts that divide dp x cp; with --expert-tensor-parallel-size "
                        "1, tp x dp x cp)")
    g.add_argument("--expert-tensor-parallel-size", type=_positive_int, metavar="ETP",
                   help="the TP size (experts split over TP like the dense MLP; a value above 1 "
                        "fixes --tp to it) or 1: whole experts, each TP rank routing its own "
                        "sequence-parallel tokens, ep dividing tp x dp x cp (Megatron's MoE "
                        "parallel folding; searched beside split experts at tp > 1 with SP)")
    g.add_argument("--no-overlap-grad-reduce", action="store_true",
                   help="time braid without --overlap-grad-reduce")
    g.add_argument("--no-overlap-param-gather", action="store_true",
                   help="time braid's ZeRO without --overlap-param-gather")
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="time braid with --grad-reduce-in-bf16: the data-parallel gradient "
                        "reductions move bf16 (half the bytes) from a bf16 staging copy of the "
                        "gradients (2 bytes each, counted in grads); never searched")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--top", type=_positive_int, default=10,
                    help="rows of the table (--json: all)")
    ap.add_argument("--search", action="store_true",
                    help="with training arguments after --: search every layout for their model "
                         "and batch instead of predicting theirs")
    argv = list(sys.argv[1:] if argv is None else argv)
    training = argv[argv.index("--") + 1:] if "--" in argv else None
    a = ap.parse_args(argv[:argv.index("--")] if training is not None else argv)
    a.rampup = None  # a run's --rampup-batch-size phase (training arguments only)
    a.even_stages = None  # True: the training arguments' pipeline split, even
    a.model_chunk_layers = None  # every model chunk's layers: a pipeline layout's
    a.recompute_mla_up_proj = None  # True: --recompute-modules mla_up_proj (None: searched)
    if (a.recompute_method or a.recompute_num_layers is not None) and a.recompute != "full":
        ap.error("--recompute-method / --recompute-num-layers need --recompute full")
    try:
        a.nvlink = planner.parse_bandwidth(a.nvlink_bw, "--nvlink-bw")
        a.net = planner.parse_bandwidth(a.net_bw, "--net-bw")
    except ValueError as e:
        ap.error(str(e))
    if a.num_gpus > a.gpus_per_node and a.num_gpus % a.gpus_per_node:
        ap.error(f"--num-gpus {a.num_gpus} is not a whole number of nodes of --gpus-per-node "
                 f"{a.gpus_per_node} (fewer GPUs than a node's are one node)")
    if training is not None:
        return _from_training_arguments(ap, a, training)
    if a.global_batch is None:
        ap.error("--global-batch is required (or give the run's training arguments after --)")
    shape = [a.num_layers, a.hidden_size, a.num_attention_heads, a.ffn_hidden_size,
             a.vocab_size, a.seq_length]
    if a.model:
        m = planner.PRESETS[a.model]
        a.model_shape = planner.ModelShape(
            a.num_layers or m.num_layers, a.hidden_size or m.hidden_size,
            a.num_attention_heads or m.num_attention_heads, a.num_query_groups or m.kv_heads,
            a.ffn_hidden_size or m.ffn_hidden_size, a.vocab_size or m.vocab_size,
            a.seq_length or m.seq_length, a.activation or m.activation,
            a.tie_embeddings or m.tied_embeddings, a.qk_layernorm or m.qk_layernorm,
            a.kv_channels or m.kv_channels, num_experts=a.num_experts or m.num_experts,
            moe_router_topk=a.moe_router_topk or m.moe_router_topk,
            moe_ffn_hidden_size=a.moe_ffn_hidden_size or m.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size
            or m.moe_shared_expert_intermediate_size,
            moe_shared_expert_gate=a.moe_shared_expert_gate or m.moe_shared_expert_gate,
            moe_layers=m.moe_layers, mtp_num_layers=a.mtp_num_layers or m.mtp_num_layers)
    elif all(x is not None for x in shape):
        a.model_shape = planner.ModelShape(
            a.num_layers, a.hidden_size, a.num_attention_heads,
            a.num_query_groups or a.num_attention_heads, a.ffn_hidden_size, a.vocab_size,
            a.seq_length, a.activation or "swiglu", a.tie_embeddings, a.qk_layernorm,
            kv_channels=a.kv_channels or 0, num_experts=a.num_experts or 0,
            moe_router_topk=a.moe_router_topk or 2,
            moe_ffn_hidden_size=a.moe_ffn_hidden_size or 0,
            moe_shared_expert_intermediate_size=a.moe_shared_expert_intermediate_size or 0,
            moe_shared_expert_gate=a.moe_shared_expert_gate, mtp_num_layers=a.mtp_num_layers or 0)
    else:
        ap.error("give --model, or all of --num-layers --hidden-size --num-attention-heads "
                 "--ffn-hidden-size --vocab-size --seq-length")
    a.model_shape = latent_attention(ap, a, a.model_shape, planner.PRESETS.get(a.model))
    error = heads_error(a.model_shape)
    if error:
        ap.error(error)
    recompute_modules(ap, a)
    if a.window_attn_skip_freq is not None and (a.window_size is None or a.window_size < 0):
        ap.error("--window-attn-skip-freq needs --window-size")
    try:
        size, layers = window_args.model_window(a.window_size, window_args.window_layers(
            a.window_attn_skip_freq, a.model_shape.num_layers))
    except ValueError as e:
        ap.error(str(e))
    freq = a.moe_layer_freq if a.moe_layer_freq is not None else \
        list(a.model_shape.moe_layers) or 1  # a preset's own, else every layer's experts
    a.model_shape = dataclasses.replace(
        a.model_shape, window_size=size, window_layers=tuple(layers),
        moe_layers=tuple(moe_args.moe_layers(freq, a.model_shape.num_layers)))
    sp, ep = a.sequence_parallel is not False, a.expert_model_parallel_size or 1
    error = expert_tp_error(a) or moe_error(a.model_shape, ep, a.tp or 1, freq, data_ranks(a),
                                            a.expert_tensor_parallel_size, sp)
    if error and a.expert_tensor_parallel_size is None and (a.tp or 1) > 1 and sp and not \
            moe_error(a.model_shape, ep, a.tp, freq, data_ranks(a), 1):
        error += (" (with --expert-tensor-parallel-size 1, whole experts, it would split the "
                  "tp x dp x cp ranks)")
    if error:
        ap.error(error)
    pipeline_split(ap, a)
    return a


def pipeline_split(ap, a):
    """--pipeline-model-parallel-layout (with --pp) -> a.model_chunk_layers and a.virtual_stages,
    refused as pretrain_gpt.py refuses it (pipeline_args, engine::stage_layers);
    --account-for-embedding/loss-in-pipeline-split checked against the other split flags and,
    with --pp, the layers (the search splits each pp x v that way, planner_split)."""
    layout = a.pipeline_model_parallel_layout
    accounted = a.account_for_embedding_in_pipeline_split or a.account_for_loss_in_pipeline_split
    if layout is None and not accounted:
        return
    if layout is not None and a.pp is None:
        ap.error("--pipeline-model-parallel-layout needs --pp (its stages are pp x virtual "
                 "stages)")
    if a.pp is None:  # pipeline_args' exclusion; the split is checked per pp in the search
        if a.decoder_first_pipeline_num_layers is not None or \
                a.decoder_last_pipeline_num_layers is not None:
            ap.error("--account-for-embedding/loss-in-pipeline-split excludes "
                     "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers")
        return
    model = a.model_shape
    t = argparse.Namespace(
        num_layers=model.num_layers, mtp_num_layers=model.mtp_num_layers,
        num_layers_per_virtual_pipeline_stage=None,
        num_virtual_stages_per_pipeline_rank=None if layout else a.virtual_stages,
        decoder_first_pipeline_num_layers=a.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=a.decoder_last_pipeline_num_layers,
        account_for_embedding_in_pipeline_split=a.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=a.account_for_loss_in_pipeline_split,
        pipeline_model_parallel_layout=layout)
    pipeline_args.validate(t, lambda ok, message: ok or ap.error(message), a.pp)
    if layout is None:
        return  # v 1 (or the given v) divides: the search tries every v that does
    if a.virtual_stages not in (None, t.virtual_stages):
        ap.error(f"--virtual-stages {a.virtual_stages}: the layout's {a.pp * t.virtual_stages} "
                 f"stages over --pp {a.pp} are {t.virtual_stages} virtual stages")
    if t.virtual_stages > 1 and a.pp == 1:
        ap.error("virtual pipeline stages need --pipeline-model-parallel-size > 1")
    try:
        planner_split.chunk_layers(model.num_layers, a.pp, t.virtual_stages,
                                   chunks=t.model_chunk_layers)
    except ValueError as e:
        ap.error(without_source(e))
    a.virtual_stages, a.model_chunk_layers = t.virtual_stages, tuple(t.model_chunk_layers)


def heads_error(shape) -> str | None:
    """What pretrain_gpt.py refuses in the planned model's heads (a preset's with the flags
    given), or None: hidden / heads is the head width unless --kv-channels (or multi-latent
    attention) gives it, and the query groups divide the heads."""
    heads, groups = shape.num_attention_heads, shape.kv_heads
    if not (shape.kv_channels or shape.multi_latent_attention) and shape.hidden_size % heads:
        return (f"--hidden-size {shape.hidden_size} is not divisible by --num-attention-heads "
                f"{heads} (or give the head width with --kv-channels)")
    if heads % groups:
        return f"--num-attention-heads {heads} is not divisible by --num-query-groups {groups}"
    return None


def expert_tp_error(a) -> str | None:
    """What is wrong with --expert-tensor-parallel-size (the TP size or 1), or None; a size above
    1 without --tp fixes it."""
    etp = a.expert_tensor_parallel_size
    if etp is None or etp == 1:
        return None
    if a.tp is None:
        a.tp = etp
    if etp != a.tp:
        return (f"--expert-tensor-parallel-size {etp}: braid splits experts over the TP group "
                f"(--tp {a.tp}) or keeps them whole (1)")
    return None


MLA_FLAGS = ("q_lora_rank", *attention_args.DEFAULTS)


def latent_attention(ap, a, shape, preset=None):
    """`shape` with multi-latent attention where --multi-latent-attention (or the preset) asks
    for it: the ranks and widths given, else the preset's, else Megatron's defaults
    (attention_args.DEFAULTS; no query latent)."""
    given = {f: getattr(a, f) for f in MLA_FLAGS if getattr(a, f) is not None}
    mla_preset = preset is not None and preset.multi_latent_attention
    if not (a.multi_latent_attention or mla_preset):
        if given:
            ap.error(f"--{next(iter(given)).replace('_', '-')} needs --multi-latent-attention")
        return shape
    if a.kv_channels is not None:
        ap.error("--kv-channels with --multi-latent-attention: the heads' widths are "
                 "--qk-head-dim + --qk-pos-emb-head-dim (queries, keys) and --v-head-dim")
    defaults = {f: getattr(preset, f) for f in MLA_FLAGS} if mla_preset else \
        dict(attention_args.DEFAULTS, q_lora_rank=0)
    try:
        return dataclasses.replace(shape, multi_latent_attention=True, **{**defaults, **given})
    except ValueError as e:
        ap.error(str(e))


def recompute_modules(ap, a):
    """--recompute-modules refused as pretrain_gpt.py refuses it (recompute_args, with --recompute
    for --recompute-granularity); mla_up_proj -> a.recompute_mla_up_proj."""
    t = argparse.Namespace(
        recompute_modules=a.recompute_modules, recompute_method=None, recompute_num_layers=None,
        recompute_granularity=None if a.recompute == "none" else a.recompute,
        multi_latent_attention=a.model_shape.multi_latent_attention)
    recompute_args.validate(t, lambda ok, message: ok or ap.error(
        message.replace("--recompute-granularity", "--recompute")))
    a.recompute_mla_up_proj = "mla_up_proj" in (a.recompute_modules or ()) or None


def data_ranks(a) -> int | None:
    """dp x cp where the fixed layout flags say it (tp x pp x dp x cp = the GPUs), else None."""
    if a.tp and a.pp and a.num_gpus % (a.tp * a.pp) == 0:
        return a.num_gpus // (a.tp * a.pp)
    return a.dp * a.cp if a.dp and a.cp else None


def moe_error(shape, expert_parallel: int, tp: int, freq=1, data=None, etp=None, sp=True):
    """pretrain_gpt.py's verdict (moe_args.check, its rules and words) on the planned model's
    experts, --moe-layer-freq, --expert-model-parallel-size and --expert-tensor-parallel-size
    `etp` (with `data`, the dp x cp ranks where known; `sp`, sequence parallelism), or None;
    its TP size named as plan.py's --tp (given, or the --expert-tensor-parallel-size it follows)."""
    error = moe_args.check(argparse.Namespace(
        num_experts=shape.num_experts or None,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size or None,
        moe_router_topk=shape.moe_router_topk, moe_router_pre_softmax=False,
        moe_shared_expert_intermediate_size=shape.moe_shared_expert_intermediate_size or None,
        moe_shared_expert_gate=shape.moe_shared_expert_gate,
        moe_aux_loss_coeff=0.0, moe_router_score_function="softmax",
        moe_router_load_balancing_type="aux_loss", moe_router_num_groups=None,
        moe_router_group_topk=None, moe_router_topk_scaling_factor=None,
        moe_router_enable_expert_bias=False, moe_router_bias_update_rate=None,
        moe_z_loss_coeff=None, moe_expert_capacity_factor=None, moe_token_drop_policy=None,
        moe_pad_expert_input_to_capacity=False, moe_layer_freq=freq,
        expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=etp,
        sequence_parallel=sp, micro_batch_size=1, context_parallel_size=1,
        num_layers=shape.num_layers, ffn_hidden_size=shape.ffn_hidden_size), tp, data)
    return error and error.replace("--tensor-model-parallel-size", "--tp")


MODEL_FLAGS = ("model", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "ffn_hidden_size", "vocab_size", "seq_length", "activation",
               "window_size", "window_attn_skip_freq", "num_experts", "moe_router_topk",
               "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
               "moe_shared_expert_gate", "moe_layer_freq", "qk_layernorm",
               "multi_latent_attention", "mtp_num_layers", *MLA_FLAGS)
LAYOUT_FLAGS = ("tp", "pp", "cp", "dp", "micro_batch_size", "virtual_stages", "recompute",
                "recompute_method", "recompute_num_layers", "recompute_modules",
                "sequence_parallel", "zero",
                "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                "account_for_loss_in_pipeline_split", "expert_model_parallel_size",
                "expert_tensor_parallel_size", "grad_reduce_in_bf16")


def _from_training_arguments(ap, a, training):
    """The plan of the run pretrain_gpt.py `training` describes on this cluster."""
    given = [f for f in MODEL_FLAGS + LAYOUT_FLAGS
             if getattr(a, f) is not None and getattr(a, f) is not False]
    if given:
        ap.error(f"--{given[0].replace('_', '-')}: with training arguments after --, the model "
                 "and the layout are theirs")
    for flag, theirs in (("global_batch", "--global-batch-size"),
                         ("train_tokens", "--train-iters or --train-samples")):
        if getattr(a, flag) is not None:
            ap.error(f"--{flag.replace('_', '-')}: with training arguments after --, the run's "
                     f"{theirs} gives it")
    if "--device" not in training:
        training = [*training, "--device", "cuda"]  # a GPU run, planned from anywhere
    try:
        t = parse_training_args(training, a.num_gpus, check_files=False)
    except ValueError as e:
        ap.error(f"the training arguments: {e}")
    a.model_shape = planner.ModelShape(
        t.num_layers, t.hidden_size, t.num_attention_heads, t.num_query_groups,
        t.ffn_hidden_size, t.vocab_size, t.seq_length,
        "swiglu" if t.swiglu else "quick_geglu" if t.quick_geglu else
        "squared_relu" if t.squared_relu else "gelu",
        not t.untie_embeddings_and_output_weights, t.qk_layernorm,
        0 if t.multi_latent_attention else t.kv_channels,  # MLA: the widths below
        t.window_size, tuple(t.window_layers), t.num_experts or 0, t.moe_router_topk,
        t.moe_ffn_hidden_size or 0, t.moe_shared_expert_intermediate_size or 0,
        t.moe_shared_expert_gate, tuple(moe_args.moe_layers(t.moe_layer_freq, t.num_layers)),
        mtp_num_layers=getattr(t, "mtp_num_layers", None) or 0,
        add_bias_linear=not t.disable_bias_linear, normalization=t.normalization,
        softmax_type=t.softmax_type,
        **({} if not t.multi_latent_attention else dict(
            multi_latent_attention=True, q_lora_rank=t.q_lora_rank or 0,
            **{f: getattr(t, f) for f in attention_args.DEFAULTS})))
    a.global_batch = t.global_batch_size
    # The samples the run's iterations read; those of a --rampup-batch-size phase at their own
    # batches' step times, for the run's layout (docs/planner.md).
    a.train_tokens = t.train_end_samples * t.seq_length
    a.rampup = None if a.search else rampup_phases(t.batch_layout, t.train_end_samples)
    if a.gpu_hour_price is not None and t.gpu_hour_price is not None:
        ap.error(f"--gpu-hour-price {a.gpu_hour_price:g} here and {t.gpu_hour_price:g} in the "
                 "training arguments: give it once")
    a.gpu_hour_price = a.gpu_hour_price or t.gpu_hour_price
    a.grad_reduce_in_bf16 = t.grad_reduce_in_bf16  # numerics, not layout: --search keeps it
    if not a.search:
        a.tp, a.pp, a.dp = t.tensor_model_parallel_size, t.pipeline_model_parallel_size, t.dp
        a.cp, a.expert_model_parallel_size = t.context_parallel_size, t.expert_model_parallel_size
        a.expert_tensor_parallel_size = t.expert_tensor_parallel_size or a.tp  # unset: the TP size
        a.micro_batch_size, a.virtual_stages = t.micro_batch_size, t.virtual_stages
        a.recompute = t.recompute_granularity or "none"
        if a.recompute == "full":
            a.recompute_method = t.recompute_method or "uniform"
            a.recompute_num_layers = t.recompute_num_layers or 1
        a.recompute_mla_up_proj = "mla_up_proj" in (t.recompute_modules or ()) or None
        a.sequence_parallel, a.zero = t.sequence_parallel, t.use_distributed_optimizer
        a.no_overlap_grad_reduce = not t.overlap_grad_reduce
        a.no_overlap_param_gather = not t.overlap_param_gather
        a.decoder_first_pipeline_num_layers = t.decoder_first_pipeline_num_layers
        a.decoder_last_pipeline_num_layers = t.decoder_last_pipeline_num_layers
        a.even_stages = t.stage_layers is None  # the run's split, not a search of splits
        a.model_chunk_layers = tuple(t.model_chunk_layers)  # a layout's or the accounted split
    return a


def rampup_phases(batches, end: int) -> list[tuple[int, int]]:
    """(global batch, steps) of each batch below the full one that a run's steps up to sample
    `end` take (Megatron's --rampup-batch-size, as braid's BatchLayout `batches` steps it)."""
    steps, consumed = {}, 0
    while consumed < end:
        batch = batches.global_batch_size_at(consumed)
        if batch == batches.global_batch_size:
            break
        steps[batch] = steps.get(batch, 0) + 1
        consumed += batch
    return sorted(steps.items())


def stages(layers: list[int], chunks: list[int] | None = None) -> str:
    """Layers per pipeline stage, short: "even", "5|3", "7|8..|7" (first, the middle, last); with
    every model chunk's (a layout's, the accounted split's) those, runs counted: "0|4*6|3"."""
    if chunks:
        runs = []
        for n in chunks:
            if runs and runs[-1][0] == n:
                runs[-1][1] += 1
            else:
                runs.append([n, 1])
        return "|".join(f"{n}*{k}" if k > 1 else str(n) for n, k in runs)
    if len(set(layers)) == 1:
        return "even"
    if len(layers) == 2:
        return f"{layers[0]}|{layers[1]}"
    return f"{layers[0]}|{layers[1]}..|{layers[-1]}"


def recompute(r) -> str:
    """none, selective, selective+up (MLA's up projections too), full (uniform groups of 1),
    uniform3, block2 (full, N layers)."""
    if r.get("recompute_mla_up_proj"):
        return "selective+up"
    if r["recompute"] != "full" or (r["recompute_method"], r["recompute_num_layers"]) == \
            ("uniform", 1):
        return r["recompute"]
    return f"{r['recompute_method']}{r['recompute_num_layers']}"


def experts(r) -> str:
    """The table's ep column: "8", or "8:etp1" with whole experts (at tp > 1)."""
    whole = r["expert_tensor_parallel_size"] == 1 and r["tp"] > 1
    return f"{r['ep']}:etp1" if whole else str(r["ep"])


def main(argv=None):
    a = parse_args(argv)
    model = a.model_shape
    cluster = planner.Cluster(planner.GPUS[a.gpu], a.gpus_per_node, a.num_gpus, a.nvlink, a.net)
    fixed = dict(tp=a.tp, pp=a.pp, cp=a.cp, dp=a.dp, micro_batch_size=a.micro_batch_size,
                 virtual_stages=a.virtual_stages,
                 first_stage_layers=a.decoder_first_pipeline_num_layers,
                 last_stage_layers=a.decoder_last_pipeline_num_layers,
                 model_chunk_layers=a.model_chunk_layers or None,
                 account_for_embedding=a.account_for_embedding_in_pipeline_split or None,
                 account_for_loss=a.account_for_loss_in_pipeline_split or None,
                 recompute=a.recompute,
                 recompute_method=a.recompute_method,
                 recompute_num_layers=a.recompute_num_layers,
                 recompute_mla_up_proj=a.recompute_mla_up_proj,
                 sequence_parallel=a.sequence_parallel, zero=a.zero,
                 ep=a.expert_model_parallel_size, etp=a.expert_tensor_parallel_size,
                 overlap_grad_reduce=not a.no_overlap_grad_reduce,
                 overlap_param_gather=not a.no_overlap_param_gather,
                 grad_reduce_in_bf16=a.grad_reduce_in_bf16 or None,
                 even_stages=a.even_stages)
    results, rejected = planner.search(model, cluster, a.global_batch, fixed, a.train_tokens,
                                       a.gpu_hour_price, a.rampup)
    if not results:
        why = planner.why_nothing_fits(model, cluster, a.global_batch, fixed)
        if rejected and "out of memory" not in rejected:
            why = "; ".join(rejected)
        if a.json:
            print(json.dumps({"error": why}))
        else:
            print(f"plan.py: no layout: {why}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(results, indent=1))
        return 0
    print(f"{model.num_params() / 1e9:.1f}B parameters on {a.num_gpus} x {a.gpu} "
          f"({a.gpus_per_node}/node), global batch {a.global_batch} x {model.seq_length}; "
          f"{len(results)} layouts fit" + ("; gradients reduced in bf16" if a.grad_reduce_in_bf16
                                           else ""))
    cols = ("tp cp pp dp ep mbs v stages recompute sp zero step_s tok/s mfu hfu mem_GB "
            "(par/grad/opt/act) scaling").split()
    extra = (["days"] if a.train_tokens else []) + (["cost"] if a.gpu_hour_price and
                                                    a.train_tokens else [])
    print(" ".join(f"{c:>8}" for c in cols + extra))
    for r in results[:a.top]:
        p = r["memory_parts_gb"]
        row = [r["tp"], r["cp"], r["pp"], r["dp"], experts(r), r["micro_batch_size"],
               r["virtual_stages"],
               stages(r["stage_layers"], r.get("model_chunk_layers")), recompute(r),
               int(r["sequence_parallel"]), int(r["zero"]),
               f"{r['step_time_s']:.3f}", f"{r['tokens_per_s']:.4g}", f"{r['mfu']:.3f}",
               f"{r['hfu']:.3f}", f"{r['memory_gb_per_gpu']:.1f}",
               f"{p['params']:.0f}/{p['grads']:.0f}/{p['optimizer']:.0f}/{p['activations']:.0f}",
               f"{r['scaling_efficiency']:.3f}"]
        if a.train_tokens:
            row.append(f"{r['days_to_train']:.1f}")
            if a.gpu_hour_price:
                row.append(f"{r['cost']:.4g}")
        print(" ".join(f"{x!s:>8}" for x in row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
