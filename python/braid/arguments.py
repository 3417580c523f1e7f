"""pretrain_gpt.py's command line: Megatron-LM's argument names for what braid supports.

``parse_args(argv, world_size)`` returns the arguments with Megatron's derived values filled in
(``dp``, ``global_batch_size``, ``max_position_embeddings``, ...) or raises ``ArgumentError``:
one message naming the argument and the rule. Every rank parses and checks alike, before MPI is
up, so a bad value ends every rank the same way and none waits in a collective.

A Megatron argument braid does not implement is an error naming it (and, for the common ones,
why and what to use instead); an argument neither knows is an error too. Nothing is ignored
silently: the Megatron flags that only pick an implementation where braid has its own are
accepted and the log says so (braid.megatron_flags). The list, with defaults and rules:
docs/arguments.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re

from braid import (activation_args, attention_args, checkpoint_args, checkpoint_flags, moe_args,
                   pipeline_args, recompute_args, schedule_args, validation_sets, wandb_log,
                   window_args, data_args_files)
from braid.megatron_flags import NO_EFFECT, ONLY_VALUE, UNSUPPORTED, only_value_error  # noqa: F401


# Megatron's --mtp-loss-scaling-factor default. The argument defaults to None so that one
# given without --mtp-num-layers is refused.
MTP_LOSS_SCALING_FACTOR = 0.1


class ArgumentError(ValueError):
    """A bad or unsupported argument: the message names it and the rule."""


def without_source(error: ValueError) -> str:
    """A braid ConfigError's message without the C++ source location it ends with."""
    return re.sub(r" \[[^\]]+:\d+\]$", "", str(error))


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors (bad type, missing value) as exceptions
        raise ArgumentError(message)


