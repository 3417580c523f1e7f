"""Megatron-LM's legacy checkpoints (--ckpt-format torch) of megatron-core 0.16.1 GPTModels on the
CPU, for test_convert_megatron_legacy.py (megatron_checkpoints.py builds the models).

Written as Megatron-LM's save_checkpoint writes that format: iter_NNNNNNN/mp_rank_TT[_PPP][_EEE]/
model_optim_rng.pt (get_checkpoint_name: _PPP with pipeline stages, _EEE with expert parallelism),
one per (TP, PP, EP) rank, written by the ranks whose data-parallel or expert-data-parallel rank
is 0, each generate_state_dict's dict: args (with the layout's sizes), checkpoint_version 3.0,
iteration, model (model0, model1 with virtual stages: each chunk's
state_dict_for_save_checkpoint()), optimizer (a torch Adam state dict of one param group, not
megatron-core's groups: import leaves it out), opt_param_scheduler (its num_steps: where the LR schedule stands),
rng_state, num_floating_point_operations_so_far; then the tracker file.

  python -m torch.distributed.run --nproc-per-node 2 megatron_legacy_saves.py OUT
      two ranks (gloo): each model of MODELS at TP 1 (x DP 2): its logits, its torch_dist save,
      its legacy save; then megatron-core loads the torch_dist save under each of its LAYOUTS
      and saves it in the legacy format
  python -m torch.distributed.run --nproc-per-node 4 megatron_legacy_saves.py OUT
      four ranks, after two: the same for FOUR_RANK_LAYOUTS
"""

import os
import random
import sys

import numpy as np

from megatron_checkpoints import (CONSUMED, ITERATION, build, cpu_stand_ins, init, logits,
                                  megatron_args, randomize, save_logits, save_megatron_lm)

# name -> (megatron_checkpoints' model, args changed)
MODELS = {"llama": ("llama", {}), "llama-4": ("llama", dict(num_layers=4)),
          "gpt": ("gpt", {}), "moe": ("moe-shared", {}), "mla-mtp": ("deepseek-v3-mtp", {}),
          "gpt-oss": ("gpt-oss", {}), "gpt-oss-dense": ("gpt-oss", dict(num_experts=None))}
# per model: layout -> (TP, PP, virtual stages, EP, args changed)
LAYOUTS = {
    "llama": {"tp2": (2, 1, None, 1, {}), "pp2": (1, 2, None, 1, {})},
    # biases (column-parallel ones split, row-parallel ones whole), learned positions, GELU's fc1
    "gpt": {"tp2": (2, 1, None, 1, {})},
    # virtual stages (stage 0: layers 0, 2; stage 1: 1, 3), an uneven split (1 layer, then 3)
    "llama-4": {"pp2-vp2": (1, 2, 2, 1, {}),
                "pp2-first1": (1, 2, None, 1, dict(decoder_first_pipeline_num_layers=1))},
    # experts 0, 1 on EP rank 0 and 2, 3 on rank 1, the dense tensors on both
    "moe": {"ep2": (1, 1, None, 2, {})},
    # MLA's projections (its down projections column-parallel in the local spec), the experts,
    # the shared expert and the MTP depth's eh_proj over TP 2; at PP 2 the MTP depth and a copy of
    # the embedding on the last stage
    "mla-mtp": {"tp2": (2, 1, None, 1, {}), "pp2": (1, 2, None, 1, {})},
    # the attention sinks split by heads, the quick GEGLU's fc1 as gate and up halves per rank
    # (dense: megatron-core's MoE biases need whole experts, expert TP 1, which the legacy files
    # name by the dense TP rank alone: refused)
    "gpt-oss-dense": {"tp2": (2, 1, None, 1, {})},
}
# mp_rank_TT_PPP; the tied GPT's last stage holds output_layer.weight, the embedding's copy
FOUR_RANK_LAYOUTS = {"llama": {"tp2-pp2": (2, 2, None, 1, {})},
                     "gpt": {"tp2-pp2": (2, 2, None, 1, {})}}
SCHEDULER_STEPS = CONSUMED - 64  # the samples of the updates that counted (a skipped one less)
RANK_FILE = "model_optim_rng.pt"


