"""The training loop behind pretrain_gpt.py: Megatron-LM's pretrain() on braid.

    mpirun -np 8 python pretrain_gpt.py --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 128 \\
        --num-attention-heads 4 --micro-batch-size 8 --global-batch-size 64 --train-iters 500

Data (braid.training_data): the embedded addition problems by default, ``--mock-data``
(megatron-core's mock documents), ``--data-path`` (Megatron .bin/.idx with ``--split``), or each split's own datasets
(``--train-data-path``, ``--valid-data-path``, ``--test-data-path``). Every ``--log-interval``
iterations rank 0 prints Megatron's line (iteration, consumed samples, ms per iteration,
learning rate, batch, loss, the router losses and each multi-token prediction layer's loss,
loss scale, grad norm, skipped and nan iterations) plus tokens/s, model TFLOP/s per device,
MFU (braid.flops), peak memory and, with ``--gpu-hour-price``, the
cost so far (of the whole run, over its jobs) and projected; on a terminal a progress bar with
the ETA stays below the lines. Every ``--eval-interval`` iterations and at the end it prints
the validation loss (of each set with ``--multiple-validation-sets``, over whole sets with
``--full-validation``: braid.validation_sets), and at the end the test loss where the data has a
test split.
``--tensorboard-dir`` gets TensorBoard event files and ``metrics.jsonl`` (braid.metrics),
``--wandb-project`` the same scalars in a Weights & Biases run (braid.wandb_log).
Checkpoints, resuming under any layout and the exit conditions are those of
docs/checkpoints.md.

Errors in the arguments are found by every rank before MPI starts: each prints the same
``braid: error: ...`` line and exits with code 2.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import NoReturn

import numpy as np

import braid
from braid import (activation_args, attention_args, flops, moe_args, schedule_args,
                   tokenizer_args, wandb_log)
from braid.arguments import MTP_LOSS_SCALING_FACTOR, ArgumentError, parse_args, without_source
from braid.checkpoint_args import MEGATRON_ROPE_SCALING, numerics_warnings
from braid.checkpoint_dirs import (claim_save_directory, load_directory_problem,
                                   save_directory_in_use, save_directory_problem)
from braid.checkpoint_flags import Retention
from braid.megatron_flags import activation, no_effect_given
from braid.training_data import Data, default_cache_dir  # noqa: F401 (braid.demo's too)
from braid.metrics import MetricsWriter
from braid.training_log import IterationLog, Meter, ProgressBar, Timers, hms

MEGATRON_NORMALIZATION = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}


# ---- the launcher's view (before MPI is up) -------------------------------------------------

def launched_processes() -> int:
    """The job's size as the launcher tells it (mpirun, srun, torchrun-style), 1 if none."""
    for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS", "WORLD_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 1


def error_exit(message: str) -> int:
    """An error every rank found alike: each writes the same line (in one write, since mpirun
    interleaves the ranks' writes, and from every rank, since mpirun ends the job when the
    first rank exits) and the caller returns 2."""
    sys.stderr.write(f"braid: error: {message}\n")
    sys.stderr.flush()
    return 2


def abort_job(message: str) -> NoReturn:
    """An error some ranks may find alone (a token in one rank's batch, a full disk while
    saving): its line, then the whole job ends (MPI_Abort, exit 1) rather than the other ranks
    waiting out --distributed-timeout-minutes in their next collective; one process exits 2 as
    error_exit's callers do."""
    if launched_processes() > 1:
        braid._C.abort(f"braid: error: {message}")
    error_exit(message)
    raise SystemExit(2)


# ---- model ------------------------------------------------------------------------------------

