"""What the training loop reports: Megatron's log line and scalars for each iteration
(IterationLog), throughput, MFU and cost (Meter), where the step time went across ranks
(Timers) and the progress bar on a terminal (ProgressBar)."""

from __future__ import annotations

import datetime
import math
import sys
import time

import braid
from braid import flops


class Meter:
    """Throughput, MFU, memory and cost of the run so far (rank 0's view)."""

    def __init__(self, a, cfg, device_name, local_processes, start_time):
        self.a, self.start = a, start_time
        self.flops_per_sample = flops.flops_per_iteration(cfg, a.seq_length, 1)
        if a.peak_tflops:
            self.peak, self.peak_source = a.peak_tflops * 1e12, "--peak-tflops"
        elif a.device == "cuda":
            peak = flops.gpu_peak_tflops(device_name)
            self.peak = peak * 1e12 if peak else None
            self.peak_source = f"{device_name} dense bf16" if peak else f"{device_name} unknown"
        else:
            self.peak = flops.cpu_peak_flops(local_processes)
            self.peak_source = "measured f32 GEMM of this rank's cores"

    def rates(self, seconds, samples):
        """(tokens/s, model TFLOP/s per device, MFU) of `samples` samples in `seconds`."""
        tflops = self.flops_per_sample * samples / seconds / self.a.world_size / 1e12
        mfu = tflops * 1e12 / self.peak if self.peak else float("nan")
        return samples * self.a.seq_length / seconds, tflops, mfu

    def cost(self, now, train_start, done, total, earlier_device_seconds=0.0):
        """(cost so far, projected cost of the whole run), or None without a price. This job
        has trained `done` of its `total` samples; the run's earlier jobs (resumed from a
        checkpoint) used `earlier_device_seconds`."""
        if self.a.gpu_hour_price is None:
            return None
        per_device_second = self.a.gpu_hour_price / 3600.0
        earlier = earlier_device_seconds * per_device_second
        per_second = per_device_second * self.a.world_size
        so_far = earlier + (now - self.start) * per_second
        if done <= 0:
            return so_far, float("nan")
        projected = (train_start - self.start) + (now - train_start) / done * total
        return so_far, earlier + projected * per_second


class Timers:
    """Where each rank's step time went (--timing-log-level), from the trainer's trace: ms per
    iteration over a log interval, compared across ranks like Megatron's timers."""

    LEVELS = {1: ["step", "compute", "pipeline-wait", "comm-wait"],
              2: ["tp-comm-wait", "dp-comm-wait", "ep-comm-wait", "other-comm-wait"]}

    def __init__(self, level, option):
        self.names = [n for lv in sorted(self.LEVELS) if lv <= level for n in self.LEVELS[lv]]
        self.option = option
        self.sums = [0.0] * len(self.names)
        self.iterations = 0

    def add(self, stats):
        comm = (stats.tp_wait_seconds + stats.dp_wait_seconds + stats.ep_wait_seconds +
                stats.other_wait_seconds)
        values = {"step": stats.seconds, "compute": stats.compute_seconds,
                  "pipeline-wait": stats.pipeline_wait_seconds, "comm-wait": comm,
                  "tp-comm-wait": stats.tp_wait_seconds, "dp-comm-wait": stats.dp_wait_seconds,
                  "ep-comm-wait": stats.ep_wait_seconds,
                  "other-comm-wait": stats.other_wait_seconds}
        self.sums = [s + values[n] for s, n in zip(self.sums, self.names)]
        self.iterations += 1

    def gather(self, state):
        """Every rank's ms per iteration since the last gather, {name: [rank 0, ...]}
        (collective over the job); starts a new interval."""
        mine = [1e3 * s / max(self.iterations, 1) for s in self.sums]
        ranks = state.all_gather(mine)
        self.sums = [0.0] * len(self.names)
        self.iterations = 0
        return {n: [r[i] for r in ranks] for i, n in enumerate(self.names)}

    def lines(self, per_rank):
        width = max(len(n) for n in self.names) + 4
        def label(n):
            return f"    {n} {'.' * (width - len(n))}:"
        if self.option == "max":
            return ["max time across ranks (ms):"] + [
                f"{label(n)} {max(v):.2f}" for n, v in per_rank.items()]
        if self.option == "minmax":
            return ["(min, max) time across ranks (ms):"] + [
                f"{label(n)} ({min(v):.2f}, {max(v):.2f})" for n, v in per_rank.items()]
        lines = ["times across ranks (ms):"]
        for n, v in per_rank.items():
            lines.append(f"  {n}:")
            lines += [f"     rank {r:2d}: {t:.2f}" for r, t in enumerate(v)]
        return lines

    @staticmethod
    def metrics(per_rank):
        out = {}
        for n, v in per_rank.items():
            out[f"{n}-time"] = max(v)
            out[f"{n}-time-mean"] = sum(v) / len(v)
        return out