def layout_args(name, tp=1, pp=1, vp=None, ep=1, **changes):
    kind, base = MODELS[name]
    return megatron_args(kind, **base, **changes, ckpt_format="torch",
                         tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         virtual_pipeline_model_parallel_size=vp, expert_model_parallel_size=ep)


def rank_folder():
    """This rank's folder as Megatron-LM's get_checkpoint_name names it."""
    from megatron.core import parallel_state as ps
    pp, ep = (ps.get_pipeline_model_parallel_world_size(),
              ps.get_expert_model_parallel_world_size())
    return (f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}"
            + (f"_{ps.get_pipeline_model_parallel_rank():03d}" if pp > 1 else "")
            + (f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else ""))


def save_legacy(chunks, a, out):
    """Saves the model chunks of this rank as Megatron-LM's save_checkpoint does with
    --ckpt-format torch into out/iter_NNNNNNN, and the tracker file."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    state = {"args": a, "checkpoint_version": 3.0, "iteration": ITERATION}
    for i, model in enumerate(chunks):
        state["model" if len(chunks) == 1 else f"model{i}"] = model.state_dict_for_save_checkpoint()
    params = [p for model in chunks for p in model.parameters()]
    adam = torch.optim.Adam(params, lr=a.lr)
    for p in params:
        adam.state[p] = {"step": torch.tensor(5.0), "exp_avg": torch.zeros_like(p),
                         "exp_avg_sq": torch.zeros_like(p)}
    state["optimizer"] = adam.state_dict()
    state["opt_param_scheduler"] = {
        "max_lr": a.lr, "lr_warmup_steps": 0, "num_steps": SCHEDULER_STEPS,
        "lr_decay_style": "cosine", "lr_decay_steps": 32000, "min_lr": 0.0, "start_wd": 0.0,
        "end_wd": 0.0, "wd_incr_style": "constant", "wd_incr_steps": 32000}
    state["rng_state"] = [{
        "random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.get_rng_state(),  # (no CUDA here: the CPU generator's state)
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}]
    state["num_floating_point_operations_so_far"] = 0
    path = os.path.join(out, f"iter_{ITERATION:07d}", rank_folder(), RANK_FILE)
    if ps.get_data_parallel_rank() == 0 or ps.get_expert_data_parallel_rank() == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(state, path)
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(ITERATION))
    torch.distributed.barrier()


def load_chunks(chunks, folder):
    """megatron-core's dist_checkpointing.load of a torch_dist save into the model chunks."""
    from megatron.core import dist_checkpointing
    keys = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    state = dist_checkpointing.load({k: m.sharded_state_dict(metadata={})
                                     for k, m in zip(keys, chunks)}, folder)
    for k, m in zip(keys, chunks):
        m.load_state_dict(state[k], strict=True)


def main():
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    out = sys.argv[1]
    torch.distributed.init_process_group("gloo")
    cpu_stand_ins()
    layouts = LAYOUTS
    if torch.distributed.get_world_size() == 4:
        layouts, tp1_models = FOUR_RANK_LAYOUTS, []
    else:
        init()
        tp1_models = MODELS
    for seed, name in enumerate(tp1_models):
        a = layout_args(name)
        model = build(a)
        randomize(model, seed)  # the same on both ranks (data-parallel replicas)
        result = logits(model)
        if torch.distributed.get_rank() == 0:
            save_logits(os.path.join(out, name), result)
        save_megatron_lm(model, megatron_args(MODELS[name][0], **MODELS[name][1]),
                         os.path.join(out, f"{name}-torch-dist"))
        save_legacy([model], a, os.path.join(out, name))
    for name, of_model in layouts.items():
        for layout, (tp, pp, vp, ep, changes) in of_model.items():
            init(tp, pp, vp, ep)
            a = layout_args(name, tp, pp, vp, ep, **changes)
            chunks = [build(a, vp_stage=v) for v in range(vp)] if vp else [build(a)]
            load_chunks(chunks, os.path.join(out, f"{name}-torch-dist", f"iter_{ITERATION:07d}"))
            save_legacy(chunks, a, os.path.join(out, f"{name}-{layout}"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