def model_config(a) -> braid.TransformerConfig:
    """The TransformerConfig the arguments describe (ValueError naming a field it rejects)."""
    cfg = braid.TransformerConfig()
    cfg.num_layers = a.num_layers
    cfg.hidden_size = a.hidden_size
    cfg.num_attention_heads = a.num_attention_heads
    cfg.num_query_groups = a.num_query_groups
    cfg.kv_channels = a.kv_channels
    cfg.ffn_hidden_size = a.ffn_hidden_size
    cfg.vocab_size = a.vocab_size
    cfg.max_position_embeddings = a.max_position_embeddings
    cfg.normalization = MEGATRON_NORMALIZATION[a.normalization]
    cfg.norm_eps = a.norm_epsilon
    cfg.activation = activation(a)
    activation_args.configure(cfg, a)
    cfg.position_embedding = "rope" if a.position_embedding_type == "rope" else "learned"
    cfg.rope_theta = a.rotary_base
    cfg.rotary_percent = a.rotary_percent
    cfg.rotary_interleaved = a.rotary_interleaved
    if a.use_rope_scaling:  # Megatron's: Llama 3.1's rule, the factor from the flag
        cfg.rope_scaling_factor = a.rope_scaling_factor or 8.0
        cfg.rope_low_freq_factor = MEGATRON_ROPE_SCALING["rope_low_freq_factor"]
        cfg.rope_high_freq_factor = MEGATRON_ROPE_SCALING["rope_high_freq_factor"]
        cfg.rope_original_max_position_embeddings = \
            MEGATRON_ROPE_SCALING["rope_original_max_position_embeddings"]
    if (a.rotary_seq_len_interpolation_factor or 1) != 1:  # Megatron's: positions / factor
        cfg.rope_linear_factor = a.rotary_seq_len_interpolation_factor
    cfg.add_bias_linear = not a.disable_bias_linear
    cfg.add_qkv_bias = a.add_qkv_bias
    cfg.qk_layernorm = a.qk_layernorm
    attention_args.configure(cfg, a)
    cfg.window_size = a.window_size
    cfg.window_layers = a.window_layers
    moe_args.configure(cfg, a)
    if a.mtp_num_layers:  # DeepSeek-V3's multi-token prediction (none: the config's 0)
        cfg.mtp_num_layers = a.mtp_num_layers
        cfg.mtp_loss_scaling_factor = (MTP_LOSS_SCALING_FACTOR if a.mtp_loss_scaling_factor
                                       is None else a.mtp_loss_scaling_factor)
    cfg.zero_centered_gamma = a.apply_layernorm_1p
    cfg.tie_embeddings = not a.untie_embeddings_and_output_weights
    cfg.init_std = a.init_method_std
    cfg.embedding_init_std = a.embedding_init_method_std or 0.0
    cfg.hidden_dropout = a.hidden_dropout
    cfg.attention_dropout = a.attention_dropout
    cfg.params_dtype = "bf16" if a.bf16 and a.device == "cuda" else "f32"
    cfg.make_vocab_size_divisible_by = a.make_vocab_size_divisible_by
    cfg.recompute = a.recompute_granularity or "none"
    cfg.recompute_mla_up_proj = "mla_up_proj" in (a.recompute_modules or ())
    cfg.recompute_method = a.recompute_method or "uniform"
    cfg.recompute_num_layers = a.recompute_num_layers or 1
    cfg.validate()
    return cfg


def trainer_config(a) -> braid.TrainerConfig:
    optimizer = braid.AdamWConfig(lr=a.lr, beta1=a.adam_beta1, beta2=a.adam_beta2, eps=a.adam_eps,
                                  weight_decay=a.weight_decay, clip_grad=a.clip_grad,
                                  # megatron-core's: every matrix decays, the embeddings too
                                  decay_embeddings=True)
    schedule = braid.LRSchedule(lr=a.lr, min_lr=a.min_lr, warmup_iters=a.lr_warmup_iters,
                                decay_iters=a.lr_decay_iters, style=a.lr_decay_style,
                                warmup_init=a.lr_warmup_init,
                                wsd_decay_iters=a.lr_wsd_decay_iters or 0,
                                wsd_style=a.lr_wsd_decay_style,
                                iterations_per_sample=1.0 / a.global_batch_size,
                                decoupled_lr=a.decoupled_lr, decoupled_min_lr=a.decoupled_min_lr)
    scaling = braid.LossScaleConfig(
        loss_scale=a.loss_scale or 0.0, dynamic=a.dynamic_loss_scale,
        initial_loss_scale=a.initial_loss_scale, min_loss_scale=a.min_loss_scale,
        loss_scale_window=a.loss_scale_window, hysteresis=a.hysteresis)
    decay = None
    if a.weight_decay_incr_style != "constant":
        decay = braid.WeightDecaySchedule(a.start_weight_decay, a.end_weight_decay,
                                          a.weight_decay_incr_iters, a.weight_decay_incr_style)
    return braid.TrainerConfig(optimizer, schedule, loss_scale=scaling,
                               pipeline_schedule=a.pipeline_schedule,
                               weight_decay_schedule=decay,
                               global_batch_size=a.global_batch_size,
                               log_num_zeros_in_grad=a.log_num_zeros_in_grad)


