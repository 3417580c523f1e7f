#include "braid/comm/launch.h"

#include <charconv>
#include <cstdio>
#include <mutex>
#include <string_view>

#include "braid/core/allocator.h"
#include "comm/mpi_check.h"

#ifdef BRAID_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace braid::comm {
namespace {

// The value of `name` as a non-negative integer; -1 when unset. ConfigError when malformed.
int env_int(const EnvLookup& getenv, const char* name) {
  const char* text = getenv(name);
  if (text == nullptr) return -1;
  std::string_view s(text);
  int value = -1;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  BRAID_CONFIG_CHECK(ec == std::errc() && end == s.data() + s.size() && value >= 0,
                     "launch: ", name, "='", s, "' is not a non-negative integer");
  return value;
}

struct Scheme {
  const char* launcher;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;  // nullptr: the launcher has no such variable
};

// In order of precedence: mpirun inside an sbatch script sees Slurm's variables too.
constexpr Scheme kSchemes[] = {
    {"mpirun", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"},
    {"srun", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", nullptr},
    {"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"},
};

std::mutex g_init_mutex;
std::optional<Distributed> g_distributed;

}  // namespace

LaunchInfo launch_info_from_env(const EnvLookup& getenv) {
  for (const Scheme& scheme : kSchemes) {
    const int world_size = env_int(getenv, scheme.world_size);
    if (world_size < 0) continue;
    LaunchInfo info;
    info.launcher = scheme.launcher;
    info.world_size = world_size;
    info.rank = env_int(getenv, scheme.rank);
    BRAID_CONFIG_CHECK(world_size >= 1, "launch (", scheme.launcher, "): ", scheme.world_size, "=",
                       world_size, " must be at least 1");
    BRAID_CONFIG_CHECK(info.rank >= 0, "launch (", scheme.launcher, "): ", scheme.world_size,
                       " is set but ", scheme.rank, " is not");
    BRAID_CONFIG_CHECK(info.rank < world_size, "launch (", scheme.launcher, "): ", scheme.rank, "=",
                       info.rank, " is not below ", scheme.world_size, "=", world_size);
    info.local_rank = env_int(getenv, scheme.local_rank);
    if (info.local_rank < 0) info.local_rank = world_size == 1 ? 0 : -1;  // MPI will say
    info.local_world_size =
        scheme.local_world_size != nullptr ? env_int(getenv, scheme.local_world_size) : -1;
    if (info.local_rank >= 0 && info.local_world_size >= 0) {
      BRAID_CONFIG_CHECK(info.local_rank < info.local_world_size, "launch (", scheme.launcher,
                         "): ", scheme.local_rank, "=", info.local_rank, " is not below ",
                         scheme.local_world_size, "=", info.local_world_size);
    }
    return info;
  }
  return LaunchInfo{};
}

int cuda_device_for(const LaunchInfo& launch, int visible_devices) {
  BRAID_CONFIG_CHECK(visible_devices > 0, "rank ", launch.rank, ": no CUDA device is visible");
  if (visible_devices == 1) return 0;
  BRAID_CONFIG_CHECK(launch.local_rank < visible_devices, "rank ", launch.rank, " (local rank ",
                     launch.local_rank, ") has no CUDA device of its own: this node shows ",
                     visible_devices, " devices; start at most ", visible_devices,
                     " processes per node, or give each one device (CUDA_VISIBLE_DEVICES)");
  return launch.local_rank;
}

int select_cuda_device(const LaunchInfo& launch) {
  const int device = cuda_device_for(launch, cuda_device_count());
#ifdef BRAID_WITH_CUDA
  const cudaError_t status = cudaSetDevice(device);
  BRAID_CHECK(status == cudaSuccess, "cudaSetDevice(", device, "): ", cudaGetErrorString(status));
#endif
  return device;
}

Duration timeout_from_minutes(double minutes) {
  BRAID_CONFIG_CHECK(minutes > 0, "--distributed-timeout-minutes must be positive, got ", minutes);
  return Duration(int64_t(minutes * 60000.0 + 0.5));
}

Distributed init_distributed(Duration timeout) {
  std::lock_guard lock(g_init_mutex);
  std::shared_ptr<MpiCommunicator> world = MpiCommunicator::world();
  world->set_timeout(timeout);
  if (g_distributed) return *g_distributed;

  LaunchInfo launch = launch_info_from_env();
  if (launch.launcher == "none") {
    launch.launcher = world->size() > 1 ? "mpi" : "none";
    launch.rank = world->rank();
    launch.world_size = world->size();
  }
  BRAID_CONFIG_CHECK(launch.rank == world->rank() && launch.world_size == world->size(), "launch (",
                     launch.launcher, "): the environment says rank ", launch.rank, " of ",
                     launch.world_size, " but MPI sees rank ", world->rank(), " of ", world->size(),
                     ": braid connects its processes through MPI; start the job with mpirun or "
                     "srun --mpi=pmix (docs/launching.md)");
  // The node-local view, from MPI: which processes share this node's memory.
  MPI_Comm node = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split_type(world->handle(), MPI_COMM_TYPE_SHARED, world->rank(), MPI_INFO_NULL,
                                &node));
  int node_rank = 0, node_size = 1;
  MPI_CHECK(MPI_Comm_rank(node, &node_rank));
  MPI_CHECK(MPI_Comm_size(node, &node_size));
  MPI_CHECK(MPI_Comm_free(&node));
  if (launch.local_rank < 0) launch.local_rank = node_rank;
  if (launch.local_world_size < 0) launch.local_world_size = node_size;
  g_distributed = Distributed{launch, world};
  return *g_distributed;
}

int run_main(const std::function<int()>& body) {
  try {
    return body();
  } catch (const ConfigError& e) {
    // Found alike on every rank before any collective: every rank says it and leaves cleanly.
    std::fprintf(stderr, "braid: error: %s\n", e.message().c_str());
    std::fflush(stderr);
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (initialized && !finalized) MPI_Finalize();
    return 2;
  } catch (const std::exception& e) {
    abort_job(std::string("braid: error: ") + e.what());
  }
}

}  // namespace braid::comm
