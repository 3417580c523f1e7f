"""One training step of braid against PyTorch eager on the same GPT (same machine, same run).

Each implementation runs in its own process (so peak memory is its own), does warm-up steps,
then times `--steps` steps of forward + backward + AdamW. Prints tokens/s and peak memory of
each, and as the last line the ratio braid/PyTorch of tokens/s.

    python benchmarks/step_bench.py                       # CPU, f32 (the issue's config)
    python benchmarks/step_bench.py --device cuda --dtype bf16
    python benchmarks/step_bench.py --attention-dropout 0.1   # both drop attention probabilities
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-attention-heads", type=int, default=6)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=50304)
    p.add_argument("--attention-dropout", type=float, default=0.0,
                   help="dropout of the attention probabilities, in both (PyTorch's attn_pdrop)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--impl", choices=["braid", "torch"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


def batches(args):
    rng = np.random.default_rng(0)
    shape = (args.micro_batch_size, args.seq_length)
    for _ in range(args.warmup + args.steps):
        ids = rng.integers(0, args.vocab_size, size=shape, dtype=np.int32)
        yield ids, np.roll(ids, -1, axis=1)


def run_braid(args):
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import braid

    cfg = braid.TransformerConfig.preset("gpt2-tiny")
    cfg.num_layers, cfg.hidden_size = args.num_layers, args.hidden_size
    cfg.num_attention_heads = cfg.num_query_groups = args.num_attention_heads
    cfg.ffn_hidden_size, cfg.vocab_size = 4 * args.hidden_size, args.vocab_size
    cfg.max_position_embeddings = args.seq_length
    cfg.attention_dropout = args.attention_dropout
    cfg.params_dtype = args.dtype
    device = "cuda:0" if args.device == "cuda" else "cpu"
    model = braid.GPTModel(cfg, device=device, seed=1)
    trainer = braid.Trainer(model, braid.AdamWConfig(lr=1e-4), braid.LRSchedule(lr=1e-4, style="constant"))
    times = []
    for i, (ids, targets) in enumerate(batches(args)):
        if i == args.warmup:
            braid.reset_peak_memory(device)
        t0 = time.perf_counter()
        trainer.train_step(ids, targets)  # returns after the step completed (loss is read back)
        times.append(time.perf_counter() - t0)
    peak = braid.memory_stats(device)["peak_bytes"]
    return times[args.warmup:], peak, model.num_parameters()


def run_torch(args):
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    hf_cfg = transformers.GPT2Config(
        vocab_size=args.vocab_size, n_positions=args.seq_length, n_embd=args.hidden_size,
        n_layer=args.num_layers, n_head=args.num_attention_heads, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=args.attention_dropout, activation_function="gelu_new")
    hf_cfg._attn_implementation = "sdpa"
    model = transformers.GPT2LMHeadModel(hf_cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    autocast = torch.autocast(device_type=args.device, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    times = []
    for i, (ids, _) in enumerate(batches(args)):
        x = torch.from_numpy(ids.astype(np.int64)).to(device)
        if i == args.warmup and args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast:
            loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if args.device == "cuda" else None
    return times[args.warmup:], peak, sum(p.numel() for p in model.parameters())


def child(args):
    times, peak, nparams = (run_braid if args.impl == "braid" else run_torch)(args)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    blas = None
    if args.impl == "braid" and args.device == "cpu":
        import braid
        blas = braid.cpu_blas()
    print(json.dumps({"times": times, "peak_bytes": peak, "rss_bytes": rss, "params": nparams,
                      "cpu_blas": blas}))


def measure(impl, argv):
    env = dict(os.environ, OMP_NUM_THREADS=str(parse_args(argv).threads))
    out = subprocess.run([sys.executable, __file__, *argv, "--impl", impl], env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{impl} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.impl:
        return child(args)
    tokens = args.micro_batch_size * args.seq_length
    print(f"step_bench: GPT {args.num_layers} layers, hidden {args.hidden_size}, heads "
          f"{args.num_attention_heads}, seq {args.seq_length}, batch {args.micro_batch_size}, vocab "
          f"{args.vocab_size}, {args.dtype} on {args.device}, {args.threads} threads, median of {args.steps} steps"
          + (f", attention dropout {args.attention_dropout:g}" if args.attention_dropout else ""))
    results = {}
    for impl in ("braid", "torch"):
        r = measure(impl, argv)
        step = float(np.median(r["times"]))
        results[impl] = tokens / step
        mem = f"peak alloc {r['peak_bytes'] / 2**20:8.1f} MiB, " if r["peak_bytes"] else ""
        print(f"{impl:>6}: {r['params']:,} params | step {step * 1e3:8.1f} ms | {tokens / step:9.0f} tokens/s | "
              f"{mem}peak RSS {r['rss_bytes'] / 2**20:8.1f} MiB")
        if r.get("cpu_blas"):
            print(f"        OpenBLAS {r['cpu_blas']['kernels']} kernels "
                  f"({r['cpu_blas']['chosen_by']})")
    print(f"ratio braid/pytorch tokens/s: {results['braid'] / results['torch']:.2f}")


if __name__ == "__main__":
    main()
