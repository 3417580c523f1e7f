"""Train a braid GPT on batches from a PyTorch DataLoader; read loss, logits and weights as torch.

The data is braid's embedded addition problems ("364+058=0422"), one problem per row of 16 byte
tokens, served by a torch ``Dataset`` and ``DataLoader``. The batches go to braid's Trainer as
they are: int32 tensors are used in place (zero-copy), int64 ones (``--int64``, torch's default
integer type) are narrowed to int32 in one copy. Braid hands back the loss (a float, shown as a
torch scalar), the logits and the parameters as torch tensors that share braid's memory, so the
evaluation is written with ordinary torch ops.

    PYTHONPATH=python python examples/torch_dataloader.py            # about 10 s on 2 CPU cores
    PYTHONPATH=python mpirun -np 2 python examples/torch_dataloader.py   # data parallel

Under mpirun every rank is one data-parallel replica: it reads its own shard of each epoch
(torch's DistributedSampler, given the rank and world size braid reports) and braid averages the
gradients; rank 0 prints and evaluates.
"""

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import braid
from braid import addition


class AdditionProblems(Dataset):
    """n addition problems: ids [16] and next-token targets [16], -1 except on the answer."""

    def __init__(self, n: int, seed: int, dtype: torch.dtype = torch.int32, held_out: bool = False):
        data = addition.AdditionData(seed=seed, padded=True)
        ids, targets = data.held_out_batch(n) if held_out else data.batch(n)
        self.ids = torch.from_numpy(ids).to(dtype)
        self.targets = torch.from_numpy(targets).to(dtype)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.targets[i]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64, help="global batch (all DP ranks)")
    p.add_argument("--problems", type=int, default=8192, help="training set size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-interval", type=int, default=50)
    p.add_argument("--eval-problems", type=int, default=512)
    p.add_argument("--int64", action="store_true",
                   help="serve int64 batches (torch's default integer type; one narrowing copy)")
    p.add_argument("--seed", type=int, default=1234)
    return p.parse_args(argv)


def model_config() -> braid.TransformerConfig:
    cfg = braid.TransformerConfig.preset("gpt2-tiny")  # 2 layers, hidden 64, 256 byte tokens
    cfg.max_position_embeddings = addition.SEQ_LENGTH
    cfg.validate()
    return cfg


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = model_config()
    schedule = braid.LRSchedule(lr=args.lr, min_lr=args.lr / 10, warmup_iters=args.steps // 10,
                                decay_iters=args.steps)
    optimizer = braid.AdamWConfig(lr=args.lr, beta2=0.95, weight_decay=0.1)

    # One process: a GPTModel. Under mpirun: a ParallelModel, one data-parallel replica per rank.
    world = braid.init_distributed() if _launched_ranks() > 1 else None
    if world is None:
        rank, dp = 0, 1
        model = braid.GPTModel(cfg, device="cpu", seed=args.seed)
        trainer = braid.Trainer(model, optimizer, schedule)
    else:
        state = braid.ParallelState(tp=1, pp=1)
        rank, dp = state.dp_rank, state.dp
        parallel = braid.ParallelModel(cfg, "cpu", args.seed, state, braid.ParallelConfig())
        trainer = braid.Trainer(parallel, braid.TrainerConfig(optimizer, schedule))
        model = parallel.chunk(0)  # this rank's replica: a whole GPTModel when tp = pp = 1
    log = print if rank == 0 else (lambda *a, **k: None)
    if args.batch_size % dp:
        raise ValueError(f"--batch-size {args.batch_size} is not a multiple of {dp} ranks")

    dtype = torch.int64 if args.int64 else torch.int32
    train = AdditionProblems(args.problems, args.seed, dtype)
    sampler = DistributedSampler(train, num_replicas=dp, rank=rank, shuffle=True, seed=args.seed,
                                 drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size // dp, sampler=sampler, drop_last=True)

    # A torch view of a braid parameter: it follows the weights as braid trains them.
    embedding = torch.from_dlpack(model.parameters()["model.embed_tokens.weight"])
    before = embedding.clone()
    log(f"braid {braid.__version__}, torch {torch.__version__}: {model.num_parameters()} "
        f"parameters, {dp} data-parallel rank(s), {str(dtype)[6:]} batches of "
        f"{args.batch_size}")

    start, step, epoch = time.perf_counter(), 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        for ids, targets in loader:
            stats = trainer.train_step(ids, targets)
            loss = torch.tensor(stats.loss)  # the global batch's mean loss
            step += 1
            if step == 1 or step % args.log_interval == 0 or step == args.steps:
                log(f"step {step:4d}  loss {loss.item():.4f}  lr {stats.lr:.2e}  "
                    f"grad_norm {stats.grad_norm:.3f}", flush=True)
            if step == args.steps:
                break
        epoch += 1
    log(f"trained {args.steps} steps in {time.perf_counter() - start:.1f}s; the embedding view "
        f"moved by {(embedding - before).norm():.3f} (norm {embedding.norm():.3f})")

    if rank == 0:  # each replica holds the same weights: rank 0's evaluates for the job
        held_out = AdditionProblems(args.eval_problems, args.seed + 1, held_out=True)
        ids, targets = held_out.ids, held_out.targets
        logits = torch.from_dlpack(model.logits(ids))  # [N, 16, 256] f32, braid's own buffer
        answer = targets >= 0
        loss = F.cross_entropy(logits.flatten(0, 1), targets.long().flatten(), ignore_index=-1)
        right = (logits.argmax(-1) == targets) | ~answer
        print(f"held-out: loss {loss.item():.4f}  perplexity {loss.exp().item():.2f}  "
              f"answer digits right {right[answer].float().mean().item():.3f}  "
              f"whole answers right {right.all(-1).float().mean().item():.3f} "
              f"(teacher-forced)", flush=True)
    if world is not None:
        state.barrier()
    return 0


def _launched_ranks() -> int:
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
