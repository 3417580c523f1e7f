// braid-topo: what a node offers a multi-node job — RDMA devices, ports, GID tables, the
// NCCL/OpenMPI environment to export, and (CUDA builds) the GPUs' peer-access matrix.
//
//   braid-topo          a readable report
//   braid-topo --json   the same as one JSON object
//
// A node without RDMA devices is not an error: it says so and exits 0.

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "braid/core/json.h"
#include "topo.h"

#if BRAID_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace {

using namespace braid::topo;

struct CudaPeers {
  int devices = 0;
  std::string error;                     // why there are none, when the runtime says
  std::vector<std::string> names;        // per device
  std::vector<std::vector<int>> access;  // access[i][j]: i can access j's memory
};

CudaPeers probe_cuda() {
  CudaPeers out;
#if BRAID_WITH_CUDA
  cudaError_t status = cudaGetDeviceCount(&out.devices);
  if (status != cudaSuccess) {
    out.devices = 0;
    out.error = cudaGetErrorString(status);
    (void)cudaGetLastError();
    return out;
  }
  out.access.assign(size_t(out.devices), std::vector<int>(size_t(out.devices), 0));
  for (int i = 0; i < out.devices; ++i) {
    cudaDeviceProp prop{};
    out.names.push_back(cudaGetDeviceProperties(&prop, i) == cudaSuccess ? prop.name : "?");
    for (int j = 0; j < out.devices; ++j) {
      int can = 0;
      if (i != j && cudaDeviceCanAccessPeer(&can, i, j) == cudaSuccess) out.access[i][j] = can;
    }
  }
#else
  out.error = "braid-topo was built without CUDA";
#endif
  return out;
}

std::string json_string(const std::string& s) { return braid::json_quote(s); }

template <typename T, typename F>
std::string json_list(const std::vector<T>& items, F&& item) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + item(items[i]);
  return out + "]";
}

void print_json(const std::vector<Hca>& hcas, const std::string& error,
                const NcclSuggestion& suggestion, const CudaPeers& cuda) {
  auto gid = [](const Gid& g) {
    return "{\"index\": " + std::to_string(g.index) + ", \"address\": " + json_string(g.address) +
           ", \"type\": " + json_string(gid_type_name(g.type)) +
           ", \"netdev\": " + json_string(g.netdev) + "}";
  };
  auto port = [&](const Port& p) {
    char speed[32];
    std::snprintf(speed, sizeof(speed), "%g", p.speed_gbps);
    return "{\"number\": " + std::to_string(p.number) + ", \"state\": " + json_string(p.state) +
           ", \"active\": " + (p.active ? "true" : "false") +
           ", \"link_layer\": " + json_string(link_layer_name(p.link_layer)) +
           ", \"active_mtu\": " + std::to_string(p.active_mtu) + ", \"speed_gbps\": " + speed +
           ", \"netdevs\": " + json_list(p.netdevs, json_string) +
           ", \"gids\": " + json_list(p.gids, gid) + "}";
  };
  auto hca = [&](const Hca& h) {
    return "{\"name\": " + json_string(h.name) + ", \"ports\": " + json_list(h.ports, port) + "}";
  };
  std::string env = "{";
  for (size_t i = 0; i < suggestion.env.size(); ++i) {
    env += (i ? ", " : "") + json_string(suggestion.env[i].first) + ": " +
           json_string(suggestion.env[i].second);
  }
  env += "}";
  auto row = [](const std::vector<int>& r) {
    return json_list(r, [](int v) { return std::string(v ? "true" : "false"); });
  };
  std::printf(
      "{\"rdma_devices\": %s, \"rdma_error\": %s, \"nccl_env\": %s, \"notes\": %s, "
      "\"cuda\": {\"devices\": %d, \"names\": %s, \"peer_access\": %s, \"error\": %s}}\n",
      json_list(hcas, hca).c_str(), json_string(error).c_str(), env.c_str(),
      json_list(suggestion.notes, json_string).c_str(), cuda.devices,
      json_list(cuda.names, json_string).c_str(), json_list(cuda.access, row).c_str(),
      json_string(cuda.error).c_str());
}

void print_text(const std::vector<Hca>& hcas, const std::string& error,
                const NcclSuggestion& suggestion, const CudaPeers& cuda) {
  if (hcas.empty()) {
    std::printf("no RDMA devices found%s%s\n", error.empty() ? "" : ": ", error.c_str());
  } else {
    std::printf("RDMA devices: %zu\n", hcas.size());
    for (const Hca& hca : hcas) {
      std::printf("%s\n", hca.name.c_str());
      for (const Port& p : hca.ports) {
        std::string netdevs;
        for (const std::string& n : p.netdevs) netdevs += (netdevs.empty() ? "" : ",") + n;
        std::printf("  port %d  %-12s  %-15s  MTU %d  %g Gb/s%s%s\n", p.number, p.state.c_str(),
                    link_layer_name(p.link_layer), p.active_mtu, p.speed_gbps,
                    netdevs.empty() ? "" : "  netdev ", netdevs.c_str());
        for (const Gid& g : p.gids) {
          std::printf("    GID %-3d %-40s %-8s %s\n", g.index, g.address.c_str(),
                      gid_type_name(g.type), g.netdev.c_str());
        }
      }
    }
    if (!error.empty()) std::printf("(%s)\n", error.c_str());
  }
  if (!suggestion.env.empty()) {
    std::printf("\nsuggested environment (before mpirun / srun; docs/launching.md):\n");
    for (const auto& [name, value] : suggestion.env) {
      std::printf("  export %s=%s\n", name.c_str(), value.c_str());
    }
  }
  if (!suggestion.notes.empty()) {
    std::printf("\nnotes:\n");
    for (const std::string& note : suggestion.notes) std::printf("  - %s\n", note.c_str());
  }
  std::printf("\nCUDA devices: %d%s%s\n", cuda.devices, cuda.error.empty() ? "" : " (",
              cuda.error.empty() ? "" : (cuda.error + ")").c_str());
  if (cuda.devices > 0) {
    std::printf("peer access (row can read column's memory):\n     ");
    for (int j = 0; j < cuda.devices; ++j) std::printf(" %3d", j);
    std::printf("\n");
    for (int i = 0; i < cuda.devices; ++i) {
      std::printf("  %3d", i);
      for (int j = 0; j < cuda.devices; ++j) {
        std::printf(" %3s", i == j ? "-" : (cuda.access[i][j] ? "yes" : "no"));
      }
      std::printf("  %s\n", cuda.names[i].c_str());
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      json = true;
    } else if (std::strcmp(argv[i], "-h") == 0 || std::strcmp(argv[i], "--help") == 0) {
      std::printf(
          "usage: braid-topo [--json]\n"
          "Lists RDMA devices, ports and GIDs, suggests NCCL_IB_HCA, NCCL_IB_GID_INDEX\n"
          "and NCCL_SOCKET_IFNAME, and shows the CUDA peer-access matrix.\n");
      return 0;
    } else {
      std::fprintf(stderr, "braid-topo: unknown argument '%s' (try --help)\n", argv[i]);
      return 2;
    }
  }
  std::string error;
  const std::vector<Hca> hcas = probe_rdma(&error);
  const NcclSuggestion suggestion = suggest_nccl_env(hcas);
  const CudaPeers cuda = probe_cuda();
  if (json) {
    print_json(hcas, error, suggestion, cuda);
  } else {
    print_text(hcas, error, suggestion, cuda);
  }
  return 0;
}
