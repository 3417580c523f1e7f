"""megatron-core (0.16.1) training on the CPU with its own optimizer, for
test_convert_megatron_optimizer.py: the tiny Llama of megatron_checkpoints.py wrapped in
megatron-core's DistributedDataParallel, get_megatron_optimizer's Adam (f32, clipping at 1,
weight decay 0.1 but on biases and norms, Megatron-LM's default param groups) and
OptimizerParamScheduler as Megatron-LM builds it (steps in samples). Three steps, then a torch_dist
save built as Megatron-LM's save_checkpoint builds it (model, optimizer, scheduler, args; no RNG),
then step 4 and a second save (the reference), and step 4's batch.

  python -m torch.distributed.run --nproc-per-node N megatron_optimizer_saves.py OUT NAME:SHARDING:KIND[:FROM[:resave]]...
each job into OUT/NAME, one after another in one process; KIND: a model of
megatron_checkpoints.MODELS. SHARDING: plain (use_distributed_optimizer=False), or the distributed optimizer's
fully_reshardable (per parameter, as Megatron-LM's --dist-ckpt-optim-fully-reshardable saves) or
dp_reshardable (flattened per data-parallel rank, Megatron-LM's default), or under megatron-core
before 0.14 fully_sharded_model_space or dp_zero_gather_scatter; legacy: the distributed optimizer
in --ckpt-format torch (save_legacy; legacy_plain: the optimizer not distributed). A suffix -tpN
runs tensor parallel N, -ppN pipeline stages N, -epN expert parallel N, -bN buckets of N elements
(with the gradient reduction overlapped). With FROM (a torch_dist checkpoint directory,
convert_megatron.py export's) the job loads it as Megatron-LM's load_checkpoint does instead of
training from scratch, takes the next step, saves it into OUT/NAME and that step's batch into
OUT/NAME/next.npz; with :resave it saves what it loaded, at its iteration, without a step.

Beyond megatron_checkpoints.cpu_stand_ins, megatron-core's optimizer assumes CUDA where it
computes nothing device-specific: it creates its scalars (found_inf, the clipping's norm) with
device="cuda", and asserts param.type() == "torch.cuda.FloatTensor"; here those are CPU tensors.
"""

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_checkpoints as mc  # noqa: E402

SEQ, MBS, LR, SAVED = 16, 2, 1e-2, 3
NOT_DISTRIBUTED = ("plain", "legacy_plain")  # the SHARDINGs of the optimizer not distributed


def optimizer_stand_ins():
    np.product = np.prod  # (megatron-core 0.13's save validation, from before numpy 2 removed it)
    def on_cpu(factory):
        def make(*args, **kwargs):
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)
        return make
    for name in ("tensor", "zeros", "empty", "ones", "full"):
        setattr(torch, name, on_cpu(getattr(torch, name)))
    type_name = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = type_name(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not (args or kwargs) else name
    torch.Tensor.type = cuda_type

    # The distributed optimizer's fully reshardable load copies every entry of a parameter's
    # torch AdamW state from the checkpoint, whose per-parameter state has no step (megatron-core
    # 0.16.1 without Apex or Transformer Engine, whose FusedAdam keeps no step there): the same
    # copies, the step left to load_state_dict.
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def set_states(self, model_param, tensors):
        group, order = self.model_param_group_index_map[model_param]
        main = self.optimizer.param_groups[group]["params"][order]
        main.copy_(tensors["param"])
        for key, value in self.optimizer.state[main].items():
            if key != "step":
                value.copy_(tensors[key])
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def batch(step, dp_rank):
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, mc.VOCAB, (MBS, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def build(a, dp, distributed):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    torch.manual_seed(7)
    model = mc.build(a).train()
    model.parallel_output = True  # as Megatron-LM trains
    if hasattr(model, "output_layer"):  # (the last pipeline stage's)
        model.output_layer.gather_output = False
    mc.randomize(model, 7)
    if a.params_dtype == torch.bfloat16:  # the norms too, as Transformer Engine's are
        model.to(torch.bfloat16)
    rank = parallel_state.get_tensor_model_parallel_rank()
    if rank:  # TP shards of their own (randomize gives every rank the same local values)
        g = torch.Generator().manual_seed(rank)
        with torch.no_grad():
            for p in model.parameters():
                if getattr(p, "tensor_model_parallel", False):
                    p.add_(0.05 * torch.randn(p.shape, generator=g))
    ddp = DistributedDataParallel(
        config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
            bucket_size=a.ddp_bucket_size, overlap_grad_reduce=a.ddp_bucket_size is not None))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=LR, min_lr=LR, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95,
        adam_eps=1e-8, clip_grad=1.0, params_dtype=a.params_dtype,
        bf16=a.params_dtype == torch.bfloat16, use_distributed_optimizer=distributed), [ddp])
    gbs = a.global_batch_size  # Megatron-LM's scheduler counts samples: iterations x it
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=LR, lr_warmup_steps=0,
        lr_decay_steps=a.lr_decay_iters * gbs, lr_decay_style="constant", start_wd=0.1,
        end_wd=0.1, wd_incr_steps=a.train_iters * gbs, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False)  # Megatron-LM's default: values must match
    return ddp, optimizer, scheduler


