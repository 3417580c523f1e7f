// probe_rdma: the node's RDMA devices through libibverbs (ports, GID tables with their types
// and interfaces), plus sysfs for the IPoIB interfaces of InfiniBand ports.

#include <arpa/inet.h>
#include <dirent.h>
#include <infiniband/verbs.h>
#include <net/if.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>

#include "topo.h"

namespace braid::topo {

namespace {

int mtu_bytes(ibv_mtu mtu) {
  switch (mtu) {
    case IBV_MTU_256:
      return 256;
    case IBV_MTU_512:
      return 512;
    case IBV_MTU_1024:
      return 1024;
    case IBV_MTU_2048:
      return 2048;
    case IBV_MTU_4096:
      return 4096;
  }
  return 0;
}

LinkLayer link_layer(uint8_t layer) {
  switch (layer) {
    case IBV_LINK_LAYER_INFINIBAND:
      return LinkLayer::infiniband;
    case IBV_LINK_LAYER_ETHERNET:
      return LinkLayer::ethernet;
    case IBV_LINK_LAYER_UNSPECIFIED:  // old drivers: InfiniBand
      return LinkLayer::infiniband;
    default:
      return LinkLayer::unknown;
  }
}

GidType gid_type(uint32_t type) {
  switch (type) {
    case IBV_GID_TYPE_ROCE_V1:
      return GidType::roce_v1;
    case IBV_GID_TYPE_ROCE_V2:
      return GidType::roce_v2;
    default:
      return GidType::ib;
  }
}

std::string gid_address(const ibv_gid& gid) {
  char text[INET6_ADDRSTRLEN] = {0};
  if (inet_ntop(AF_INET6, gid.raw, text, sizeof(text)) == nullptr) return "?";
  return text;
}

std::string netdev_name(uint32_t ifindex) {
  if (ifindex == 0) return {};
  char name[IF_NAMESIZE] = {0};
  return if_indextoname(ifindex, name) != nullptr ? std::string(name) : std::string();
}

// /sys/class/infiniband/<dev>/device/net/<ifname>: the interfaces of the HCA's PCI function
// (IPoIB for InfiniBand), with dev_port (0-based) saying which port.
void add_sysfs_netdevs(const std::string& device, Hca& hca) {
  const std::string dir = "/sys/class/infiniband/" + device + "/device/net";
  std::unique_ptr<DIR, int (*)(DIR*)> listing(opendir(dir.c_str()), &closedir);
  if (!listing) return;
  while (const dirent* entry = readdir(listing.get())) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    int dev_port = -1;
    std::ifstream in(dir + "/" + name + "/dev_port");
    if (!(in >> dev_port)) dev_port = -1;
    for (Port& port : hca.ports) {
      if (dev_port < 0 || port.number == dev_port + 1) port.netdevs.push_back(name);
    }
  }
}

}  // namespace

std::vector<Hca> probe_rdma(std::string* error) {
  std::vector<Hca> hcas;
  int count = 0;
  errno = 0;
  ibv_device** list = ibv_get_device_list(&count);
  if (list == nullptr) {
    if (error != nullptr) {
      *error = std::string("ibv_get_device_list: ") +
               (errno != 0 ? std::strerror(errno) : "failed") +
               (errno == ENOSYS ? " (no RDMA support in this kernel or container)" : "");
    }
    return hcas;
  }
  for (int d = 0; d < count; ++d) {
    Hca hca;
    hca.name = ibv_get_device_name(list[d]);
    ibv_context* context = ibv_open_device(list[d]);
    if (context == nullptr) {
      if (error != nullptr) *error += hca.name + ": ibv_open_device failed; ";
      hcas.push_back(hca);
      continue;
    }
    ibv_device_attr device_attr{};
    const int ports = ibv_query_device(context, &device_attr) == 0 ? device_attr.phys_port_cnt : 0;
    for (int p = 1; p <= ports; ++p) {
      ibv_port_attr attr{};
      if (ibv_query_port(context, uint8_t(p), &attr) != 0) continue;
      Port port;
      port.number = p;
      port.active = attr.state == IBV_PORT_ACTIVE;
      port.state = ibv_port_state_str(attr.state);
      port.link_layer = link_layer(attr.link_layer);
      port.active_mtu = mtu_bytes(attr.active_mtu);
      port.speed_gbps = lane_gbps(attr.active_speed) * lane_count(attr.active_width);
      for (int i = 0; i < attr.gid_tbl_len; ++i) {
        ibv_gid_entry entry{};
        // Empty entries answer ENODATA; a RoCE port's table is mostly empty.
        if (ibv_query_gid_ex(context, uint32_t(p), uint32_t(i), &entry, 0) != 0) continue;
        Gid gid;
        gid.index = i;
        gid.address = gid_address(entry.gid);
        gid.type = gid_type(entry.gid_type);
        gid.netdev = netdev_name(entry.ndev_ifindex);
        port.gids.push_back(gid);
        if (port.link_layer == LinkLayer::ethernet && !gid.netdev.empty()) {
          bool known = false;
          for (const std::string& n : port.netdevs) known = known || n == gid.netdev;
          if (!known) port.netdevs.push_back(gid.netdev);
        }
      }
      hca.ports.push_back(port);
    }
    ibv_close_device(context);
    bool is_ib = false;
    for (const Port& port : hca.ports) is_ib = is_ib || port.link_layer == LinkLayer::infiniband;
    if (is_ib) add_sysfs_netdevs(hca.name, hca);
    hcas.push_back(hca);
  }
  ibv_free_device_list(list);
  return hcas;
}

}  // namespace braid::topo