class ProgressBar:
    """One line under the log on a terminal: a bar, iterations/s and the ETA (from the samples
    trained and left, so a --rampup-batch-size run's small early steps do not make it short)."""

    def __init__(self, enabled, total, first):
        self.enabled, self.total, self.first = enabled, total, first
        self.shown = False

    def show(self, iteration, started, done_samples, job_samples):
        if not self.enabled:
            return
        elapsed = max(time.time() - started, 1e-9)
        rate = (iteration - self.first + 1) / elapsed
        eta = elapsed * (job_samples - done_samples) / done_samples if done_samples > 0 \
            else float("nan")
        width = 30
        filled = int(width * iteration / self.total)
        bar = "=" * filled + (">" if filled < width else "") + " " * max(0, width - filled - 1)
        sys.stdout.write(f"\r[{bar}] {100 * iteration / self.total:3.0f}% {iteration}/{self.total}"
                         f" | {rate:.2f} it/s | ETA {hms(eta)} ")
        sys.stdout.flush()
        self.shown = True

    def clear(self):
        if self.shown:
            sys.stdout.write("\r\033[K")
            self.shown = False


def hms(seconds):
    if not math.isfinite(seconds):
        return "?"
    return str(datetime.timedelta(seconds=int(seconds)))


def _now():
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S")


