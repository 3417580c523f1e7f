#pragma once
// How a process finds its place in the job, whatever started it:
//   mpirun (OpenMPI)  OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE
//   srun (Slurm)      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NTASKS_PER_NODE
//   torchrun-style    RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
// checked in that order (mpirun inside an sbatch script sees both; OpenMPI's are the truth).
// init_distributed() then brings MPI up and checks that MPI agrees with the environment.

#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "braid/comm/mpi_communicator.h"

namespace braid::comm {

struct LaunchInfo {
  std::string launcher = "none";  // "mpirun", "srun", "torchrun" or "none" (one process)
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
};

using EnvLookup = std::function<const char*(const char*)>;

// From the environment (ConfigError on a malformed or inconsistent value, naming the variable).
LaunchInfo launch_info_from_env(const EnvLookup& getenv = &std::getenv);

// The CUDA device of a process: its local rank, or device 0 when each process sees exactly
// one device (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per rank). ConfigError when the
// local rank has no device of its own.
int cuda_device_for(const LaunchInfo& launch, int visible_devices);
// cuda_device_for with this node's visible devices, then makes it the current device.
int select_cuda_device(const LaunchInfo& launch);

// `--distributed-timeout-minutes` (fractions allowed: tests use seconds); ConfigError if <= 0.
Duration timeout_from_minutes(double minutes);

struct Distributed {
  LaunchInfo launch;
  std::shared_ptr<MpiCommunicator> world;
};

// Brings MPI up, reads the launch environment and checks that MPI sees the same rank and world
// size (ConfigError otherwise: e.g. torchrun without mpirun, which braid cannot bootstrap),
// sets the rank printed in errors. Idempotent: later calls return the same world.
Distributed init_distributed(Duration timeout = kDefaultTimeout);

// Runs `body` as a distributed program's main: a ConfigError (a bad layout or argument,
// found on every rank alike before any collective) prints the same one line
// "braid: error: ..." on every rank, finalises MPI and returns 2; any other exception prints
// its message and aborts the job (exit code 1 on every rank).
int run_main(const std::function<int()>& body);

}  // namespace braid::comm