def _positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _non_negative(kind):
    def parse(text):
        value = kind(text)
        if value < 0 or (isinstance(value, float) and math.isnan(value)):
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    parse.__name__ = f"non-negative {kind.__name__}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    pos_int, pos_float = _positive(int), _positive(float)
    nonneg_int, nonneg_float = _non_negative(int), _non_negative(float)
    p = _Parser(prog="pretrain_gpt.py", allow_abbrev=False,
                description="Train a GPT or Llama model with braid under mpirun, with "
                            "Megatron-LM's arguments (docs/arguments.md).")
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=pos_int, default=4)
    g.add_argument("--hidden-size", type=pos_int, default=128)
    g.add_argument("--ffn-hidden-size", type=pos_int, default=None,
                   help="default 4 x hidden (with --swiglu: 2/3 of that, a multiple of 64)")
    g.add_argument("--num-attention-heads", type=pos_int, default=4)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--kv-channels", type=pos_int, default=None,
                   help="each attention head's width (default --hidden-size / --num-attention-heads)")
    g.add_argument("--num-query-groups", type=pos_int, default=1,
                   help="key/value heads with --group-query-attention")
    g.add_argument("--seq-length", type=pos_int, default=None,
                   help="default: 16 on the addition data, else required")
    g.add_argument("--max-position-embeddings", type=pos_int, default=None,
                   help="default --seq-length")
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   choices=["learned_absolute", "rope", "yarn"],
                   help="yarn: rope with YaRN (newer Megatron's spelling of --rope-type yarn)")
    g.add_argument("--use-rotary-position-embeddings", dest="position_embedding_type",
                   action="store_const", const="rope",
                   help="Megatron's older spelling of --position-embedding-type rope")
    g.add_argument("--rotary-seq-len-interpolation-factor", type=pos_int, default=None,
                   help="linear position interpolation: RoPE turns position p as p / factor "
                        "(1: none)")
    g.add_argument("--rotary-base", type=pos_float, default=10000.0)
    g.add_argument("--rotary-percent", type=pos_float, default=1.0,
                   help="the fraction of each head RoPE turns, its leading channels "
                        "(GPT-NeoX and StableLM: 0.25)")
    g.add_argument("--rotary-interleaved", action="store_true",
                   help="RoPE pairs channels 2i and 2i + 1 (GPT-J's), not i and i + half")
    g.add_argument("--use-rope-scaling", action="store_true",
                   help="Llama 3.1's RoPE frequency scaling (with --position-embedding-type rope)")
    g.add_argument("--rope-scaling-factor", type=pos_float, default=None,
                   help="with --use-rope-scaling: the factor (default 8, Llama 3.1's; 32 for "
                        "Llama 3.2)")
    g.add_argument("--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"])
    g.add_argument("--norm-epsilon", type=pos_float, default=1e-5)
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="every norm's weight holds gamma - 1 and starts at zero; the norm "
                        "scales by 1 + weight")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--openai-gelu", action="store_true",
                   help="GELU's tanh form, whatever the fusion (otherwise Megatron's rule: the "
                        "tanh form in the fused bias-GELU, the exact erf form without biases or "
                        "with --no-bias-gelu-fusion)")
    g.add_argument("--no-bias-gelu-fusion", action="store_true",
                   help="Megatron's unfused GELU: the exact (erf) form (no effect with --swiglu "
                        "or --squared-relu)")
    g.add_argument("--squared-relu", action="store_true",
                   help="relu(x)^2 in an ungated MLP (Nemotron-4) instead of GELU")
    activation_args.add_arguments(g)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="a --normalization norm on every query and key head before RoPE (Qwen3)")
    g.add_argument("--add-qkv-bias", action="store_true",
                   help="biases on the query, key and value projections (Qwen2's), also with "
                        "--disable-bias-linear")
    g.add_argument("--window-size", type=window_args.window_size, default=None,
                   help="sliding-window attention W,0: each query sees itself and the W keys "
                        "before it (Mistral v0.1: 4095,0)")
    g.add_argument("--window-attn-skip-freq", type=window_args.skip_freq, default=None,
                   help="with --window-size: N - every Nth layer attends to everything; or a "
                        "list, one 0 (full) or 1 (window) per layer, e.g. \"[1,1,1,0]*3\"")
    attention_args.add_arguments(g, pos_int, pos_float, nonneg_float)
    moe_args.add_arguments(g, pos_int, nonneg_float, pos_float)
    g.add_argument("--mtp-num-layers", type=int, default=None,
                   help="DeepSeek-V3's multi-token prediction: this many extra layers on the "
                        "last pipeline stage, the k-th predicting the token k + 1 ahead through "
                        "the shared embedding and output head (default: none)")
    g.add_argument("--mtp-loss-scaling-factor", type=nonneg_float, default=None,
                   help="with --mtp-num-layers: the weight of the mean of the MTP layers' losses "
                        f"in the training loss (default {MTP_LOSS_SCALING_FACTOR:g})")
    g.add_argument("--init-method-std", type=pos_float, default=0.02)
    g.add_argument("--embedding-init-method-std", type=pos_float, default=None,
                   help="the word and position embeddings' init std (default: "
                        "--init-method-std)")
    g.add_argument("--hidden-dropout", type=nonneg_float, default=0.1)
    g.add_argument("--attention-dropout", type=nonneg_float, default=0.1,
                   help="dropout of the attention probabilities (Megatron's default 0.1); on "
                        "a GPU a value above 0 runs braid's own attention kernels in place "
                        "of cuDNN's")
    g.add_argument("--vocab-size", type=pos_int, default=None,
                   help="the tokenizer's vocabulary (with --data-path / --mock-data: this, or "
                        "a --tokenizer-type)")
    g.add_argument("--make-vocab-size-divisible-by", type=pos_int, default=128)
    recompute_args.add_arguments(g, pos_int)

    g = p.add_argument_group("tokenizer (sizes the vocabulary; the data is tokenized already)")
    from braid import tokenizer_args
    tokenizer_args.add_arguments(g)

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=pos_int, default=16)
    g.add_argument("--global-batch-size", type=pos_int, default=None,
                   help="default micro-batch size x data-parallel size")
    g.add_argument("--train-iters", type=pos_int, default=None)
    g.add_argument("--train-samples", type=pos_int, default=None,
                   help="instead of --train-iters: iterations = samples / global batch")
    g.add_argument("--rampup-batch-size", type=pos_int, nargs=3, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="with --train-samples: start the global batch at START and grow it by "
                        "INCREMENT, evenly over the first SAMPLES samples, up to "
                        "--global-batch-size")
    g.add_argument("--iterations-to-skip", type=nonneg_int, nargs="+", default=[], metavar="N",
                   help="drop the batch of the iteration after N completed ones (the step "
                        "logged as N + 1: Megatron's count) without training on it")
    g.add_argument("--seed", type=nonneg_int, default=1234)
    g.add_argument("--exit-interval", type=pos_int, default=None)
    g.add_argument("--exit-duration-in-mins", type=pos_float, default=None)
    g.add_argument("--exit-cost", type=pos_float, default=None, metavar="C",
                   help="save (with --save) and exit 0 once the run has cost C: its device-hours "
                        "x --gpu-hour-price, over every job of the run (checkpoints carry what "
                        "the jobs before used)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="save and exit on SIGTERM (braid does this whenever --save is given)")

    schedule_args.add_arguments(p, pos_float, nonneg_float, pos_int, nonneg_int)

    g = p.add_argument_group("mixed precision")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 parameters and activations on CUDA devices (the CPU computes in "
                        "float32; the log says so)")
    g.add_argument("--loss-scale", type=pos_float, default=None,
                   help="a constant loss scale; default: none for bf16/f32 (Megatron's)")
    g.add_argument("--initial-loss-scale", type=pos_float, default=2.0**32,
                   help="with --dynamic-loss-scale")
    g.add_argument("--dynamic-loss-scale", action="store_true",
                   help="Megatron's dynamic scaler (skip, halve on overflow; grow after a window)")
    g.add_argument("--min-loss-scale", type=pos_float, default=1.0)
    g.add_argument("--loss-scale-window", type=pos_int, default=1000)
    g.add_argument("--hysteresis", type=pos_int, default=2)

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=pos_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=pos_int, default=1)
    g.add_argument("--context-parallel-size", type=pos_int, default=1,
                   help="ranks that split each sequence (2 chunks each, balanced for causal "
                        "attention); they read the same samples")
    pipeline_args.add_arguments(g, pos_int)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--ddp-bucket-size", type=pos_int, default=None)
    g.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="reduce the gradients over data parallelism as bf16 (half the bytes; "
                        "accumulated in f32, rounded once per step)")
    g.add_argument("--distributed-timeout-minutes", type=pos_float, default=10.0)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ... (Megatron .bin/.idx)")
    g.add_argument("--split", default="969,30,1")
    for split in ("train", "valid", "test"):
        g.add_argument(f"--{split}-data-path", nargs="+", default=None,
                       help=f"the {split} split's own datasets, used whole (instead of "
                            "--data-path and --split): PREFIX, or WEIGHT PREFIX ...")
    data_args_files.add_arguments(g)
    g.add_argument("--mock-data", action="store_true",
                   help="megatron-core's mock data: its synthetic documents, samples and order")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="no loss where the input token is the tokenizer's end of document (the "
                        "prediction of the next document's first token)")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="document masking: a token attends only to its own document's tokens "
                        "(a document ends with the tokenizer's end-of-document token)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="positions (rope, learned) restart at each document's first token")
    g.add_argument("--data-cache-path", default=None)

    g = p.add_argument_group("validation")
    g.add_argument("--eval-interval", type=pos_int, default=1000)
    g.add_argument("--eval-iters", type=nonneg_int, default=100, help="0: no validation")
    g.add_argument("--skip-train", action="store_true",
                   help="no training: evaluate the validation and test splits (of the --load "
                        "checkpoint, or the initial model) and exit")
    validation_sets.add_arguments(g)

    checkpoint_flags.add_arguments(p, pos_int, nonneg_int)

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=pos_int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--tensorboard-log-interval", type=pos_int, default=1)
    g.add_argument("--log-params-norm", action="store_true",
                   help="the global norm of the parameters in the log line and the metrics "
                        "(params-norm): one all-reduce more per logged or recorded iteration")
    g.add_argument("--log-throughput", action="store_true",
                   help="Megatron's 'throughput per GPU (TFLOP/s/GPU)' field in the log line "
                        "(braid's own throughput and MFU end every line anyway)")
    g.add_argument("--timing-log-level", type=int, default=0, choices=[0, 1, 2],
                   help="where each rank's step time went, every --log-interval: 1: compute, "
                        "pipeline wait, communication wait; 2: the wait by group (tp, dp, "
                        "other). 0: off (no tracing)")
    g.add_argument("--timing-log-option", default="minmax", choices=["max", "minmax", "all"],
                   help="timers across ranks: the max, the min and max, or every rank's")
    g.add_argument("--log-num-zeros-in-grad", action="store_true",
                   help="count the zero gradient elements every step (each element once over "
                        "all ranks): num zeros in the log line, num-zeros in the metrics")
    g.add_argument("--log-memory-to-tensorboard", action="store_true",
                   help="write rank 0's device memory as metrics: mem-allocated-bytes, "
                        "mem-max-allocated-bytes (the step's peak), mem-reserved-bytes (held by "
                        "braid's caching allocator)")
    g.add_argument("--log-world-size-to-tensorboard", action="store_true",
                   help="write the job's number of processes as a metric: world-size")
    g.add_argument("--empty-unused-memory-level", type=int, default=0, choices=[0, 1, 2],
                   help="1 or 2: give the caching allocator's free blocks back to the device "
                        "after every training step and evaluation (Megatron's "
                        "torch.cuda.empty_cache(); braid's step is one call, so both levels "
                        "release after it)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="write the timers as metrics: <name>-time (max over ranks, ms) and "
                        "<name>-time-mean")
    g.add_argument("--profile", action="store_true",
                   help="trace iterations --profile-step-start to --profile-step-end - 1 on "
                        "the --profile-ranks ranks: braid's Chrome traces (Perfetto, "
                        "tools/plot_schedule.py) in --tensorboard-dir/traces/rank<r>.json")
    g.add_argument("--profile-step-start", type=pos_int, default=10)
    g.add_argument("--profile-step-end", type=pos_int, default=12)
    g.add_argument("--profile-ranks", type=nonneg_int, nargs="+", default=[0],
                   help="global ranks to trace")
    wandb_log.add_arguments(g)

    g = p.add_argument_group("braid")
    g.add_argument("--device", default=None, choices=["cpu", "cuda"],
                   help="default: cuda when a GPU is visible, else cpu")
    g.add_argument("--pipeline-schedule", default="1f1b", choices=["1f1b", "gpipe"])
    g.add_argument("--metrics-jsonl", default=None, metavar="PATH",
                   help="append one JSON line of metrics per logged iteration (default with "
                        "--tensorboard-dir: DIR/metrics.jsonl)")
    g.add_argument("--gpu-hour-price", type=nonneg_float, default=None, metavar="P",
                   help="price of one device-hour (any currency): cost so far and projected")
    g.add_argument("--progress-bar", default="auto", choices=["auto", "on", "off"],
                   help="a progress bar with the ETA under the log; auto: on a terminal, in one "
                        "process (mpirun gives ranks a pseudo-terminal even when its own output "
                        "is a file, so under mpirun say on)")
    g.add_argument("--peak-tflops", type=pos_float, default=None,
                   help="the device's peak for MFU (default: A100 312, H100/H200 989, the CPU "
                        "measured)")

    g = p.add_argument_group("accepted from Megatron scripts, no effect in braid")
    for flag, (takes_value, why) in NO_EFFECT.items():
        if takes_value == "+":
            g.add_argument(flag, nargs="+", default=None, metavar="VALUE", help=why)
        elif isinstance(takes_value, list):  # one of Megatron's values, a typo refused
            g.add_argument(flag, default=None, choices=takes_value, help=why)
        elif takes_value:
            g.add_argument(flag, default=None, metavar="VALUE", help=why)
        else:
            g.add_argument(flag, action="store_true", help=why)
    for flag, (_, why) in ONLY_VALUE.items():
        g.add_argument(flag, default=None, metavar="VALUE", help="braid's value only: " + why)
    return p