class IterationLog:
    """Each training iteration's report: the scalars every --tensorboard-log-interval
    iterations (TensorBoard and JSONL: Megatron's tags) and Megatron's log line every
    --log-interval, with the rates over the iterations since the last line. Only rank 0 has a
    meter and writes; every rank calls step(), since --log-params-norm and the timers gather
    across the job."""

    def __init__(self, a, cfg, *, trainer, schedule, state, device, meter, metrics, timers, log,
                 bar, train_start, earlier_device_seconds, skipped_train_samples=0):
        self.a, self.trainer, self.state, self.device = a, trainer, state, device
        self.schedule = schedule  # the trainer's LRSchedule
        self.meter, self.metrics, self.timers, self.log, self.bar = meter, metrics, timers, log, bar
        self.train_start, self.earlier = train_start, earlier_device_seconds
        # The router losses Megatron logs, each without its coefficient, under its names.
        self.balancing = cfg.num_experts > 0 and cfg.moe_aux_loss_coeff > 0
        self.balancing_name = "seq_load_balancing_loss" \
            if a.moe_router_load_balancing_type == "seq_aux_loss" else "load_balancing_loss"
        self.z_loss = cfg.num_experts > 0 and cfg.moe_z_loss_coeff > 0
        # Multi-token prediction: each depth's loss (Megatron's "mtp_1 loss", ...). An MTP layer
        # is of the model's last layer's kind, and its router losses follow the model's layers'
        # (index num_layers + k - 1, as Megatron counts them).
        self.mtp = a.mtp_num_layers or 0
        expert_layers = [bool(e) for e in cfg.moe_layers] or [True] * cfg.num_layers
        expert_layers += expert_layers[-1:] * self.mtp
        self.moe_layers = [layer for layer, experts in enumerate(expert_layers)
                           if a.moe_per_layer_logging and cfg.num_experts > 0 and experts]
        self.interval_start = train_start
        self.interval_iters = self.interval_samples = self.skipped = self.nans = 0
        self.loss_sums = {}  # the interval's advanced (not skipped) iterations' losses, summed
        # Megatron's skipped_train_samples: the samples of the batches --iterations-to-skip
        # dropped over the run (the checkpoint's, then this job's: drop()). A dropped iteration
        # is not reported, nor counted in the interval.
        self.skipped_train_samples = skipped_train_samples
        self.dropped = 0  # this job's dropped iterations

    def drop(self, it, batch_size):
        """Iteration `it` dropped its batch of `batch_size` samples (--iterations-to-skip)."""
        self.dropped += 1
        self.skipped_train_samples += batch_size
        self.bar.clear()
        self.log(f"braid: iteration {it}: its batch of {batch_size} samples dropped "
                 f"(--iterations-to-skip {it - 1})")

    def dropped_summary(self):
        if self.dropped:
            self.log(f"braid: --iterations-to-skip dropped the batches of {self.dropped} "
                     f"iteration{'s' if self.dropped > 1 else ''} in this job; "
                     f"{self.skipped_train_samples} samples not trained on in the run")

    def step(self, it, stats, batch_size, consumed_samples, done_samples, job_samples):
        """Reports iteration `it` (its StepStats, its global batch): `consumed_samples` in all,
        `done_samples` of this job's `job_samples`."""
        a = self.a
        self.interval_iters += 1
        self.interval_samples += batch_size
        self.skipped += stats.skipped
        self.nans += not math.isfinite(stats.loss)
        logged = it % a.log_interval == 0 or it == a.train_iters
        # By the arguments alone (not by rank 0's writer): params_norm() is collective.
        recorded = bool(a.tensorboard_dir or a.metrics_jsonl or a.wandb_project) and \
            it % a.tensorboard_log_interval == 0
        # Collective (every rank, the same iterations): Megatron's --log-params-norm.
        params_norm = self.trainer.params_norm() if a.log_params_norm and (logged or recorded) \
            else None
        losses = self._losses(stats)
        if not stats.skipped:
            for name, value in losses.items():
                self.loss_sums[name] = self.loss_sums.get(name, 0.0) + value
        # As Megatron logs it: the rate the scheduler holds after this step's update (the next
        # step's), not the one this step used.
        at = self.trainer.schedule_iterations
        rates = (self.schedule.lr_at(at), self.schedule.decoupled_lr_at(at))
        if self.meter is not None and recorded:
            self.metrics.scalars(it, self._scalars(stats, losses, rates, batch_size, params_norm,
                                                   done_samples, job_samples))
        if logged:
            now = time.time()
            per_rank = self.timers.gather(self.state) if self.timers is not None else None
            if self.meter is not None:
                # Megatron's: each loss's mean over the interval's advanced iterations.
                advanced = self.interval_iters - self.skipped
                means = {name: total / advanced for name, total in self.loss_sums.items()} \
                    if advanced else losses
                self._line(it, now, stats, means, rates, batch_size, consumed_samples,
                           params_norm, done_samples, job_samples)
                if per_rank is not None:
                    self.log("\n".join(self.timers.lines(per_rank)))
                    if a.log_timers_to_tensorboard:
                        self.metrics.scalars(it, Timers.metrics(per_rank))
            self.interval_start = now
            self.interval_iters = self.interval_samples = self.skipped = self.nans = 0
            self.loss_sums = {}

    def _losses(self, stats) -> dict[str, float]:
        """The step's losses by Megatron's names, in its log line's order: the LM loss, the
        router losses without their coefficients and each MTP depth's mean cross-entropy."""
        losses = {"lm loss": stats.loss}
        if self.balancing:
            losses[self.balancing_name] = stats.load_balancing_loss
        if self.z_loss:
            losses["z_loss"] = stats.z_loss
        for depth, loss in enumerate(stats.mtp_losses if self.mtp else [], 1):
            losses[f"mtp_{depth} loss"] = loss
        return losses

    def _scalars(self, stats, losses, rates, batch_size, params_norm, done_samples, job_samples):
        a = self.a
        tokens_per_s, tflops, mfu = self.meter.rates(stats.seconds, batch_size)
        values = {**losses, "learning-rate": rates[0],
                  **({"decoupled-learning-rate": rates[1]} if a.decoupled_lr is not None else {}),
                  "grad-norm": stats.grad_norm, "loss-scale": stats.loss_scale,
                  "batch-size": batch_size, "iteration-time": stats.seconds,
                  "throughput": tflops, "tokens-per-sec": tokens_per_s, "mfu": mfu,
                  "mem-peak-gb": stats.peak_memory_bytes / 1e9,
                  "skipped-iterations": self.trainer.skipped_iterations}
        if self.skipped_train_samples:  # Megatron's tag, once there are any
            values["skipped-train-samples"] = self.skipped_train_samples
        for layer in self.moe_layers:  # --moe-per-layer-logging, Megatron's names
            if self.balancing:
                values[f"moe/{self.balancing_name}_layer_{layer}"] = \
                    stats.layer_load_balancing_loss[layer]
            if self.z_loss:
                values[f"moe/z_loss_layer_{layer}"] = stats.layer_z_loss[layer]
        if params_norm is not None:
            values["params-norm"] = params_norm
        if a.log_num_zeros_in_grad:
            values["num-zeros"] = stats.num_zeros_in_grads
        if a.log_memory_to_tensorboard:  # Megatron's tags, in bytes
            memory = braid.memory_stats(self.device)
            values.update({"mem-allocated-bytes": memory["current_bytes"],
                           "mem-max-allocated-bytes": stats.peak_memory_bytes,
                           "mem-reserved-bytes": memory["reserved_bytes"]})
        if a.log_world_size_to_tensorboard:  # Megatron's tag
            values["world-size"] = self.state.world_size
        cost = self.meter.cost(time.time(), self.train_start, done_samples, job_samples,
                               self.earlier)
        if cost is not None:
            values["cost"] = cost[0]
        return values

    def _line(self, it, now, stats, losses, rates, batch_size, consumed_samples, params_norm,
              done_samples, job_samples):
        a = self.a
        per_iteration = (now - self.interval_start) / self.interval_iters
        tokens_per_s, tflops, mfu = self.meter.rates(now - self.interval_start,
                                                     self.interval_samples)
        cost = self.meter.cost(now, self.train_start, done_samples, job_samples, self.earlier)
        self.bar.clear()
        self.log(
            f" [{_now()}] iteration {it:8d}/{a.train_iters:8d} | consumed samples: "
            f"{consumed_samples:12d} | "
            + (f"skipped samples: {self.skipped_train_samples:12d} | "
               if self.skipped_train_samples else "")
            + f"elapsed time per iteration (ms): {per_iteration * 1e3:.1f} | "
            + (f"throughput per GPU (TFLOP/s/GPU): {tflops:.1f} | " if a.log_throughput else "")
            + f"learning rate: {rates[0]:.6E} | "
            + (f"decoupled learning rate: {rates[1]:.6E} | " if a.decoupled_lr is not None
               else "")
            + f"global batch size: {batch_size:5d} | "
            + "".join(f"{name}: {value:.6E} | " for name, value in losses.items())
            + f"loss scale: {stats.loss_scale:.1f} | grad norm: {stats.grad_norm:.3f} | "
            + (f"num zeros: {stats.num_zeros_in_grads:.1f} | "
               if a.log_num_zeros_in_grad else "")
            + (f"params norm: {params_norm:.3f} | " if params_norm is not None else "")
            + f"number of skipped iterations: {self.skipped:3d} | number of nan iterations: "
            f"{self.nans:3d} | tokens per second: {tokens_per_s:.0f} | throughput per device "
            f"(TFLOP/s): {tflops:.3f} | MFU: {100 * mfu:.2f}% | peak memory (MB): "
            f"{stats.peak_memory_bytes / 2**20:.1f} |"
            + (f" cost: {cost[0]:.4f} (projected {cost[1]:.4f}) |" if cost else ""))
