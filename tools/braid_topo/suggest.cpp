// The NCCL environment braid-topo suggests for a node: a pure function of the probed ports.
//
//   NCCL_IB_HCA        "=dev:port,..." of the active ports ("=": exact names, so that mlx5_1
//                      does not also select mlx5_10..19). InfiniBand ports are preferred when
//                      a node has both kinds active: one job should not mix link layers.
//   NCCL_IB_GID_INDEX  Ethernet (RoCE) only: the index of the RoCE v2 GID derived from the
//                      port's IPv4 address (::ffff:a.b.c.d), routable across subnets. NCCL
//                      takes one index for every HCA, so the most common one is suggested.
//   NCCL_SOCKET_IFNAME the interfaces behind those GIDs (RoCE) or the HCAs' IPoIB interfaces
//                      (InfiniBand): where NCCL's TCP bootstrap goes. The same list, without
//                      the "=", is what OpenMPI's btl_tcp_if_include / oob_tcp_if_include take.

#include <algorithm>
#include <cstdio>
#include <map>

#include "topo.h"

namespace braid::topo {

const char* link_layer_name(LinkLayer layer) {
  switch (layer) {
    case LinkLayer::infiniband:
      return "InfiniBand";
    case LinkLayer::ethernet:
      return "Ethernet (RoCE)";
    case LinkLayer::unknown:
      break;
  }
  return "unknown";
}

const char* gid_type_name(GidType type) {
  switch (type) {
    case GidType::ib:
      return "IB";
    case GidType::roce_v1:
      return "RoCE v1";
    case GidType::roce_v2:
      return "RoCE v2";
  }
  return "?";
}

bool is_ipv4_mapped(const std::string& address) {
  const std::string prefix = "::ffff:";
  if (address.size() <= prefix.size() || address.compare(0, prefix.size(), prefix) != 0) {
    return false;
  }
  return address.find('.', prefix.size()) != std::string::npos;  // ::ffff:10.0.0.1
}

double lane_gbps(int active_speed) {
  switch (active_speed) {
    case 1:
      return 2.5;  // SDR
    case 2:
      return 5.0;  // DDR
    case 4:
      return 10.0;  // QDR
    case 8:
      return 10.0;  // FDR10
    case 16:
      return 14.0;  // FDR
    case 32:
      return 25.0;  // EDR
    case 64:
      return 50.0;  // HDR
    case 128:
      return 100.0;  // NDR
    default:
      return 0.0;
  }
}

int lane_count(int active_width) {
  switch (active_width) {
    case 1:
      return 1;
    case 2:
      return 4;
    case 4:
      return 8;
    case 8:
      return 12;
    case 16:
      return 2;
    default:
      return 0;
  }
}

namespace {

struct ActivePort {
  const Hca* hca;
  const Port* port;
  std::string id() const { return hca->name + ":" + std::to_string(port->number); }
};

std::string join(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (const std::string& item : items) {
    if (!out.empty()) out += separator;
    out += item;
  }
  return out;
}

// NCCL's exact-match list: "=a,b" (GCC 12 warns falsely about "=" + std::string here).
std::string exact(const std::vector<std::string>& items) {
  std::string out = "=";
  out += join(items, ",");
  return out;
}

void add_unique(std::vector<std::string>& items, const std::string& item) {
  if (!item.empty() && std::find(items.begin(), items.end(), item) == items.end()) {
    items.push_back(item);
  }
}

// The GID NCCL should use on a RoCE port: the lowest-index RoCE v2 GID with an IPv4-mapped
// address; nullptr when the port has none.
const Gid* roce_v2_ipv4_gid(const Port& port) {
  const Gid* best = nullptr;
  for (const Gid& gid : port.gids) {
    if (gid.type == GidType::roce_v2 && is_ipv4_mapped(gid.address) &&
        (best == nullptr || gid.index < best->index)) {
      best = &gid;
    }
  }
  return best;
}

}  // namespace

NcclSuggestion suggest_nccl_env(const std::vector<Hca>& hcas) {
  NcclSuggestion out;
  std::vector<ActivePort> ib, eth;
  std::vector<std::string> inactive;
  for (const Hca& hca : hcas) {
    for (const Port& port : hca.ports) {
      ActivePort ap{&hca, &port};
      if (!port.active) {
        inactive.push_back(ap.id() + " (" + (port.state.empty() ? "not active" : port.state) + ")");
      } else if (port.link_layer == LinkLayer::infiniband) {
        ib.push_back(ap);
      } else if (port.link_layer == LinkLayer::ethernet) {
        eth.push_back(ap);
      } else {
        inactive.push_back(ap.id() + " (unknown link layer)");
      }
    }
  }
  if (!inactive.empty()) out.notes.push_back("left out, not usable: " + join(inactive, ", "));
  if (ib.empty() && eth.empty()) {
    out.notes.push_back(hcas.empty() ? "no RDMA devices: NCCL will use TCP sockets between nodes"
                                     : "no active RDMA port: NCCL will use TCP sockets between "
                                       "nodes");
    return out;
  }
  const bool use_ib = !ib.empty();
  const std::vector<ActivePort>& chosen = use_ib ? ib : eth;
  if (use_ib && !eth.empty()) {
    std::vector<std::string> ids;
    for (const ActivePort& ap : eth) ids.push_back(ap.id());
    out.notes.push_back("InfiniBand ports preferred; active Ethernet (RoCE) ports left out: " +
                        join(ids, ", "));
  }

  std::vector<std::string> ids;
  for (const ActivePort& ap : chosen) ids.push_back(ap.id());
  out.env.emplace_back("NCCL_IB_HCA", exact(ids));

  std::vector<std::string> netdevs;
  if (use_ib) {
    for (const ActivePort& ap : chosen) {
      for (const std::string& netdev : ap.port->netdevs) add_unique(netdevs, netdev);
    }
    if (netdevs.empty()) {
      out.notes.push_back(
          "InfiniBand: no IPoIB interface found on these HCAs; set NCCL_SOCKET_IFNAME to the "
          "interface the nodes reach each other by (NCCL's bootstrap is TCP)");
    }
  } else {
    // One GID index for all HCAs: the most common; ties go to the lowest index.
    std::map<int, std::vector<std::string>> by_index;
    std::vector<std::string> without;
    for (const ActivePort& ap : chosen) {
      const Gid* gid = roce_v2_ipv4_gid(*ap.port);
      if (gid == nullptr) {
        without.push_back(ap.id());
      } else {
        by_index[gid->index].push_back(ap.id());
      }
    }
    int index = -1;
    size_t most = 0;
    for (const auto& [i, ports] : by_index) {
      if (ports.size() > most) {
        index = i;
        most = ports.size();
      }
    }
    if (index >= 0) {
      out.env.emplace_back("NCCL_IB_GID_INDEX", std::to_string(index));
      for (const ActivePort& ap : chosen) {
        const Gid* gid = roce_v2_ipv4_gid(*ap.port);
        if (gid != nullptr && gid->index == index) add_unique(netdevs, gid->netdev);
      }
      for (const auto& [i, ports] : by_index) {
        if (i == index) continue;
        out.notes.push_back("RoCE v2 IPv4 GID at index " + std::to_string(i) + " on " +
                            join(ports, ", ") + ", not " + std::to_string(index) +
                            ": NCCL uses one index for all HCAs; unset NCCL_IB_GID_INDEX to let "
                            "NCCL (>= 2.21) pick per HCA, or align the interfaces' addresses");
      }
    }
    if (!without.empty()) {
      out.notes.push_back("no RoCE v2 GID with an IPv4 address on " + join(without, ", ") +
                          ": give its interface an IPv4 address (RoCE v1 and link-local GIDs "
                          "do not route between subnets)");
    }
  }
  if (!netdevs.empty()) {
    out.env.emplace_back("NCCL_SOCKET_IFNAME", exact(netdevs));
    out.env.emplace_back("OMPI_MCA_btl_tcp_if_include", join(netdevs, ","));
    out.env.emplace_back("OMPI_MCA_oob_tcp_if_include", join(netdevs, ","));
  }
  return out;
}

}  // namespace braid::topo
