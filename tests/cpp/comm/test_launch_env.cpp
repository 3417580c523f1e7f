// How a process finds its rank: mpirun, srun and torchrun-style variables, and its device.

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "braid/comm/launch.h"

using braid::ConfigError;
using braid::comm::cuda_device_for;
using braid::comm::launch_info_from_env;
using braid::comm::LaunchInfo;
using Env = std::map<std::string, std::string>;

namespace {

LaunchInfo from(const Env& env) {
  return launch_info_from_env([&](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

std::string error_of(const Env& env) {
  try {
    from(env);
  } catch (const ConfigError& e) {
    return e.message();
  }
  return "";
}

}  // namespace

TEST(LaunchEnv, NoLauncherIsOneProcess) {
  LaunchInfo info = from({});
  EXPECT_EQ(info.launcher, "none");
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.local_rank, 0);
}

TEST(LaunchEnv, OpenMpi) {
  LaunchInfo info = from({{"OMPI_COMM_WORLD_RANK", "5"},
                          {"OMPI_COMM_WORLD_SIZE", "16"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(info.launcher, "mpirun");
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 16);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
}

TEST(LaunchEnv, Slurm) {
  LaunchInfo info = from({{"SLURM_PROCID", "9"}, {"SLURM_NTASKS", "32"}, {"SLURM_LOCALID", "1"}});
  EXPECT_EQ(info.launcher, "srun");
  EXPECT_EQ(info.rank, 9);
  EXPECT_EQ(info.world_size, 32);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, -1);  // filled in from MPI by init_distributed
}

TEST(LaunchEnv, TorchrunStyle) {
  LaunchInfo info =
      from({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "8"}});
  EXPECT_EQ(info.launcher, "torchrun");
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 3);
}

TEST(LaunchEnv, MpirunInsideAnSbatchScriptTrustsOpenMpi) {
  LaunchInfo info = from({{"SLURM_PROCID", "0"},
                          {"SLURM_NTASKS", "8"},
                          {"SLURM_LOCALID", "0"},
                          {"OMPI_COMM_WORLD_RANK", "6"},
                          {"OMPI_COMM_WORLD_SIZE", "8"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}});
  EXPECT_EQ(info.launcher, "mpirun");
  EXPECT_EQ(info.rank, 6);
  EXPECT_EQ(info.local_rank, 2);
}

TEST(LaunchEnv, MalformedValuesNameTheVariable) {
  EXPECT_EQ(error_of({{"RANK", "two"}, {"WORLD_SIZE", "4"}}),
            "launch: RANK='two' is not a non-negative integer");
  EXPECT_EQ(error_of({{"RANK", "4"}, {"WORLD_SIZE", "4"}}),
            "launch (torchrun): RANK=4 is not below WORLD_SIZE=4");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "4"}}),
            "launch (torchrun): WORLD_SIZE is set but RANK is not");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "0"}}),
            "launch (srun): SLURM_NTASKS=0 must be at least 1");
  EXPECT_EQ(error_of({{"OMPI_COMM_WORLD_RANK", "-1"}, {"OMPI_COMM_WORLD_SIZE", "2"}}),
            "launch: OMPI_COMM_WORLD_RANK='-1' is not a non-negative integer");
  EXPECT_EQ(
      error_of(
          {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"}}),
      "launch (torchrun): LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2");
}

TEST(LaunchEnv, CudaDeviceFromLocalRank) {
  LaunchInfo info;
  info.rank = 13;
  info.local_rank = 5;
  EXPECT_EQ(cuda_device_for(info, 8), 5);
  EXPECT_EQ(cuda_device_for(info, 1), 0);  // one device per process (CUDA_VISIBLE_DEVICES)
  EXPECT_THROW(cuda_device_for(info, 4), ConfigError);
  EXPECT_THROW(cuda_device_for(info, 0), ConfigError);
}

TEST(LaunchEnv, TimeoutMinutes) {
  EXPECT_EQ(braid::comm::timeout_from_minutes(10).count(), 600000);
  EXPECT_EQ(braid::comm::timeout_from_minutes(0.05).count(), 3000);
  EXPECT_THROW(braid::comm::timeout_from_minutes(0), ConfigError);
}