def train_step(step, ddp, optimizer, scheduler):
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    ids, labels = batch(step, parallel_state.get_data_parallel_rank())
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    causal = torch.triu(torch.ones(1, 1, SEQ, SEQ), diagonal=1).bool()
    loss = ddp(ids, torch.arange(SEQ).expand_as(ids), attention_mask=causal,
               labels=labels).float().mean()
    loss.backward()
    finalize_model_grads([ddp])
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(increment=MBS * parallel_state.get_data_parallel_world_size())
    mean = loss.detach().clone()  # the global batch's: the ranks' mean
    torch.distributed.all_reduce(mean, group=parallel_state.get_data_parallel_group())
    return float(mean) / parallel_state.get_data_parallel_world_size()


def save(a, ddp, optimizer, scheduler, iteration, out, sharding):
    if sharding.startswith("legacy"):
        return save_legacy(a, ddp, optimizer, scheduler, iteration, out,
                           sharding not in NOT_DISTRIBUTED)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding != "plain":
        metadata["distrib_optim_sharding_type"] = sharding
    with_group = dict(metadata, dp_cp_group=parallel_state.get_data_parallel_group(
        with_context_parallel=True))
    a.consumed_train_samples = iteration * MBS * parallel_state.get_data_parallel_world_size()
    state = {"args": a, "checkpoint_version": 3.0, "iteration": iteration,
             "model": ddp.module.sharded_state_dict(metadata=with_group),
             "opt_param_scheduler": scheduler.state_dict(),
             "num_floating_point_operations_so_far": 0}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=with_group)
    folder = os.path.join(out, f"iter_{iteration:07d}")
    if torch.distributed.get_rank() == 0:
        os.makedirs(folder)
    torch.distributed.barrier()
    dist_checkpointing.save(state, folder, TorchDistSaveShardedStrategy("torch_dist", 1,
                                                                        thread_count=1),
                            content_metadata=metadata)
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()


def save_legacy(a, ddp, optimizer, scheduler, iteration, out, distributed):
    """Megatron-LM's save_checkpoint with --ckpt-format torch: each model-parallel rank's
    model_optim_rng.pt (written by its expert-data-parallel rank 0) with the optimizer's
    state_dict(); the distributed optimizer's holds its param groups and step, not its state,
    which goes beside it in distrib_optim.pt, gathered on each data-parallel group's rank 0
    (save_parameter_state)."""
    from megatron.core import parallel_state
    from megatron_legacy_saves import RANK_FILE, rank_folder
    a.consumed_train_samples = iteration * MBS * parallel_state.get_data_parallel_world_size()
    a.use_distributed_optimizer = distributed
    folder = os.path.join(out, f"iter_{iteration:07d}", rank_folder())
    os.makedirs(folder, exist_ok=True)
    state = {"args": a, "checkpoint_version": 3.0, "iteration": iteration,
             "model": ddp.module.state_dict_for_save_checkpoint(),
             "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict(),
             "num_floating_point_operations_so_far": 0}
    if parallel_state.get_expert_data_parallel_rank() == 0:
        torch.save(state, os.path.join(folder, RANK_FILE))
    if distributed:
        optimizer.save_parameter_state(os.path.join(folder, "distrib_optim.pt"))
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))
    torch.distributed.barrier()


