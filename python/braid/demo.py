"""``make demo``: train a small GPT on the embedded addition data on the CPU.

One process by default; under mpirun it trains under a (tp, pp, dp) layout with Megatron's
flags (``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``, dp = ranks / (tp ·
pp), ``--sequence-parallel``, ``--use-distributed-optimizer``, ...): every DP rank reads its own
share of each global batch, and at the end the whole model is gathered onto every rank and rank
0 evaluates it (only rank 0 prints). A bad layout or flag is a ``braid: error: ...`` line (the
same from every rank) and exit code 2.

Prints one line per logging step and, at the end, the exact-match accuracy on held-out
problems as ``demo: accuracy=<fraction> time=<seconds>s`` and a few sampled completions.

The addition problems are written as Megatron ``.bin``/``.idx`` files (under
``--data-cache-path``) and read by braid's GPT data loader, like any dataset; ``--data-path``
trains on yours instead (Megatron's form: ``A`` or ``0.3 A 0.7 B``) and ends with the
validation loss, ``demo: valid_loss=<loss> time=<seconds>s``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

import braid
from braid import addition
from braid.arguments import without_source
from braid.data import DataLoader, build_gpt_datasets
from braid.training import default_cache_dir, error_exit, launched_processes


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m braid.demo", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="gpt2", choices=["gpt2", "llama"],
                   help="gpt2: layernorm, gelu, learned positions; llama: rmsnorm, swiglu, rope")
    p.add_argument("--format", default="padded", choices=["padded", "natural"],
                   help="padded: 364+058=0422 (digits at fixed places, the default); "
                        "natural: 364+58=422 (see docs/demo.md for how each learns)")
    p.add_argument("--short-operand-fraction", type=float, default=0.0,
                   help="fraction of training operands drawn below 10^(digits-1)")
    p.add_argument("--train-iters", type=int, default=1200)
    p.add_argument("--micro-batch-size", type=int, default=96)
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per step over all DP ranks (default: micro-batch size x dp); "
                        "each DP rank runs global / (micro x dp) microbatches")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B: each pipeline rank holds num_layers / (pp x this) "
                        "model chunks")
    p.add_argument("--pipeline-schedule", default="1f1b", choices=["1f1b", "gpipe"])
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true",
                   help="ZeRO-1: each DP rank keeps and updates its shard of the optimizer state")
    p.add_argument("--overlap-grad-reduce", action="store_true")
    p.add_argument("--overlap-param-gather", action="store_true")
    p.add_argument("--ddp-bucket-size", type=int, default=0,
                   help="elements per gradient bucket (0: Megatron's default)")
    p.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--lr-warmup-iters", type=int, default=100)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adam-beta2", type=float, default=0.95)
    p.add_argument("--log-interval", type=int, default=100)
    p.add_argument("--eval-problems", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--data-path", nargs="+", default=None,
                   help="train on these indexed datasets instead of the addition problems "
                        "(Megatron's form: PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ...)")
    p.add_argument("--split", default="969,30,1", help="train,valid,test weights (--data-path)")
    p.add_argument("--seq-length", type=int, default=None,
                   help=f"tokens per sample (default {addition.SEQ_LENGTH}, one addition problem)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="model vocabulary; required with --data-path")
    p.add_argument("--eval-iters", type=int, default=10,
                   help="validation batches at the end (--data-path)")
    p.add_argument("--data-cache-path", default=None,
                   help="where the addition data and the sample indices are written (default: "
                        "~/.cache/braid/demo; with --data-path, next to each dataset)")
    g = p.add_argument_group("checkpoints (Megatron's flags)")
    g.add_argument("--save", default=None, metavar="DIR",
                   help="save checkpoints here (every --save-interval iterations, at the end, "
                        "and when an exit condition fires)")
    g.add_argument("--load", default=None, metavar="DIR",
                   help="resume from this directory's latest checkpoint (iteration, optimizer, "
                        "RNG, data position) under any layout; none yet: start from scratch")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true", help="load the parameters, not "
                   "the optimizer state")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load the parameters only; iteration, optimizer, RNG and data start anew")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background while training goes on")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="load this iteration instead of the latest")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save and exit 0 when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save and exit 0 after this many minutes of training")
    args = p.parse_args(argv)
    if args.data_path and args.vocab_size is None:
        p.error("--data-path needs --vocab-size (the tokenizer's vocabulary)")
    if not args.data_path and args.seq_length not in (None, addition.SEQ_LENGTH):
        p.error(f"the addition data has {addition.SEQ_LENGTH} tokens per sample; --seq-length "
                "is for --data-path")
    return args


def checkpoint_flag_error(args) -> str | None:
    """The first checkpoint flag that does not fit the others, as an error message."""
    if args.save_interval is not None and args.save_interval <= 0:
        return f"--save-interval must be positive, got {args.save_interval}"
    for flag, value in (("--save-interval", args.save_interval), ("--async-save", args.async_save)):
        if value and not args.save:
            return f"{flag} needs --save DIR"
    for flag, value in (("--no-load-optim", args.no_load_optim), ("--no-load-rng", args.no_load_rng),
                        ("--finetune", args.finetune), ("--ckpt-step", args.ckpt_step is not None)):
        if value and not args.load:
            return f"{flag} needs --load DIR"
    if args.ckpt_step is not None and args.ckpt_step < 0:
        return f"--ckpt-step must be >= 0, got {args.ckpt_step}"
    if args.exit_interval is not None and args.exit_interval <= 0:
        return f"--exit-interval must be positive, got {args.exit_interval}"
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        return f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}"
    return None


def training_data(args):
    """(train, valid) datasets: the user's --data-path, or the addition problems written once."""
    samples = args.train_iters * args.global_batch_size
    seq_length = args.seq_length or addition.SEQ_LENGTH
    if args.data_path:
        train, valid, _ = build_gpt_datasets(
            args.data_path, seq_length, [samples, args.eval_iters * args.global_batch_size, 0],
            split=args.split, seed=args.seed, cache_path=args.data_cache_path or "")
        return train, valid
    # One problem per sample: one more problem than samples, so that one epoch covers the run.
    directory = args.data_cache_path or default_cache_dir()
    width = args.format == "padded"
    prefix = addition.training_data_prefix(directory, samples + 1, seed=args.seed,
                                           short_fraction=args.short_operand_fraction,
                                           padded=width)
    if not os.path.exists(prefix + ".idx"):  # .idx is renamed into place last
        addition.write_training_data(prefix, samples + 1, seed=args.seed,
                                     short_fraction=args.short_operand_fraction, padded=width)
    train, _, _ = build_gpt_datasets([prefix], addition.SEQ_LENGTH, [samples, 0, 0], split="1",
                                     seed=args.seed, cache_path=args.data_cache_path or "")
    return train, None


