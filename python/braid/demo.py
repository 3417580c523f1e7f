"""``make demo``: train a small GPT on the embedded addition data on the CPU.

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
from braid.data import DataLoader, build_gpt_datasets


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
    args = p.parse_args(argv)
    if args.data_path and args.vocab_size is None:
        p.error("--data-path needs --vocab-size (the tokenizer's vocabulary)")
    if not args.data_path and args.seq_length not in (None, addition.SEQ_LENGTH):
        p.error(f"the addition data has {addition.SEQ_LENGTH} tokens per sample; --seq-length "
                "is for --data-path")
    return args


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "braid", "demo")


def training_data(args):
    """(train, valid) datasets: the user's --data-path, or the addition problems written once."""
    samples = args.train_iters * args.micro_batch_size
    seq_length = args.seq_length or addition.SEQ_LENGTH
    if args.data_path:
        train, valid, _ = build_gpt_datasets(
            args.data_path, seq_length, [samples, args.eval_iters * args.micro_batch_size, 0],
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


def main(argv=None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    cfg = demo_config(args)
    model = braid.GPTModel(cfg, device=args.device, seed=args.seed)
    schedule = braid.LRSchedule(lr=args.lr, min_lr=args.min_lr, warmup_iters=args.lr_warmup_iters,
                                decay_iters=args.train_iters, style="cosine")
    optim = braid.AdamWConfig(lr=args.lr, beta2=args.adam_beta2, weight_decay=args.weight_decay,
                              clip_grad=1.0)
    trainer = braid.Trainer(model, optim, schedule)
    train, valid = training_data(args)
    loader = DataLoader(train, args.micro_batch_size, args.micro_batch_size, prefetch=4)
    what = ("samples of " + " ".join(args.data_path) if args.data_path
            else "addition problems")
    print(f"demo: GPT with {model.num_parameters():,} parameters ({cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}) on {args.device}, {args.train_iters} iterations of "
          f"{args.micro_batch_size} {what}", flush=True)

    tokens_since, time_since, train_start = 0, time.perf_counter(), time.perf_counter()
    for it in range(1, args.train_iters + 1):
        batch = loader.next()
        ids, targets = batch.tokens, batch.labels
        if not args.data_path:
            targets = addition.answer_targets(np.asarray(ids), np.asarray(targets))
        stats = trainer.train_step(ids, targets)
        tokens_since += args.micro_batch_size * cfg.max_position_embeddings
        if it % args.log_interval == 0 or it == args.train_iters:
            now = time.perf_counter()
            print(f"step {it:5d}/{args.train_iters} | loss {stats.loss:.4f} | lr {stats.lr:.3e} | "
                  f"grad norm {stats.grad_norm:.3f} | tokens/s {tokens_since / (now - time_since):,.0f}",
                  flush=True)
            tokens_since, time_since = 0, now
    train_seconds = time.perf_counter() - train_start
    print(f"demo: waited {loader.wait_seconds:.3f}s for data "
          f"({100 * loader.wait_seconds / train_seconds:.2f}% of {train_seconds:.1f}s training)",
          flush=True)

    if args.data_path:
        source = valid if valid is not None else train
        eval_loader = DataLoader(source, args.micro_batch_size, args.micro_batch_size)
        loss = mean_loss(model, eval_loader, args.eval_iters)
        name = "valid_loss" if valid is not None else "train_loss"
        print(f"demo: {name}={loss:.4f} time={time.perf_counter() - start:.1f}s", flush=True)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