def load(ddp, optimizer, scheduler, source):
    """Megatron-LM's load_checkpoint, as far as the model, optimizer and scheduler go: the
    content metadata decides the optimizer's layout. Returns the iteration."""
    from megatron.core import dist_checkpointing, parallel_state
    with open(os.path.join(source, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    folder = os.path.join(source, f"iter_{iteration:07d}")
    metadata = dict(dist_checkpointing.load_content_metadata(folder), dp_cp_group=(
        parallel_state.get_data_parallel_group(with_context_parallel=True)))
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
            # megatron-core 0.16.1's distributed optimizer without Apex or Transformer Engine
            # reads a step from every parameter's state, which a fresh torch AdamW lacks
            inner._init_optimizer_states_with_dummy_values()
    model = ddp.module.sharded_state_dict(metadata=metadata)
    state = {"model": model, "optimizer": optimizer.sharded_state_dict(
        model, is_loading=True, metadata=metadata)}
    state = dist_checkpointing.load(state, folder)
    ddp.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    # megatron-core 0.16.1's distributed optimizer without Apex or Transformer Engine gives every
    # parameter one shared step tensor, which torch's AdamW then advances once per parameter
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for s in inner.optimizer.state.values():
            s["step"] = s["step"].clone()
    scheduler.load_state_dict(state["opt_param_scheduler"])
    assert state["iteration"] == iteration
    return iteration


def resume(out, sharding, kind, source, resave=False):
    """Loads the torch_dist save `source` and takes the next step; with `resave` only saves it
    again, in this layout and SHARDING (Megatron-LM resharding a run: the global batch is the
    source's, in more microbatches where fewer data-parallel ranks take it)."""
    sharding, dp, a = setup(sharding, kind)
    if resave:
        with open(os.path.join(source, "latest_checkpointed_iteration.txt")) as f:
            common = os.path.join(source, f"iter_{int(f.read()):07d}", "common.pt")
        a.global_batch_size = torch.load(common, weights_only=False)["args"].global_batch_size
    ddp, optimizer, scheduler = build(a, dp, sharding not in NOT_DISTRIBUTED)
    iteration = load(ddp, optimizer, scheduler, source)
    if resave:
        save(a, ddp, optimizer, scheduler, iteration, out, sharding)
        return
    loss = train_step(iteration + 1, ddp, optimizer, scheduler)
    save(a, ddp, optimizer, scheduler, iteration + 1, out, sharding)
    ids, labels = zip(*(batch(iteration + 1, r) for r in range(dp)))
    if torch.distributed.get_rank() == 0:
        np.savez(os.path.join(out, "next.npz"), ids=torch.cat(ids).numpy(),
                 labels=torch.cat(labels).numpy(), loss=loss)


def args_of(kind, dp, **changes):
    return mc.megatron_args(kind, **changes, global_batch_size=MBS * dp, micro_batch_size=MBS,
                            train_iters=100, lr_decay_iters=100, lr=LR, min_lr=LR,
                            weight_decay=0.1, clip_grad=1.0, adam_beta1=0.9, adam_beta2=0.95,
                            adam_eps=1e-8, lr_decay_style="constant", lr_warmup_iters=0)


def setup(sharding, kind):
    """megatron-core's parallel state for SHARDING's sizes (dp_reshardable-tp2: tensor parallel
    2; -pp2 pipeline stages 2; -ep2 expert parallel 2) and KIND's dtype (llama@bfloat16: bf16 weights, f32 main
    parameters): (the sharding, the data-parallel size, Megatron-LM's args)."""
    from megatron.core import parallel_state
    sharding, *sizes = sharding.split("-")
    sizes = dict({"tp": 1, "pp": 1, "ep": 1, "b": None},
                 **{n.rstrip("0123456789"): int(n.lstrip("tpeb")) for n in sizes})
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(sizes["tp"], sizes["pp"],
                                             expert_model_parallel_size=sizes["ep"])
    dp = parallel_state.get_data_parallel_world_size()
    kind, _, dtype = kind.partition("@")
    return sharding, dp, args_of(kind, dp, tensor_model_parallel_size=sizes["tp"],
                                 pipeline_model_parallel_size=sizes["pp"],
                                 expert_model_parallel_size=sizes["ep"],
                                 ddp_bucket_size=sizes["b"],
                                 params_dtype=getattr(torch, dtype or "float32"),
                                 bf16=dtype == "bfloat16")


def job(out, sharding, kind):
    sharding, dp, a = setup(sharding, kind)
    ddp, optimizer, scheduler = build(a, dp, sharding not in NOT_DISTRIBUTED)
    losses = [train_step(step, ddp, optimizer, scheduler) for step in range(1, SAVED + 1)]
    save(a, ddp, optimizer, scheduler, SAVED, out, sharding)
    losses.append(train_step(SAVED + 1, ddp, optimizer, scheduler))
    save(a, ddp, optimizer, scheduler, SAVED + 1, os.path.join(out, "after"), sharding)
    ids, labels = zip(*(batch(SAVED + 1, r) for r in range(dp)))  # the global batch, rank order
    if torch.distributed.get_rank() == 0:
        np.savez(os.path.join(out, "step4.npz"), ids=torch.cat(ids).numpy(),
                 labels=torch.cat(labels).numpy(), losses=np.array(losses))


def main():
    torch.distributed.init_process_group("gloo")
    mc.cpu_stand_ins()
    optimizer_stand_ins()
    for spec in sys.argv[2:]:
        name, sharding, kind, *source = spec.split(":", 3)
        if source:
            path, _, resave = source[0].partition(":")
            resume(os.path.join(sys.argv[1], name), sharding, kind, path, resave == "resave")
        else:
            job(os.path.join(sys.argv[1], name), sharding, kind)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