def megatron_difference_notes(a) -> list[str]:
    """Where this run trains otherwise than Megatron-LM would on the same command line: --bf16
    on the CPU runs in float32, so that a GPU job's script debugs unchanged there;
    --eod-mask-loss weights every counted token alike; --reset-position-ids turns rope, which
    megatron-core's ignores; attention dropout on a GPU runs braid's own attention kernels."""
    notes = []
    if a.device == "cuda" and a.attention_dropout > 0:
        notes.append(f"braid: --attention-dropout {a.attention_dropout:g} on a GPU: attention "
                     "runs braid's own kernels, whose mask every layout draws alike, not "
                     "cuDNN's (Megatron's default is 0.1; --attention-dropout 0, as Llama-style "
                     "scripts give, keeps cuDNN's)")
    if a.eod_mask_loss and not a.calculate_per_token_loss:
        notes.append("braid: --eod-mask-loss: braid's loss is the mean over the global batch's "
                     "counted tokens (Megatron's --calculate-per-token-loss); Megatron's default "
                     "averages each microbatch's mean instead, which weights tokens otherwise "
                     "when the masked ones spread unevenly (docs/arguments.md)")
    if a.bf16 and a.device == "cpu":
        notes.append("braid: --bf16 on the CPU: braid's CPU kernels compute in float32, so this "
                     "run's parameters and activations are float32 (bf16 on a CUDA device); its "
                     "checkpoints resume under --bf16 on GPUs, and theirs here")
    if a.reset_position_ids and not a.reset_attention_mask and \
            a.position_embedding_type == "rope":
        notes.append("braid: --reset-position-ids turns rope by each token's position in its "
                     "document; megatron-core's rope ignores position ids, so Megatron-LM trains "
                     "this model with positions running over the whole sequence (docs/data.md)")
    return notes


def print_arguments(a, log):
    log("------------------------ arguments ------------------------")
    for name in sorted(vars(a)):
        log(f"  {name} {'.' * max(1, 40 - len(name))} {getattr(a, name)}")
    log("-------------------- end of arguments ---------------------")


# ---- the run ------------------------------------------------------------------------------------

def main(argv=None) -> int:
    try:
        return run(argv)
    except KeyboardInterrupt:  # Ctrl-C: what was committed stays (saves are atomic)
        message = "braid: interrupted; the checkpoints committed before stay as they were"
        if launched_processes() > 1:  # the other ranks would wait in their next collective
            braid._C.abort(message, 130)
        sys.stderr.write(message + "\n")
        return 130