def _refuse_unknown(unknown: list[str]):
    for item in unknown:
        flag = item.split("=", 1)[0]
        if not flag.startswith("--"):
            raise ArgumentError(f"unexpected value '{item}' (not after an argument that takes it)")
        if flag in UNSUPPORTED:
            raise ArgumentError(f"{flag} is not supported by braid: {UNSUPPORTED[flag]}")
        raise ArgumentError(f"{flag} is not a braid argument (the ones braid takes: "
                            "docs/arguments.md or --help)")


def parse_args(argv: list[str] | None, world_size: int,
               check_files: bool = True) -> argparse.Namespace:
    """Parses and checks `argv` for a job of `world_size` processes; ArgumentError on any
    problem. Fills in Megatron's derived values. check_files=False (tools/plan.py, planning on
    another machine) does not look for the --data-path files."""
    args, unknown = build_parser().parse_known_args(argv)
    _refuse_unknown(unknown)
    _check_error(attention_args.take_position_yarn(args))  # before a checkpoint's are compared
    args.checkpoint_vocab = False  # True: --use-checkpoint-args set --vocab-size
    args.checkpoint_args = _checkpoint_model_args(args) if args.use_checkpoint_args else []
    validate(args, world_size, check_files)
    if check_files and args.use_checkpoint_opt_param_scheduler:
        saved, why_not = _saved_schedule(args)
        if saved is not None:
            args.checkpoint_args += schedule_args.take_checkpoints(args, saved, _check)
        elif why_not:
            args.checkpoint_args.append(f"braid: --use-checkpoint-opt_param-scheduler: {why_not}"
                                        "; the command line's learning-rate schedule is used")
    return args


