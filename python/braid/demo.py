"""``make demo``: train a small GPT on the embedded addition data on the CPU.

Prints one line per logging step and, at the end, the exact-match accuracy on held-out
problems as ``demo: accuracy=<fraction> time=<seconds>s`` and a few sampled completions.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import braid
from braid import addition


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
    return p.parse_args(argv)


def demo_config(args) -> braid.TransformerConfig:
    cfg = braid.TransformerConfig.preset(f"{args.model}-tiny")
    cfg.num_layers = args.num_layers
    cfg.hidden_size = args.hidden_size
    cfg.num_attention_heads = args.num_attention_heads
    cfg.num_query_groups = args.num_attention_heads
    cfg.ffn_hidden_size = 4 * args.hidden_size if args.model == "gpt2" else 8 * args.hidden_size // 3
    cfg.vocab_size = addition.VOCAB_SIZE
    cfg.max_position_embeddings = addition.SEQ_LENGTH
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
    data = addition.AdditionData(seed=args.seed, short_fraction=args.short_operand_fraction,
                                 padded=args.format == "padded")
    print(f"demo: GPT with {model.num_parameters():,} parameters ({cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}) on {args.device}, {args.train_iters} iterations of "
          f"{args.micro_batch_size} addition problems", flush=True)

    tokens_since, time_since = 0, time.perf_counter()
    for it in range(1, args.train_iters + 1):
        ids, targets = data.batch(args.micro_batch_size)
        stats = trainer.train_step(ids, targets)
        tokens_since += ids.size
        if it % args.log_interval == 0 or it == args.train_iters:
            now = time.perf_counter()
            print(f"step {it:5d}/{args.train_iters} | loss {stats.loss:.4f} | lr {stats.lr:.3e} | "
                  f"grad norm {stats.grad_norm:.3f} | tokens/s {tokens_since / (now - time_since):,.0f}",
                  flush=True)
            tokens_since, time_since = 0, now

    def logits_fn(ids: np.ndarray) -> np.ndarray:
        return np.from_dlpack(model.logits(ids))

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
