#pragma once
// braid-topo's model of a node: RDMA devices (HCAs), their ports and GID tables, as plain
// structs. probe_rdma() fills them from libibverbs; suggest_nccl_env() — a pure function, so
// that it is tested on synthetic nodes — turns them into the NCCL and OpenMPI settings
// docs/launching.md explains.

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace braid::topo {

enum class LinkLayer { infiniband, ethernet, unknown };
enum class GidType { ib, roce_v1, roce_v2 };

const char* link_layer_name(LinkLayer layer);  // "InfiniBand", "Ethernet (RoCE)", "unknown"
const char* gid_type_name(GidType type);       // "IB", "RoCE v1", "RoCE v2"

struct Gid {
  int index = 0;
  std::string address;  // IPv6 notation, "fe80::...", "::ffff:10.0.0.1"
  GidType type = GidType::ib;
  std::string netdev;  // the Ethernet interface a RoCE GID belongs to ("" for IB)
};

// True for ::ffff:a.b.c.d, the GIDs RoCE v2 derives from an interface's IPv4 address.
bool is_ipv4_mapped(const std::string& address);

struct Port {
  int number = 1;
  bool active = false;  // IBV_PORT_ACTIVE
  std::string state;    // "PORT_ACTIVE", "PORT_DOWN", ...
  LinkLayer link_layer = LinkLayer::unknown;
  int active_mtu = 0;       // bytes
  double speed_gbps = 0.0;  // per-lane rate × lanes, e.g. 4 × 25 = 100 for EDR 4x
  std::vector<Gid> gids;
  std::vector<std::string> netdevs;  // network interfaces of the port (IPoIB on InfiniBand)
};

struct Hca {
  std::string name;  // "mlx5_0"
  std::vector<Port> ports;
};

// ibv_port_attr's active_speed and active_width codes.
double lane_gbps(int active_speed);  // 0 for an unknown code
int lane_count(int active_width);    // 0 for an unknown code

struct NcclSuggestion {
  std::vector<std::pair<std::string, std::string>> env;  // in the order to print
  std::vector<std::string> notes;                        // why, and what could not be decided
};

NcclSuggestion suggest_nccl_env(const std::vector<Hca>& hcas);

// Reads the node through libibverbs. `error` explains an empty result that is not simply "no
// devices" (e.g. no kernel support).
std::vector<Hca> probe_rdma(std::string* error);

}  // namespace braid::topo
