"""braid: a C++/CUDA runtime for training GPT- and Llama-family models.

The heavy lifting lives in the C++ extension ``braid._C``; this package re-exports it.
Tensors cross the boundary through DLPack without copies on the CPU:
``np.from_dlpack(t)``, ``torch.from_dlpack(t)``, ``braid.from_dlpack(array)``.

Under mpirun, ``braid.init_distributed()`` brings MPI up (finalised when the interpreter exits)
and, on a job of more than one process, makes an uncaught exception end the whole job
(``braid.abort``) instead of leaving the other ranks waiting in a collective::

    job = braid.init_distributed()
    state = braid.ParallelState(tp=2, pp=2)            # dp = world size / (tp · pp)
    model = braid.ParallelModel(cfg, "cpu", 1234, state, braid.ParallelConfig())
    trainer = braid.Trainer(model, braid.TrainerConfig(optimizer, schedule))
    trainer.train_step(ids, targets, num_microbatches)  # this DP rank's share of the batch

Checkpoints (Megatron's layout on disk, loadable under any other parallel layout)::

    consumed = braid.load_checkpoint(dir, trainer)     # collective; iteration, optimizer, RNG
    braid.save_checkpoint(dir, trainer, consumed_samples=loader.consumed_samples)
    saver = braid.CheckpointSaver(dir, async_save=True)  # poll() every iteration, wait() at exit
    braid.checkpoint_metadata(dir)["consumed_samples"]  # what a checkpoint saved, as JSON
    exits = braid.ExitConditions(exit_interval=0, exit_duration_minutes=0.0, signals=True)
    reason = exits.check(trainer, trainer.iteration)  # "SIGTERM", "--exit-interval", ... or ""

ExitConditions installs C handlers for SIGTERM and SIGUSR1; Python's signal module installs
its own only for SIGINT, so they stay unless you call ``signal.signal`` on those two.
"""

import json as _json
import os as _os
import sys as _sys
import traceback as _traceback

from braid import _C
from braid._C import (  # noqa: F401
    AdamW,
    AdamWConfig,
    CheckpointSaver,
    DDPConfig,
    Distributed,
    ExitConditions,
    GPTModel,
    KVCache,
    LossScaleConfig,
    LRSchedule,
    ParallelConfig,
    ParallelLayout,
    ParallelModel,
    ParallelState,
    StepStats,
    Tensor,
    Trace,
    Trainer,
    TrainerConfig,
    TransformerConfig,
    WeightDecaySchedule,
    abort,
    cpu_blas,
    cuda_available,
    cuda_device_count,
    cuda_device_name,
    empty_cache,
    from_dlpack,
    iteration_directory,
    latest_iteration,
    load_checkpoint,
    load_parameters,
    memory_stats,
    reset_peak_memory,
    save_checkpoint,
    set_log_level,
)

__version__ = "0.1.0"


def _abort_on_uncaught(kind, value, tb):
    """sys.excepthook of a multi-process job: print the traceback, then end every rank."""
    _traceback.print_exception(kind, value, tb)
    _sys.stderr.flush()
    _C.abort(f"braid: error: uncaught {kind.__name__}: {value}")


def checkpoint_metadata(dir: str, iteration: int = -1) -> dict:
    """The metadata.json of the latest (or `iteration`'s) checkpoint in `dir`: the model config,
    the layout it was saved from, the trainer's counters, consumed samples, device seconds, ...
    (docs/checkpoints.md). Reads one file on this rank; ValueError naming it when there is no
    such checkpoint or it is not JSON."""
    if iteration < 0:
        iteration = latest_iteration(dir)
        if iteration < 0:
            raise ValueError(f"checkpoint: no checkpoint in {dir}")
    path = _os.path.join(iteration_directory(dir, iteration), "metadata.json")
    try:
        with open(path, encoding="utf-8") as f:
            return _json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"checkpoint: cannot read {path}: {e}") from None


def init_distributed(timeout_minutes: float = 10.0) -> Distributed:
    """Brings MPI up once (later calls return the same job and set the collectives' timeout,
    ``--distributed-timeout-minutes``); returns this process's rank and world size. On a job of
    more than one process an uncaught exception aborts the job (MPI_Abort)."""
    job = _C.init_distributed(timeout_minutes)
    if job.world_size > 1 and _sys.excepthook is _sys.__excepthook__:
        _sys.excepthook = _abort_on_uncaught
    return job