def mean_loss(model, loader, batches: int) -> float:
    """Mean next-token cross-entropy over up to `batches` batches."""
    losses = []
    for _ in range(batches):
        batch = loader.next()
        if batch is None:
            break
        logits = np.from_dlpack(model.logits(batch.tokens)).astype(np.float64)
        labels = np.asarray(batch.labels)
        logits -= logits.max(axis=-1, keepdims=True)
        log_probs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
        losses.append(-np.take_along_axis(log_probs, labels[..., None], axis=-1).mean())
    return float(np.mean(losses)) if losses else float("nan")


def demo_config(args) -> braid.TransformerConfig:
    cfg = braid.TransformerConfig.preset(f"{args.model}-tiny")
    cfg.num_layers = args.num_layers
    cfg.hidden_size = args.hidden_size
    cfg.num_attention_heads = args.num_attention_heads
    cfg.num_query_groups = args.num_attention_heads
    cfg.ffn_hidden_size = 4 * args.hidden_size if args.model == "gpt2" else 8 * args.hidden_size // 3
    cfg.vocab_size = args.vocab_size or addition.VOCAB_SIZE
    cfg.max_position_embeddings = args.seq_length or addition.SEQ_LENGTH
    cfg.validate()
    return cfg


class Job:
    """The run's model and trainer: one process, or this rank's share of a (tp, pp, dp) layout."""

    def __init__(self, args, cfg):
        parallel = (launched_processes() > 1 or args.tensor_model_parallel_size > 1
                    or args.pipeline_model_parallel_size > 1)
        self.state = None
        self.rank, self.dp_rank, self.dp = 0, 0, 1
        if parallel:
            braid.init_distributed(args.distributed_timeout_minutes)
            self.state = braid.ParallelState(tp=args.tensor_model_parallel_size,
                                             pp=args.pipeline_model_parallel_size)
            self.rank, self.dp_rank, self.dp = self.state.rank, self.state.dp_rank, self.state.dp
        if args.global_batch_size is None:
            args.global_batch_size = args.micro_batch_size * self.dp
        if args.global_batch_size % (args.micro_batch_size * self.dp):
            raise ValueError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                             f"--micro-batch-size {args.micro_batch_size} x dp {self.dp}")
        self.schedule = braid.LRSchedule(lr=args.lr, min_lr=args.min_lr,
                                         warmup_iters=args.lr_warmup_iters,
                                         decay_iters=args.train_iters, style="cosine")
        self.optim = braid.AdamWConfig(lr=args.lr, beta2=args.adam_beta2,
                                       weight_decay=args.weight_decay, clip_grad=1.0)
        if not parallel:
            self.model = braid.GPTModel(cfg, device=args.device, seed=args.seed)
            self.trainer = braid.Trainer(self.model, self.optim, self.schedule)
            return
        virtual = 1
        if args.num_layers_per_virtual_pipeline_stage:
            per_rank = cfg.num_layers // args.pipeline_model_parallel_size
            if per_rank % args.num_layers_per_virtual_pipeline_stage:
                raise ValueError(
                    f"--num-layers-per-virtual-pipeline-stage "
                    f"{args.num_layers_per_virtual_pipeline_stage} does not divide the "
                    f"{per_rank} layers of each pipeline rank")
            virtual = per_rank // args.num_layers_per_virtual_pipeline_stage
        ddp = braid.DDPConfig(bucket_size=args.ddp_bucket_size,
                              overlap_grad_reduce=args.overlap_grad_reduce,
                              use_distributed_optimizer=args.use_distributed_optimizer,
                              overlap_param_gather=args.overlap_param_gather)
        self.parallel = braid.ParallelModel(
            cfg, args.device, args.seed, self.state,
            braid.ParallelConfig(sequence_parallel=args.sequence_parallel,
                                 virtual_stages=virtual, ddp=ddp))
        self.trainer = braid.Trainer(
            self.parallel, braid.TrainerConfig(self.optim, self.schedule,
                                               pipeline_schedule=args.pipeline_schedule))
        self.model = None  # the whole model, gathered at the end (whole_model)

    def barrier(self):
        if self.state is not None:
            self.state.barrier()

    def whole_model(self, cfg, args) -> braid.GPTModel:
        """The trained model in one process (gathered from every rank when parallel)."""
        if self.model is None:
            self.model = braid.GPTModel(cfg, device="cpu", seed=args.seed)
            self.parallel.gather_into(self.model)
        return self.model

    def describe(self, args) -> str:
        if self.state is None:
            return f"on {args.device}"
        s = self.state
        extras = [name for name, on in (("sequence parallel", args.sequence_parallel),
                                        ("distributed optimizer", args.use_distributed_optimizer),
                                        ("overlapped grad reduce", args.overlap_grad_reduce),
                                        ("overlapped param gather", args.overlap_param_gather))
                  if on]
        chunks = self.parallel.num_chunks
        return (f"on {s.world_size} x {args.device} ranks, tp={s.tp} pp={s.pp} dp={s.dp}"
                + (f" ({chunks} virtual stages)" if chunks > 1 else "")
                + (", " + ", ".join(extras) if extras else ""))


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    cfg = demo_config(args)
    try:
        error = checkpoint_flag_error(args)
        if error:
            raise ValueError(error)
        job = Job(args, cfg)
    except ValueError as e:
        return error_exit(without_source(e))  # alike on every rank, before any collective
    log = print if job.rank == 0 else (lambda *a, **k: None)

    # --load: the iteration, optimizer, RNG and data position of the latest checkpoint (any
    # layout); nothing there yet starts from scratch, as Megatron does.
    consumed = 0
    if args.load:
        if args.ckpt_step is None and braid.latest_iteration(args.load) < 0:
            log(f"demo: no checkpoint in {args.load} yet; training from scratch", flush=True)
        else:
            try:
                consumed = braid.load_checkpoint(
                    args.load, job.trainer, load_optim=not args.no_load_optim,
                    load_rng=not args.no_load_rng, finetune=args.finetune,
                    iteration=-1 if args.ckpt_step is None else args.ckpt_step)
            except ValueError as e:  # every rank reads the same metadata: all fail alike
                return error_exit(without_source(e))
            log(f"demo: loaded iteration {job.trainer.iteration} from {args.load} "
                f"({consumed} samples consumed)", flush=True)
    first = job.trainer.iteration + 1

    # Rank 0 writes the data and the sample indices first; the others then map them.
    if job.rank == 0:
        train, valid = training_data(args)
    job.barrier()
    if job.rank != 0:
        train, valid = training_data(args)
    loader = DataLoader(train, args.micro_batch_size, args.global_batch_size,
                        dp_rank=job.dp_rank, dp_size=job.dp, consumed_samples=consumed,
                        prefetch=4)
    what = ("samples of " + " ".join(args.data_path) if args.data_path
            else "addition problems")
    if job.rank == 0:
        params = cfg.num_parameters()
        log(f"demo: GPT with {params:,} parameters ({cfg.num_layers} layers, hidden "
            f"{cfg.hidden_size}) {job.describe(args)}, {args.train_iters} iterations of "
            f"{args.global_batch_size} {what}", flush=True)

    saver = braid.CheckpointSaver(args.save, async_save=args.async_save) if args.save else None
    saved = job.trainer.iteration if args.load and args.save == args.load else -1
    exits = None
    if args.save or args.exit_interval or args.exit_duration_in_mins:
        # SIGTERM/SIGUSR1 (a scheduler taking the job back) save and exit when there is --save.
        exits = braid.ExitConditions(exit_interval=args.exit_interval or 0,
                                     exit_duration_minutes=args.exit_duration_in_mins or 0.0,
                                     signals=bool(args.save))

    def save(it: int):
        nonlocal saved
        if saver is not None and saved != it:
            saver.save(job.trainer, loader.consumed_samples)
            saved = it

    precise = args.log_interval == 1  # every loss, all the digits an f32 has
    tokens_since, time_since, train_start = 0, time.perf_counter(), time.perf_counter()
    for it in range(first, args.train_iters + 1):
        batch = loader.next()
        if batch is None:  # a loaded data position past what these --train-iters hold
            return error_exit(f"the training data ran out before iteration {it} "
                              f"({loader.consumed_samples} samples consumed)")
        ids, targets = batch.tokens, batch.labels
        if not args.data_path:
            targets = addition.answer_targets(np.asarray(ids), np.asarray(targets))
        stats = job.trainer.train_step(ids, targets, batch.num_microbatches)
        tokens_since += args.global_batch_size * cfg.max_position_embeddings
        if it % args.log_interval == 0 or it == args.train_iters:
            now = time.perf_counter()
            loss = f"{stats.loss:.9g}" if precise else f"{stats.loss:.4f}"
            log(f"step {it:5d}/{args.train_iters} | loss {loss} | lr {stats.lr:.3e} | "
                f"grad norm {stats.grad_norm:.3f} | tokens/s {tokens_since / (now - time_since):,.0f}",
                flush=True)
            tokens_since, time_since = 0, now
        if saver is not None and args.async_save:
            saver.poll(job.trainer)  # commits a finished background save (collective)
        if args.save_interval and it % args.save_interval == 0:
            save(it)
        reason = exits.check(job.trainer, it) if exits is not None else ""
        if reason:
            save(it)
            if saver is not None:
                saver.wait(job.trainer)
            where = f"; checkpoint saved to {args.save}" if saver is not None else ""
            log(f"demo: exiting at iteration {it} ({reason}){where}", flush=True)
            return 0
    if saver is not None:
        save(job.trainer.iteration)
        saver.wait(job.trainer)
    train_seconds = time.perf_counter() - train_start
    log(f"demo: waited {loader.wait_seconds:.3f}s for data "
        f"({100 * loader.wait_seconds / train_seconds:.2f}% of {train_seconds:.1f}s training)",
        flush=True)
    model = job.whole_model(cfg, args)
    if job.rank != 0:
        job.barrier()  # wait (asleep, not spinning) while rank 0 evaluates
        return 0

    if args.data_path:
        source = valid if valid is not None else train
        eval_loader = DataLoader(source, args.micro_batch_size, args.micro_batch_size)
        loss = mean_loss(model, eval_loader, args.eval_iters)
        name = "valid_loss" if valid is not None else "train_loss"
        print(f"demo: {name}={loss:.4f} time={time.perf_counter() - start:.1f}s", flush=True)
        job.barrier()
        return 0

    def logits_fn(ids: np.ndarray) -> np.ndarray:
        return np.from_dlpack(model.logits(ids))

    data = addition.AdditionData(seed=args.seed, short_fraction=args.short_operand_fraction,
                                 padded=args.format == "padded")
    problems = data.held_out_problems(args.eval_problems)
    answers = addition.greedy_answers(logits_fn, problems, data.width)
    expected = [addition.expected_answer(a, b, data.width) for a, b in problems]
    correct = [ans == want for ans, want in zip(answers, expected)]
    acc = sum(correct) / len(problems)
    for (a, b), ans, want in list(zip(problems, answers, expected))[:6]:
        prompt = addition.problem_text(a, b, data.width)[0]
        print(f"  {prompt}{ans:<5} {'ok' if ans == want else 'wrong (' + want + ')'}")
    print(f"demo: accuracy={acc:.3f} time={time.perf_counter() - start:.1f}s", flush=True)
    job.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