def _saved_schedule(a: argparse.Namespace) -> tuple[dict | None, str | None]:
    """(the lr_schedule of the checkpoint this run continues with its optimizer, or None and
    why not: it loads none, restarts the optimizer (--finetune, --no-load-optim, a checkpoint
    saved without it) or the checkpoint has no schedule recorded)."""
    _check(a.load is not None, "--use-checkpoint-opt_param-scheduler needs --load DIR")
    import braid
    if a.ckpt_step is None and braid.latest_iteration(a.load) < 0:
        return None, f"no checkpoint in {a.load} yet"
    try:
        meta = braid.checkpoint_metadata(a.load, -1 if a.ckpt_step is None else a.ckpt_step)
    except ValueError:
        return None, None  # the load itself reports what is wrong with the checkpoint
    if not schedule_args.continues_optimizer(a, meta):
        return None, ("the run restarts the optimizer (--finetune, --no-load-optim, or a "
                      "checkpoint saved without it), and with it the schedule")
    if meta.get("lr_schedule") is None:
        return None, ("the checkpoint records no learning-rate schedule (braid saved none "
                      "before it recorded them)")
    return meta["lr_schedule"], None


def _checkpoint_model_args(a: argparse.Namespace) -> list[str]:
    """Sets the model arguments from the checkpoint --load names (Megatron's
    --use-checkpoint-args); the log lines of those that change what the command line said."""
    _check(a.load is not None, "--use-checkpoint-args needs --load DIR")
    import braid
    if a.ckpt_step is None and braid.latest_iteration(a.load) < 0:
        return [f"braid: --use-checkpoint-args: no checkpoint in {a.load} yet; the model "
                "arguments are the command line's"]
    try:
        config = braid.checkpoint_metadata(a.load, -1 if a.ckpt_step is None
                                           else a.ckpt_step).get("config", {})
    except ValueError as e:
        raise ArgumentError(f"--use-checkpoint-args: {e}") from None
    try:
        model_args = checkpoint_args.model_args(config)
    except ValueError as e:
        raise ArgumentError(f"--use-checkpoint-args: {e}") from None
    notes = []
    a.checkpoint_vocab = True
    for dest, value in model_args:
        mine = getattr(a, dest)
        if mine is None and value is not None:  # the command line's default
            mine = attention_args.command_line_default(a, dest)
        if mine != value:
            flag = "--" + dest.replace("_", "-")
            notes.append(f"braid: {flag} {value} from the checkpoint (the command line: "
                         f"{getattr(a, dest)})")
            setattr(a, dest, value)
    a.group_query_attention = a.num_query_groups != a.num_attention_heads
    return notes


