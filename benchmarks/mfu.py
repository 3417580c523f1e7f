"""Model-FLOPs utilisation of a braid training step on one GPU.

A Llama-style stack (hidden 4096, 32 heads, 8 KV heads, ffn 14336, SwiGLU, RoPE, RMSNorm,
vocab 128256, seq 4096, bf16) with as many layers as fit: two probe runs (2 and 4 layers)
measure the memory of a step, the layer count is what the device's memory then allows, and
the timed run trains it (forward + backward + AdamW, median of --steps after --warmup).
Each run is its own process, so a probe's memory is not the next one's. Prints the step time,
tokens/s, TFLOP/s (model FLOPs, braid.flops) and MFU against --peak-tflops (989, H100/H200).

With --multi-latent-attention the attention is DeepSeek-V3's (query latent 1536, key/value
latent 512, heads of 128 + 64 RoPE channels, values of 128, the latents normed; every head its own
keys and values), on the same stack.

    python benchmarks/mfu.py                     # on cuda:0
    python benchmarks/mfu.py --num-layers 8      # a fixed depth, no probes
    python benchmarks/mfu.py --multi-latent-attention
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--num-layers", type=int, default=0, help="0: as many as fit")
    p.add_argument("--hidden-size", type=int, default=4096)
    p.add_argument("--num-attention-heads", type=int, default=32)
    p.add_argument("--num-query-groups", type=int, default=8)
    p.add_argument("--ffn-hidden-size", type=int, default=14336)
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--recompute-granularity", default="none", choices=["none", "selective", "full"])
    p.add_argument("--multi-latent-attention", action="store_true",
                   help="DeepSeek-V3's attention (the widths below; --num-query-groups ignored)")
    p.add_argument("--q-lora-rank", type=int, default=1536)
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--qk-head-dim", type=int, default=128)
    p.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--memory-fraction", type=float, default=0.9,
                   help="share of the device's memory the chosen depth may use")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config(args, num_layers):
    import braid

    cfg = braid.TransformerConfig.preset("llama3-8b")
    cfg.num_layers = num_layers
    cfg.hidden_size = args.hidden_size
    cfg.num_attention_heads = args.num_attention_heads
    cfg.num_query_groups = args.num_query_groups
    cfg.ffn_hidden_size = args.ffn_hidden_size
    cfg.vocab_size = args.vocab_size
    cfg.max_position_embeddings = args.seq_length
    cfg.params_dtype = "f32" if args.device == "cpu" else "bf16"  # bf16 activations: CUDA only
    cfg.recompute = args.recompute_granularity
    if args.multi_latent_attention:
        cfg.num_query_groups = 0  # every head its own keys and values
        cfg.multi_latent_attention = True
        cfg.qk_layernorm = True  # the latents' norms
        cfg.q_lora_rank = args.q_lora_rank
        cfg.kv_lora_rank = args.kv_lora_rank
        cfg.qk_head_dim = args.qk_head_dim
        cfg.qk_pos_emb_head_dim = args.qk_pos_emb_head_dim
        cfg.v_head_dim = args.v_head_dim
    cfg.validate()
    return cfg


def attention_name(args) -> str:
    if args.multi_latent_attention:
        return (f"{args.num_attention_heads} heads, multi-latent attention (latents "
                f"{args.q_lora_rank}/{args.kv_lora_rank}, heads {args.qk_head_dim}+"
                f"{args.qk_pos_emb_head_dim}, values {args.v_head_dim})")
    return f"{args.num_attention_heads} heads / {args.num_query_groups} kv"


def child(args):
    """One run in this process: prints a JSON line with the step times and peak memory."""
    import braid

    cfg = config(args, args.num_layers)
    model = braid.GPTModel(cfg, device=args.device, seed=1)
    trainer = braid.Trainer(model, braid.AdamWConfig(lr=1e-5, clip_grad=1.0),
                            braid.LRSchedule(lr=1e-5, style="constant"))
    rng = np.random.default_rng(0)
    shape = (args.micro_batch_size, args.seq_length)
    times = []
    for i in range(args.warmup + args.steps):
        ids = rng.integers(0, cfg.vocab_size, size=shape, dtype=np.int32)
        if i == args.warmup:
            braid.reset_peak_memory(args.device)
        t0 = time.perf_counter()
        stats = trainer.train_step(ids, np.roll(ids, -1, axis=1))  # waits for the step
        times.append(time.perf_counter() - t0)
        if not np.isfinite(stats.loss):
            raise SystemExit(f"step {i}: loss {stats.loss}")
    print(json.dumps({"times": times[args.warmup:], "loss": stats.loss,
                      "peak_bytes": braid.memory_stats(args.device)["peak_bytes"],
                      "params": model.num_parameters()}), flush=True)


def run(argv, num_layers, steps=None, warmup=None):
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--child",
           "--num-layers", str(num_layers)]
    if steps is not None:
        cmd += ["--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        return None, out.stderr.strip()[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), ""


def device_memory(device):
    import torch  # only to ask the driver how much memory the device has

    index = int(device.split(":")[1]) if ":" in device else 0
    free, total = torch.cuda.mem_get_info(index)
    return free, torch.cuda.get_device_name(index)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.child:
        return child(args)
    from braid import flops

    layers = args.num_layers
    if layers == 0:
        free, name = device_memory(args.device)
        probes = {}
        for n in (2, 4):
            r, err = run(argv, n, steps=1, warmup=1)
            if r is None:
                sys.exit(f"mfu: the {n}-layer probe failed:\n{err}")
            probes[n] = r["peak_bytes"]
        per_layer = (probes[4] - probes[2]) / 2
        base = probes[2] - 2 * per_layer
        layers = max(1, int((args.memory_fraction * free - base) // per_layer))
        print(f"mfu: {name}, {free / 2**30:.1f} GiB free; a step takes {base / 2**30:.2f} GiB "
              f"+ {per_layer / 2**30:.2f} GiB per layer -> {layers} layers", flush=True)
    result, err = run(argv, layers)
    while result is None and args.num_layers == 0 and layers > 1:
        print(f"mfu: {layers} layers failed ({err.splitlines()[-1] if err else '?'}); "
              f"trying {layers * 9 // 10}", flush=True)
        layers = layers * 9 // 10
        result, err = run(argv, layers)
    if result is None:
        sys.exit(f"mfu: the {layers}-layer run failed:\n{err}")
    cfg = config(args, layers)
    step = float(np.median(result["times"]))
    tokens = args.micro_batch_size * args.seq_length
    tflops = flops.flops_per_iteration(cfg, args.seq_length, args.micro_batch_size) / step / 1e12
    print(f"mfu: Llama-style {layers} layers, hidden {args.hidden_size}, {attention_name(args)}, "
          f"ffn {args.ffn_hidden_size}, vocab {args.vocab_size}, "
          f"seq {args.seq_length}, micro batch {args.micro_batch_size}, {cfg.params_dtype}, recompute "
          f"{args.recompute_granularity}: {result['params'] / 1e9:.2f}B parameters")
    print(f"mfu: step {step * 1e3:.1f} ms (median of {len(result['times'])}), "
          f"{tokens / step:,.0f} tokens/s, peak memory {result['peak_bytes'] / 2**30:.1f} GiB, "
          f"loss {result['loss']:.3f}")
    print(f"mfu: {tflops:.4g} TFLOP/s of model FLOPs = MFU {100 * tflops / args.peak_tflops:.1f}% "
          f"of {args.peak_tflops:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