def run(argv=None) -> int:
    start = time.time()
    try:
        a = parse_args(argv, launched_processes())
        cfg = model_config(a)
        config = trainer_config(a)
        wandb = wandb_log.module(a)  # every rank imports it: without it, all fail alike
    except (ArgumentError, ValueError) as e:
        return error_exit(without_source(e))  # found alike on every rank, before any collective
    problem = load_directory_problem(a) or save_directory_problem(a)
    if problem is not None:
        return error_exit(problem)

    try:  # the launcher's variables against MPI's view: each process checks its own
        job = braid.init_distributed(a.distributed_timeout_minutes)
    except ValueError as e:
        return error_exit(without_source(e))
    state = braid.ParallelState(tp=a.tensor_model_parallel_size,
                                pp=a.pipeline_model_parallel_size, cp=a.context_parallel_size,
                                ep=a.expert_model_parallel_size,
                                etp=a.expert_tensor_parallel_size or 0)
    rank = state.rank
    log = (lambda *x, **k: print(*x, **k, flush=True)) if rank == 0 else (lambda *x, **k: None)
    # Rank 0 claims --save for the job's life (kept open until run() returns); every rank learns
    # whether another job holds it, before anything is saved.
    save_lock = claim_save_directory(a.save) if a.save and rank == 0 else None
    if a.save and state.all_gather([float(save_lock is False)])[0][0]:
        return error_exit(save_directory_in_use(a.save))
    print_arguments(a, log)
    if a.save and rank == 0 and save_lock is None:
        log(f"braid: --save {a.save}: its file system takes no locks, so nothing keeps a second "
            "job from saving there too")
    for line in a.checkpoint_args + no_effect_given(a) + moe_args.notes(a) + \
            tokenizer_args.notes(a) + megatron_difference_notes(a) + wandb_log.notes(a):
        log(line)
    device = "cpu"
    if a.device == "cuda":  # one GPU per process of a node, by local rank (braid's launch rule)
        visible = braid.cuda_device_count()
        if visible > 1 and job.local_rank >= visible:
            return error_exit(f"local rank {job.local_rank} has no GPU of its own: this node "
                              f"shows {visible}; start at most {visible} processes per node")
        device = f"cuda:{job.local_rank if visible > 1 else 0}"
    ddp = braid.DDPConfig(bucket_size=a.ddp_bucket_size or 0,
                          overlap_grad_reduce=a.overlap_grad_reduce,
                          use_distributed_optimizer=a.use_distributed_optimizer,
                          overlap_param_gather=a.overlap_param_gather,
                          grad_reduce_in_bf16=a.grad_reduce_in_bf16)
    model = braid.ParallelModel(cfg, device, a.seed, state, braid.ParallelConfig(
        sequence_parallel=a.sequence_parallel, virtual_stages=a.virtual_stages, ddp=ddp,
        first_stage_layers=a.decoder_first_pipeline_num_layers,
        last_stage_layers=a.decoder_last_pipeline_num_layers,
        model_chunk_layers=a.model_chunk_layers))
    if a.reset_attention_mask or a.reset_position_ids:
        model.set_document_masking(a.eod, a.reset_attention_mask, a.reset_position_ids)
    trainer = braid.Trainer(model, config)
    mtp = a.mtp_num_layers or 0
    timers = Timers(a.timing_log_level, a.timing_log_option) if a.timing_log_level > 0 else None
    profiling = a.profile and rank in a.profile_ranks
    trace = braid.Trace(rank, device) if timers is not None or profiling else None
    if timers is not None:
        trainer.set_trace(trace)
    params = cfg.num_parameters()
    windowed = sum(cfg.window_layers) if len(cfg.window_layers) else cfg.num_layers
    log(f"braid: GPT with {params:,} parameters ({cfg.num_layers} layers, hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} heads / {cfg.kv_heads} kv"
        + attention_args.describe(cfg) + activation_args.describe(cfg)
        + (f", a sliding window of {cfg.window_size} on {windowed} layers"
           if cfg.window_size >= 0 else "")
        + (f", {cfg.num_experts} experts of {cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size} "
           f"with top-{cfg.moe_router_topk} routing" if cfg.num_experts else "")
        + (f", {mtp} multi-token prediction layer{'s' if mtp > 1 else ''} (loss scaling "
           f"factor {cfg.mtp_loss_scaling_factor:g})" if mtp else "") + ") on "
        f"{state.world_size} x {device}: tp={state.tp}"
        + (f" cp={state.cp}" if state.cp > 1 else "") + f" pp={state.pp} dp={state.dp}"
        + (f" ep={state.ep}" if state.ep > 1 else "")
        + (" etp=1" if state.etp == 1 and state.tp > 1 and cfg.num_experts else "")
        + (f", {a.virtual_stages} virtual stages" if a.virtual_stages > 1 else "")
        + (", layers per stage " + " | ".join(str(sum(e - b for b, e in chunks))
                                             for chunks in a.stage_layers)
           if a.stage_layers else ""))

    consumed = 0
    earlier_device_seconds = 0.0  # what the run's earlier jobs used (from the checkpoint)
    earlier_skipped_samples = 0  # the samples their --iterations-to-skip dropped
    valid_consumed = None  # the validation position they reached (None: derived, Data)
    if a.load:
        if a.ckpt_step is None and braid.latest_iteration(a.load) < 0:
            if a.exit_on_missing_checkpoint:
                sys.stderr.write(f"braid: error: --exit-on-missing-checkpoint: no checkpoint in "
                                 f"{a.load}\n")
                return 1
            log(f"braid: no checkpoint in {a.load} yet; training from scratch")
        else:
            at = braid.latest_iteration(a.load) if a.ckpt_step is None else a.ckpt_step
            log(f" loading checkpoint from {a.load} at iteration {at}")  # Megatron's lines
            try:
                consumed = braid.load_checkpoint(
                    a.load, trainer, load_optim=not a.no_load_optim, load_rng=not a.no_load_rng,
                    finetune=a.finetune, iteration=-1 if a.ckpt_step is None else a.ckpt_step)
            except ValueError as e:  # every rank reads the same metadata: all fail alike
                return error_exit(without_source(e))
            meta = braid.checkpoint_metadata(a.load, -1 if a.ckpt_step is None else a.ckpt_step)
            if schedule_args.continues_optimizer(a, meta):
                problem = schedule_args.differences(
                    a, meta.get("lr_schedule"), meta.get("trainer", {}).get("global_batch_size"))
                if problem is not None:  # found alike on every rank, before any step
                    return error_exit(problem)
            for line in numerics_warnings(meta.get("config", {}), cfg):
                log(line)
            if not a.finetune:
                earlier_device_seconds = meta.get("device_seconds", 0.0)
                earlier_skipped_samples = meta.get("skipped_train_samples", 0)
                valid_consumed = meta.get("consumed_valid_samples")
            log(f"  successfully loaded checkpoint from {a.load} [ t 1/{state.tp}, "
                f"p 1/{state.pp} ] at iteration {trainer.iteration}")
            log(f"braid: loaded iteration {trainer.iteration} from {a.load} "
                f"({consumed} samples consumed"
                + (f", {earlier_device_seconds / 3600:.4f} device-hours used"
                   if earlier_device_seconds else "") + ")")

    def device_seconds():
        """The run's device time so far: the earlier jobs' and this one's since it started."""
        return earlier_device_seconds + (time.time() - start) * state.world_size
    first = trainer.iteration + 1
    if first > a.train_iters:
        log(f"braid: the checkpoint is at iteration {trainer.iteration}, --train-iters "
            f"{a.train_iters}: nothing left to train")

    try:
        data = Data(a, state.dp_rank, consumed, trainer.iteration, rank, state.barrier,
                    valid_consumed)
    except ValueError as e:  # from the datasets, alike on every rank (Data)
        return error_exit(without_source(e))
    for line in data.notes:
        log(line)
    device_name = braid.cuda_device_name(int(device[5:])) if device != "cpu" and rank == 0 \
        else "cpu"
    meter = Meter(a, cfg, device_name, job.local_world_size, start) if rank == 0 else None
    if meter is not None:
        peak = f"{meter.peak / 1e12:.3f} TFLOP/s per device ({meter.peak_source})" \
            if meter.peak else f"unknown ({meter.peak_source}; give --peak-tflops)"
        log(f"braid: {flops.flops_per_iteration(cfg, a.seq_length, a.global_batch_size):.4g} "
            f"model FLOPs per iteration; MFU against {peak}")
    if a.rampup_batch_size:  # Megatron's announcement, and iterations it makes
        start_batch, increment, ramp_samples = a.rampup_batch_size
        log(f"braid: ramping up the global batch size from {start_batch} by {increment} to "
            f"{a.global_batch_size} over {ramp_samples} samples: {a.train_iters} iterations for "
            f"{a.train_samples} samples")
    wandb_run = wandb_log.start(wandb, a) if rank == 0 else None  # rank 0 has every scalar
    # A full metrics disk warns and training goes on (to its next checkpoint).
    metrics = MetricsWriter(a.tensorboard_dir, a.metrics_jsonl, wandb_run=wandb_run,
                            enabled=rank == 0 and bool(a.tensorboard_dir or a.metrics_jsonl
                                                       or wandb_run is not None),
                            keep_going=True)
    saver = braid.CheckpointSaver(a.save, async_save=a.async_save) if a.save else None
    # --save-retain-interval: rank 0 deletes after each commit, never during a save.
    retention = Retention(a.save, a.save_retain_interval, log, enabled=rank == 0)
    saved = trainer.iteration if a.load and a.save and \
        os.path.realpath(a.save) == os.path.realpath(a.load) else -1
    exits = None
    duration = a.exit_duration_in_mins
    budget_binds = False  # --exit-cost comes before --exit-duration-in-mins
    if a.exit_cost is not None:
        budget = a.exit_cost / a.gpu_hour_price * 3600  # device-seconds
        # Spent already: decided from the checkpoint's count, the same on every rank (each
        # rank's own clock started a little apart); this job's start-up only shortens the rest.
        minutes = max(budget - device_seconds(), 0.0) / state.world_size / 60 or 1e-9
        if earlier_device_seconds >= budget:
            log(f"braid: --exit-cost {a.exit_cost} is spent already "
                f"({device_seconds() / 3600 * a.gpu_hour_price:.4f} so far); not training")
            metrics.close()
            return 0
        budget_binds = duration is None or minutes < duration
        duration = min(minutes, duration or minutes)
    if a.save or a.exit_interval or duration:
        exits = braid.ExitConditions(exit_interval=a.exit_interval or 0,
                                     exit_duration_minutes=duration or 0.0,
                                     signals=bool(a.save))

    def saving(step):
        """A save's step (writing, or committing an async save); a full disk or a lost mount
        ends the job with one line, the committed checkpoints as they were."""
        try:
            return step()
        except (OSError, RuntimeError) as e:
            abort_job(f"saving a checkpoint to {a.save}: {e} (the checkpoints committed before "
                      "stay as they were)")

    announced = -1  # the last commit logged

    def committed():
        """Hands a commit to retention and logs it as Megatron does."""
        nonlocal announced
        retention.committed(saver.last_committed)  # this save, or (async) the one before
        if saver.last_committed != announced:
            announced = saver.last_committed
            bar.clear()
            log(f"  successfully saved checkpoint from iteration {announced:7d} to {a.save}")

    def save(iteration):
        nonlocal saved
        if saver is not None and saved != iteration:
            bar.clear()
            log(f"saving checkpoint at iteration {iteration:7d} to {a.save}"
                + (" (in the background)" if a.async_save else ""))
            saving(lambda: saver.save(
                trainer, data.train.consumed_samples, save_optim=not a.no_save_optim,
                save_rng=not a.no_save_rng, device_seconds=device_seconds(),
                skipped_train_samples=report.skipped_train_samples,
                consumed_valid_samples=data.valid_consumed))
            saved = iteration
            committed()

    def finish_saves():
        """Commits the save in flight and waits for retention's deletions (before exiting)."""
        if saver is not None:
            saving(lambda: saver.wait(trainer))
            committed()
            retention.close()

    def evaluate(iteration, test=False, final=False):
        """Each validation set's next batches (braid.validation_sets), or at the end --eval-iters
        batches of the test split: Megatron's block and tags, `-{index}` per set with
        --multiple-validation-sets. The `final` one after training (Megatron's "on validation
        set") comes after the last save, so the position the checkpoints save does not count
        it."""
        if test and data.test is not None and a.eval_iters:
            sets = [("", (data.test.next() for _ in range(a.eval_iters)))]
        elif not test and data.valid is not None:
            sets = [(s.suffix, s.evaluation()) for s in data.valid]
            # Each set reads its next --eval-iters batches; the position saved counts the
            # evaluations every --eval-interval, not the final one after the last save.
            if not final and not a.full_validation:
                data.valid_consumed += a.eval_iters * a.global_batch_size
        else:
            return
        for suffix, batches in sets:
            try:
                loss = float(np.mean([trainer.evaluate(batch.tokens, data.targets(batch),
                                                       batch.num_microbatches)
                                      for batch in batches]))
            except ValueError as e:  # a batch's (a token past the vocabulary), maybe one rank's
                abort_job(f"{'test' if test else 'validation'}{suffix} at iteration "
                          f"{iteration}: {e}")
            if a.empty_unused_memory_level >= 1:
                braid.empty_cache(device)
            ppl = math.exp(min(loss, 20.0))
            bar.clear()
            where = f"iteration {iteration}" + (" on test set" if test else
                                                " on validation set" if final else "")
            line = (f" validation{suffix} loss at {where} | lm loss value: {loss:.6E} | "
                    f"lm loss PPL: {ppl:.6E} | ")
            log("-" * (len(line) + 1))  # Megatron's rule, a character longer
            log(line)
            log("-" * (len(line) + 1))
            name = "lm loss test" if test else f"lm loss validation{suffix}"
            metrics.scalars(iteration, {name: loss, f"{name} ppl": ppl})

    # mpirun gives its ranks a pseudo-terminal whatever its own output is, so under a launcher
    # the bar is shown only when asked for (--progress-bar on).
    show_bar = a.progress_bar == "on" or (a.progress_bar == "auto" and sys.stdout.isatty()
                                          and state.world_size == 1)
    bar = ProgressBar(rank == 0 and show_bar, a.train_iters, first)
    # --profile: iterations [profile_start, profile_end) of the --profile-ranks ranks, on one time
    # axis (every rank takes the origin after one barrier).
    profile_start = max(a.profile_step_start, first)
    profile_end = min(a.profile_step_end, a.train_iters + 1)

    def profile_begin(it):
        if a.profile and it == profile_start and profile_start < profile_end:
            state.barrier()  # collective: every rank, traced or not
            if profiling:
                trace.clear()
                trace.set_origin()
                trainer.set_trace(trace)

    profile_written = False

    def profile_done(it):
        """Writes the traced iterations (the window's end, or an earlier exit inside it)."""
        nonlocal profile_written
        if not profiling or profile_written or not profile_start <= it < profile_end:
            return
        profile_written = True
        path = os.path.join(a.tensorboard_dir, "traces", f"rank{rank}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        trace.write(path)
        trace.clear()
        if timers is None:
            trainer.set_trace(None)
        print(f"braid: rank {rank} traced iterations {profile_start} to {it}: {path}", flush=True)

    if a.skip_train:  # Megatron's: evaluation alone
        evaluate(trainer.iteration, final=True)
        evaluate(trainer.iteration, test=True)
        if data.no_test:
            log(f"braid: no test evaluation: {data.no_test}")
        metrics.close()
        state.barrier()
        return 0
    train_start = time.time()

    def summary():
        """The job's last lines (rank 0): dropped iterations, then what it trained and cost."""
        report.dropped_summary()
        if meter is None:
            return
        seconds = time.time() - start
        iterations = trainer.iteration - first + 1 - report.dropped
        cost = meter.cost(time.time(), train_start, max(iterations, 1), max(iterations, 1),
                          earlier_device_seconds)
        earlier = (f" + {earlier_device_seconds / 3600:.4f} device-hours of the run's earlier "
                   "jobs") if earlier_device_seconds else ""
        log(f"braid: trained {iterations} iterations in {hms(seconds)} "
            f"({seconds:.1f} s, {state.world_size} x {device})"
            + (f"; final lm loss {stats.loss:.6E}" if stats is not None else "")
            + (f"; cost {cost[0]:.4f} ({a.gpu_hour_price} per device-hour x "
               f"{state.world_size} devices x {seconds / 3600:.4f} h{earlier})" if cost else ""))

    report = IterationLog(a, cfg, trainer=trainer, schedule=config.schedule, state=state,
                          device=device, meter=meter, metrics=metrics, timers=timers, log=log, bar=bar,
                          train_start=train_start, earlier_device_seconds=earlier_device_seconds,
                          skipped_train_samples=earlier_skipped_samples)
    start_samples = data.train.consumed_samples
    job_samples = max(a.train_end_samples - start_samples, 1)  # for the projections
    batch_size = None  # the last step's global batch (it changes only under a ramp)
    stats = None
    # Megatron's --iterations-to-skip N counts the N iterations completed before the step, so
    # it drops the step logged as N + 1. The same on every rank: no collective runs for it.
    to_skip = set(a.iterations_to_skip)
    for it in range(first, a.train_iters + 1):
        profile_begin(it)
        batch = data.train.next()
        if batch is None:  # a loaded data position past what these --train-iters hold
            return error_exit(f"the training data ran out before iteration {it} "
                              f"({data.train.consumed_samples} samples consumed)")
        if batch_size is not None and batch.global_batch_size != batch_size:
            bar.clear()
            log(f"braid: ramping up the global batch size from {batch_size} to "
                f"{batch.global_batch_size} at iteration {it}")
        batch_size = batch.global_batch_size
        if it - 1 in to_skip:  # Megatron's: no step, schedule, log line, evaluation, save, exit
            trainer.pass_iteration(batch_size)
            report.drop(it, batch_size)
            if it == profile_end - 1:
                profile_done(it)
            bar.show(it, train_start, data.train.consumed_samples - start_samples, job_samples)
            continue
        try:
            stats = trainer.train_step(batch.tokens, data.targets(batch), batch.num_microbatches)
        except ValueError as e:  # the batch's (a token past the vocabulary), maybe one rank's
            abort_job(f"iteration {it}: {e}")
        if a.empty_unused_memory_level >= 1:
            braid.empty_cache(device)
        if timers is not None:
            timers.add(stats)
        if it == profile_end - 1:
            profile_done(it)
        if trace is not None and not (profiling and profile_start <= it < profile_end):
            trace.clear()  # the timers' spans: StepStats has their sums
        done_samples = data.train.consumed_samples - start_samples
        report.step(it, stats, batch_size, data.train.consumed_samples, done_samples,
                    job_samples)
        bar.show(it, train_start, done_samples, job_samples)
        if saver is not None and a.async_save and saving(lambda: saver.poll(trainer)):
            committed()  # a background save's
        if a.validates and it % a.eval_interval == 0:
            evaluate(it)
        if a.save_interval and it % a.save_interval == 0:
            save(it)
        reason = exits.check(trainer, it) if exits is not None else ""
        if reason == "--exit-duration-in-mins" and budget_binds:
            reason = f"--exit-cost {a.exit_cost}"
        if reason:
            profile_done(it)
            save(it)
            finish_saves()
            bar.clear()
            where = f"; checkpoint saved to {a.save}" if saver is not None else ""
            log(f"braid: exiting at iteration {it} ({reason}){where}")
            summary()
            metrics.close()
            return 0
    bar.clear()
    # Megatron's end: the last save, then the evaluations "on validation set" and "on test set".
    if saver is not None:
        save(trainer.iteration)
    if a.validates and trainer.iteration >= first:
        evaluate(trainer.iteration, final=True)
        evaluate(trainer.iteration, test=True)
        if data.no_test:
            log(f"braid: no test evaluation: {data.no_test}")
    finish_saves()
    summary()
    state.barrier()
    metrics.close()  # after the barrier: finishing a W&B run may upload for a while
    return 0