def _check(ok: bool, message: str):
    if not ok:
        raise ArgumentError(message)


def _check_error(message: str | None):
    """A helper module's check: its error, or None."""
    _check(message is None, message)


def _check_data_files(flag: str, data_path: list[str] | None):
    """Every prefix of a --data-path style list has its .bin and .idx (before any rank starts
    building indices from them)."""
    if not data_path:
        return
    from braid.data import parse_data_path
    try:
        prefixes, _ = parse_data_path(data_path)
    except ValueError as e:
        raise ArgumentError(f"{flag} {' '.join(data_path)}: {e}") from None
    for prefix in prefixes:
        missing = [prefix + ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
        _check(not missing, f"{flag}: no {' or '.join(missing)} (a prefix names the .bin/.idx "
               "pair tools/preprocess_data.py writes)")


def _check_mtp(a: argparse.Namespace):
    """Multi-token prediction's flags: at least one layer, RoPE (TransformerConfig refuses MTP
    with learned absolute positions; here it is refused naming the flags) and a finite loss
    weight."""
    n, factor = a.mtp_num_layers, a.mtp_loss_scaling_factor
    if n is None:
        _check(factor is None, "--mtp-loss-scaling-factor needs --mtp-num-layers")
        return
    _check(n >= 1, f"--mtp-num-layers must be >= 1, got {n} (omit it for no multi-token "
           "prediction)")
    _check(a.position_embedding_type == "rope",
           f"--mtp-num-layers needs --position-embedding-type rope, got "
           f"{a.position_embedding_type} (braid's MTP depths do not shift learned positions)")
    _check(factor is None or math.isfinite(factor),
           f"--mtp-loss-scaling-factor must be finite, got {factor}")


def validate(a: argparse.Namespace, world_size: int, check_files: bool = True):
    tp, pp, cp = (a.tensor_model_parallel_size, a.pipeline_model_parallel_size,
                  a.context_parallel_size)
    _check(world_size % (tp * cp * pp) == 0,
           f"the job's {world_size} processes are not divisible by --tensor-model-parallel-size "
           f"{tp}" + (f" x --context-parallel-size {cp}" if cp > 1 else "") +
           f" x --pipeline-model-parallel-size {pp}")
    a.dp = world_size // (tp * cp * pp)
    a.world_size = world_size
    sizes = a.hierarchical_context_parallel_sizes  # no effect, but Megatron's assertion holds
    _check(sizes is None or (all(re.fullmatch(r"[0-9]+", x) for x in sizes)
                             and math.prod(int(x) for x in sizes) == cp),
           f"--hierarchical-context-parallel-sizes {' '.join(sizes or [])}: their product must "
           f"be --context-parallel-size {cp}, as Megatron asserts")
    error = only_value_error(a)  # Megatron flags braid takes at its own value only
    _check(error is None, error)

    # Model shape.
    attention_error = attention_args.check(a)  # sets kv_channels with --multi-latent-attention
    _check(attention_error is None, attention_error)
    if a.kv_channels is None:  # Megatron: the head width is hidden / heads unless given
        _check(a.hidden_size % a.num_attention_heads == 0,
               f"--hidden-size {a.hidden_size} is not divisible by --num-attention-heads "
               f"{a.num_attention_heads} (or give the head width with --kv-channels)")
        a.kv_channels = a.hidden_size // a.num_attention_heads
    _check(not a.skip_train or a.eval_iters > 0 or a.full_validation, "--skip-train evaluates: "
           "it needs --eval-iters > 0 (or --full-validation)")
    if not a.group_query_attention:
        a.num_query_groups = a.num_attention_heads
    _check(a.num_attention_heads % a.num_query_groups == 0,
           f"--num-attention-heads {a.num_attention_heads} is not divisible by "
           f"--num-query-groups {a.num_query_groups}")
    _check(a.num_attention_heads % tp == 0,
           f"--num-attention-heads {a.num_attention_heads} is not divisible by "
           f"--tensor-model-parallel-size {tp}")
    if a.ffn_hidden_size is None:
        a.ffn_hidden_size = 4 * a.hidden_size
        if a.swiglu:  # Megatron: 2/3 of 4h, rounded down to a multiple of 64
            a.ffn_hidden_size = max(64, int(4 * a.hidden_size * 2 / 3) // 64 * 64)
    _check(a.ffn_hidden_size % tp == 0,
           f"--ffn-hidden-size {a.ffn_hidden_size} is not divisible by "
           f"--tensor-model-parallel-size {tp}")
    _check(not (a.swiglu and a.squared_relu), "--swiglu and --squared-relu are two activations; "
           "give one")
    _check_error(activation_args.check(a))
    moe_error = moe_args.check(a, tp, a.dp * cp)
    _check(moe_error is None, moe_error)
    _check_mtp(a)
    _check(not a.no_position_embedding or a.position_embedding_type == "rope",
           "--no-position-embedding with --position-embedding-type "
           f"{a.position_embedding_type}: a model without positions (NoPE) is not one of "
           "braid's; with --position-embedding-type rope it changes nothing")
    _check(a.hidden_dropout < 1.0, f"--hidden-dropout must be < 1, got {a.hidden_dropout}")
    _check(a.attention_dropout < 1.0,
           f"--attention-dropout must be < 1, got {a.attention_dropout}")
    recompute_args.validate(a, _check)
    _check(a.adam_beta1 < 1.0 and a.adam_beta2 < 1.0,
           f"--adam-beta1 and --adam-beta2 must be < 1, got {a.adam_beta1}, {a.adam_beta2}")

    # Data.
    data_args_files.resolve(a, _check, check_files)
    per_split = a.train_data_path or a.valid_data_path or a.test_data_path
    _check(not (a.data_path and per_split), "give --data-path (with --split) or "
           "--train-data-path / --valid-data-path / --test-data-path, not both")
    _check(not per_split or a.train_data_path or a.skip_train, "--valid-data-path / "
           "--test-data-path need --train-data-path (or --skip-train, evaluating only)")
    _check(not ((a.data_path or per_split) and a.mock_data),
           "--mock-data excludes --data-path and --train-data-path")
    a.addition_data = not a.data_path and not per_split and not a.mock_data
    if a.data_path:
        from braid.data import parse_split
        try:
            train_share = parse_split(a.split)[0]
        except ValueError as e:
            raise ArgumentError(without_source(e)) from None
        _check(train_share > 0 or a.skip_train, f"--split {a.split} leaves no documents to train "
               "on (give the training split a weight, or --skip-train to evaluate only)")
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        if check_files:
            _check_data_files(flag, getattr(a, flag[2:].replace("-", "_")))
    from braid import tokenizer_args
    tokenizer_args.validate(a, _check, check_files)
    validation_sets.validate(a, _check)
    if a.addition_data:
        from braid import addition
        _check(a.seq_length in (None, addition.SEQ_LENGTH),
               f"--seq-length {a.seq_length}: the embedded addition data has "
               f"{addition.SEQ_LENGTH} tokens per sample (give --data-path or --mock-data for "
               "other lengths)")
        _check(a.vocab_size in (None, addition.VOCAB_SIZE),
               f"--vocab-size {a.vocab_size}: the embedded addition data has a vocabulary of "
               f"{addition.VOCAB_SIZE} (byte-level)")
        a.seq_length = addition.SEQ_LENGTH
        a.vocab_size = addition.VOCAB_SIZE
    else:
        what = "--data-path" if a.data_path else "--train-data-path" if per_split \
            else "--mock-data"
        _check(a.vocab_size is not None,
               f"{what} needs --vocab-size or --tokenizer-type (the vocabulary of the tokenizer "
               "the data was made with)")
        _check(a.seq_length is not None, f"{what} needs --seq-length")
    if a.max_position_embeddings is None:
        a.max_position_embeddings = a.seq_length
    _check(a.seq_length <= a.max_position_embeddings,
           f"--seq-length {a.seq_length} exceeds --max-position-embeddings "
           f"{a.max_position_embeddings}")
    _check(a.rope_scaling_factor is None or a.use_rope_scaling,
           "--rope-scaling-factor needs --use-rope-scaling")
    _check(not a.use_rope_scaling or a.position_embedding_type == "rope",
           "--use-rope-scaling needs --position-embedding-type rope")
    _check(a.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {a.rotary_percent}")
    interpolation = a.rotary_seq_len_interpolation_factor or 1
    _check(interpolation == 1 or a.position_embedding_type == "rope",
           "--rotary-seq-len-interpolation-factor needs --position-embedding-type rope")
    _check(interpolation == 1 or not a.use_rope_scaling,
           "--rotary-seq-len-interpolation-factor and --use-rope-scaling exclude each other (one "
           "way of stretching RoPE's positions at a time)")
    _check(a.rotary_percent == 1.0 or a.position_embedding_type == "rope",
           "--rotary-percent needs --position-embedding-type rope")
    _check(not a.rotary_interleaved or a.position_embedding_type == "rope",
           "--rotary-interleaved needs --position-embedding-type rope")
    rotary_dim = int(a.kv_channels * a.rotary_percent)  # Megatron's and HF's rounding
    _check(a.position_embedding_type != "rope" or a.multi_latent_attention  # MLA: attention_args
           or (rotary_dim > 0 and rotary_dim % 2 == 0),
           f"--rotary-percent {a.rotary_percent} turns int({a.kv_channels} x "
           f"{a.rotary_percent}) = {rotary_dim} channels of each head; RoPE turns pairs, so "
           "that must be even and nonzero")
    _check(a.window_attn_skip_freq is None or (a.window_size is not None and a.window_size >= 0),
           "--window-attn-skip-freq needs --window-size")
    try:
        a.window_size, a.window_layers = window_args.model_window(
            a.window_size, window_args.window_layers(a.window_attn_skip_freq, a.num_layers))
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    _check(cp == 1 or a.seq_length % (2 * cp) == 0,
           f"--context-parallel-size {cp}: --seq-length {a.seq_length} is not divisible by "
           f"2 x {cp} (each rank holds 2 chunks of every sequence)")
    _check(not a.sequence_parallel or a.seq_length % (tp * cp) == 0,
           f"--sequence-parallel: --seq-length {a.seq_length} is not divisible by "
           f"--tensor-model-parallel-size {tp}" + (f" x --context-parallel-size {cp}"
                                                   if cp > 1 else ""))

    # Batches and iterations.
    if a.global_batch_size is None:
        a.global_batch_size = a.micro_batch_size * a.dp
    _check(a.global_batch_size % (a.micro_batch_size * a.dp) == 0,
           f"--global-batch-size {a.global_batch_size} is not divisible by --micro-batch-size "
           f"{a.micro_batch_size} x data-parallel size {a.dp}")
    a.num_microbatches = a.global_batch_size // (a.micro_batch_size * a.dp)
    _check(not (a.train_iters and a.train_samples),
           "give --train-iters or --train-samples, not both")
    # Megatron's: a ramp is counted in samples, so the run is too.
    _check(a.rampup_batch_size is None or a.train_samples,
           "--rampup-batch-size needs --train-samples (the ramp and the run are counted in "
           "samples), not --train-iters")
    # Each step's global batch (and, under --rampup-batch-size, how it grows): braid's rules
    # (data::BatchLayout) and their messages.
    from braid import _C
    try:
        a.batch_layout = _C.BatchLayout(a.micro_batch_size, a.global_batch_size, dp_size=a.dp,
                                        rampup_batch_size=a.rampup_batch_size)
    except ValueError as e:
        raise ArgumentError(without_source(e).replace(
            "micro_batch_size x dp_size", "--micro-batch-size x data-parallel size")) from None
    if a.train_samples:
        first_batch = a.batch_layout.global_batch_size_at(0)
        _check(a.train_samples >= first_batch,
               f"--train-samples {a.train_samples} is less than one global batch "
               f"({first_batch})")
        a.train_iters = a.batch_layout.steps_between(0, a.train_samples)
    if a.train_iters is None:
        a.train_iters = 500
    # The training data's size in samples, as Megatron sizes it, and the samples the training
    # iterations read (a partial last batch of --train-samples is dropped).
    a.train_data_samples = a.train_samples or a.train_iters * a.global_batch_size
    a.train_end_samples = a.batch_layout.samples_after(a.train_iters)
    schedule_args.validate(a, _check)
    schedule_args.check_optimizer(a, _check)

    # Pipeline.
    pipeline_args.validate(a, _check, pp)
    if a.virtual_stages > 1:
        _check(pp > 1, "virtual pipeline stages need --pipeline-model-parallel-size > 1")
        _check(a.num_microbatches % pp == 0,
               f"the interleaved schedule needs the number of microbatches "
               f"({a.num_microbatches} = --global-batch-size / (--micro-batch-size x dp)) to be "
               f"a multiple of --pipeline-model-parallel-size {pp}")
        if a.rampup_batch_size:
            start, increment, _ = a.rampup_batch_size
            for batch in range(start, a.global_batch_size, increment):
                microbatches = batch // (a.micro_batch_size * a.dp)
                _check(microbatches % pp == 0,
                       f"--rampup-batch-size: the ramp's global batch {batch} makes "
                       f"{microbatches} microbatch{'es' if microbatches != 1 else ''}, and the "
                       f"interleaved schedule needs a "
                       f"multiple of --pipeline-model-parallel-size {pp} at every step")
        _check(a.pipeline_schedule == "1f1b", "virtual pipeline stages need --pipeline-schedule 1f1b")
    a.stage_layers = None  # [pp rank][chunk] = (first layer, end), when not even
    first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
    if first is not None or last is not None or a.model_chunk_layers:
        from braid import _C  # braid's own rule (engine::stage_layers) and its messages
        try:
            a.stage_layers = _C.stage_layers(a.num_layers, pp, a.virtual_stages, first, last,
                                             a.model_chunk_layers)
        except ValueError as e:
            raise ArgumentError(without_source(e)) from None
    _check(not a.overlap_param_gather or a.use_distributed_optimizer,
           "--overlap-param-gather needs --use-distributed-optimizer")

    # Precision and device.
    if a.device is None:
        import braid
        a.device = "cuda" if braid.cuda_available() else "cpu"
    _check(a.loss_scale is None or not a.dynamic_loss_scale,
           "give --loss-scale (constant) or --dynamic-loss-scale, not both")

    # Checkpoints.
    _check(a.exit_cost is None or a.gpu_hour_price is not None,
           "--exit-cost needs --gpu-hour-price (the price of one device-hour)")
    checkpoint_flags.validate(a, _check)
    wandb_log.validate(a, _check)
    # Profiling.
    if a.profile:
        _check(a.tensorboard_dir is not None,
               "--profile needs --tensorboard-dir (the traces go to DIR/traces)")
        _check(a.profile_step_start < a.profile_step_end,
               f"--profile-step-start {a.profile_step_start} must be before --profile-step-end "
               f"{a.profile_step_end} (iterations start to end - 1 are traced)")
        _check(a.profile_step_start <= a.train_iters,
               f"--profile-step-start {a.profile_step_start} is after the last iteration "
               f"({a.train_iters})")
        bad = [r for r in a.profile_ranks if r >= world_size]
        _check(not bad, f"--profile-ranks {' '.join(map(str, bad))}: the job has ranks 0 to "
               f"{world_size - 1}")
    if a.tensorboard_dir and a.metrics_jsonl is None:
        a.metrics_jsonl = os.path.join(a.tensorboard_dir, "metrics.jsonl")
