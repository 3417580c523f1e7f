// braid-topo's NCCL suggestions (tools/braid_topo/suggest.cpp) on synthetic nodes: InfiniBand,
// RoCE with v1/v2 GIDs, down ports, several HCAs that disagree, mixed link layers, nothing.

#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "topo.h"

namespace braid::topo {
namespace {

std::map<std::string, std::string> env_of(const NcclSuggestion& s) {
  return {s.env.begin(), s.env.end()};
}

bool any_note_has(const NcclSuggestion& s, const std::string& text) {
  return std::any_of(s.notes.begin(), s.notes.end(),
                     [&](const std::string& n) { return n.find(text) != std::string::npos; });
}

Port ib_port(int number, bool active, std::vector<std::string> netdevs = {}) {
  Port p;
  p.number = number;
  p.active = active;
  p.state = active ? "PORT_ACTIVE" : "PORT_DOWN";
  p.link_layer = LinkLayer::infiniband;
  p.active_mtu = 4096;
  p.speed_gbps = 200;
  p.gids = {{0, "fe80::1", GidType::ib, ""}};
  p.netdevs = std::move(netdevs);
  return p;
}

// The table mlx5 drivers build for an interface with an IPv6 link-local and an IPv4 address:
// each address once as RoCE v1 and once as RoCE v2, starting at `first`.
Port roce_port(int number, const std::string& netdev, const std::string& ipv4, int first = 0) {
  Port p;
  p.number = number;
  p.active = true;
  p.state = "PORT_ACTIVE";
  p.link_layer = LinkLayer::ethernet;
  p.active_mtu = 4096;
  p.speed_gbps = 100;
  p.gids = {{first + 0, "fe80::a288:c2ff:fe3b:506a", GidType::roce_v1, netdev},
            {first + 1, "fe80::a288:c2ff:fe3b:506a", GidType::roce_v2, netdev}};
  if (!ipv4.empty()) {
    p.gids.push_back({first + 2, "::ffff:" + ipv4, GidType::roce_v1, netdev});
    p.gids.push_back({first + 3, "::ffff:" + ipv4, GidType::roce_v2, netdev});
  }
  p.netdevs = {netdev};
  return p;
}

TEST(NcclTopo, Ipv4MappedGids) {
  EXPECT_TRUE(is_ipv4_mapped("::ffff:10.0.0.1"));
  EXPECT_FALSE(is_ipv4_mapped("fe80::ffff:1"));
  EXPECT_FALSE(is_ipv4_mapped("::ffff:a00:1"));  // not written as IPv4
  EXPECT_FALSE(is_ipv4_mapped("::ffff:"));
}

TEST(NcclTopo, PortSpeedFromCodes) {
  EXPECT_DOUBLE_EQ(lane_gbps(32) * lane_count(2), 100.0);   // EDR 4x
  EXPECT_DOUBLE_EQ(lane_gbps(64) * lane_count(2), 200.0);   // HDR 4x
  EXPECT_DOUBLE_EQ(lane_gbps(128) * lane_count(2), 400.0);  // NDR 4x
  EXPECT_DOUBLE_EQ(lane_gbps(32) * lane_count(1), 25.0);    // 25GbE seen as EDR 1x
  EXPECT_EQ(lane_gbps(3), 0.0);
  EXPECT_EQ(lane_count(3), 0);
}

TEST(NcclTopo, NoDevices) {
  const NcclSuggestion s = suggest_nccl_env({});
  EXPECT_TRUE(s.env.empty());
  EXPECT_TRUE(any_note_has(s, "no RDMA devices"));
}

TEST(NcclTopo, InfiniBandHcasWithIpoib) {
  const std::vector<Hca> hcas = {{"mlx5_0", {ib_port(1, true, {"ib0"})}},
                                 {"mlx5_1", {ib_port(1, true, {"ib1"})}}};
  const NcclSuggestion s = suggest_nccl_env(hcas);
  const auto env = env_of(s);
  EXPECT_EQ(env.at("NCCL_IB_HCA"), "=mlx5_0:1,mlx5_1:1");
  EXPECT_EQ(env.count("NCCL_IB_GID_INDEX"), 0u);  // InfiniBand routes by LID, not GID
  EXPECT_EQ(env.at("NCCL_SOCKET_IFNAME"), "=ib0,ib1");
  EXPECT_EQ(env.at("OMPI_MCA_btl_tcp_if_include"), "ib0,ib1");
  EXPECT_EQ(env.at("OMPI_MCA_oob_tcp_if_include"), "ib0,ib1");
  EXPECT_EQ(s.env.front().first, "NCCL_IB_HCA");
}

TEST(NcclTopo, InfiniBandWithoutIpoibAsksForAnInterface) {
  const NcclSuggestion s = suggest_nccl_env({{"mlx5_0", {ib_port(1, true)}}});
  const auto env = env_of(s);
  EXPECT_EQ(env.at("NCCL_IB_HCA"), "=mlx5_0:1");
  EXPECT_EQ(env.count("NCCL_SOCKET_IFNAME"), 0u);
  EXPECT_TRUE(any_note_has(s, "NCCL_SOCKET_IFNAME"));
}

TEST(NcclTopo, RoceTakesTheV2Ipv4Gid) {
  const NcclSuggestion s = suggest_nccl_env({{"mlx5_0", {roce_port(1, "ens1f0", "10.0.0.1")}}});
  const auto env = env_of(s);
  EXPECT_EQ(env.at("NCCL_IB_HCA"), "=mlx5_0:1");
  EXPECT_EQ(env.at("NCCL_IB_GID_INDEX"), "3");  // not 2 (v1) nor 1 (v2, link-local)
  EXPECT_EQ(env.at("NCCL_SOCKET_IFNAME"), "=ens1f0");
  EXPECT_EQ(env.at("OMPI_MCA_btl_tcp_if_include"), "ens1f0");
  EXPECT_TRUE(s.notes.empty());
}

TEST(NcclTopo, RoceOnlyV1GidsGetsNoIndex) {
  Port p = roce_port(1, "ens1f0", "10.0.0.1");
  for (Gid& g : p.gids) g.type = GidType::roce_v1;
  const NcclSuggestion s = suggest_nccl_env({{"mlx5_0", {p}}});
  const auto env = env_of(s);
  EXPECT_EQ(env.count("NCCL_IB_GID_INDEX"), 0u);
  EXPECT_TRUE(any_note_has(s, "no RoCE v2 GID with an IPv4 address on mlx5_0:1"));
}

TEST(NcclTopo, RoceWithoutIpv4GetsNoIndex) {
  const NcclSuggestion s = suggest_nccl_env({{"mlx5_0", {roce_port(1, "ens1f0", "")}}});
  const auto env = env_of(s);
  EXPECT_EQ(env.at("NCCL_IB_HCA"), "=mlx5_0:1");
  EXPECT_EQ(env.count("NCCL_IB_GID_INDEX"), 0u);
  EXPECT_EQ(env.count("NCCL_SOCKET_IFNAME"), 0u);
  EXPECT_TRUE(any_note_has(s, "IPv4 address"));
}

TEST(NcclTopo, DownPortsAreLeftOut) {
  Port down = roce_port(2, "ens1f1", "10.0.1.1");
  down.active = false;
  down.state = "PORT_DOWN";
  const NcclSuggestion s =
      suggest_nccl_env({{"mlx5_0", {roce_port(1, "ens1f0", "10.0.0.1"), down}}});
  const auto env = env_of(s);
  EXPECT_EQ(env.at("NCCL_IB_HCA"), "=mlx5_0:1");
  EXPECT_EQ(env.at("NCCL_SOCKET_IFNAME"), "=ens1f0");
  EXPECT_TRUE(any_note_has(s, "mlx5_0:2 (PORT_DOWN)"));
}

TEST(NcclTopo, AllPortsDown) {
  const NcclSuggestion s = suggest_nccl_env({{"mlx5_0", {ib_port(1, false)}}});
  EXPECT_TRUE(s.env.empty());
  EXPECT_TRUE(any_note_has(s, "no active RDMA port"));
}

TEST(NcclTopo, SeveralRoceHcasShareOneIndex) {
  std::vector<Hca> hcas;
  for (int i = 0; i < 4; ++i) {
    hcas.push_back({"mlx5_" + std::to_string(i),
                    {roce_port(1, "gpu" + std::to_string(i) + "_eth",
                               "10.200." + std::to_string(i) + ".10")}});
  }
  const auto env = env_of(suggest_nccl_env(hcas));
  EXPECT_EQ(env.at("NCCL_IB_HCA"), "=mlx5_0:1,mlx5_1:1,mlx5_2:1,mlx5_3:1");
  EXPECT_EQ(env.at("NCCL_IB_GID_INDEX"), "3");
  EXPECT_EQ(env.at("NCCL_SOCKET_IFNAME"), "=gpu0_eth,gpu1_eth,gpu2_eth,gpu3_eth");
}

TEST(NcclTopo, DisagreeingGidIndexesTakeTheMostCommon) {
  // mlx5_2's table has two extra entries first (e.g. a second IPv6 address): its IPv4 v2 GID
  // sits at 5. The majority's 3 wins; the odd one out is named, and left out of the interfaces.
  const std::vector<Hca> hcas = {{"mlx5_0", {roce_port(1, "eth0", "10.0.0.1")}},
                                 {"mlx5_1", {roce_port(1, "eth1", "10.0.1.1")}},
                                 {"mlx5_2", {roce_port(1, "eth2", "10.0.2.1", 2)}}};
  const NcclSuggestion s = suggest_nccl_env(hcas);
  const auto env = env_of(s);
  EXPECT_EQ(env.at("NCCL_IB_GID_INDEX"), "3");
  EXPECT_EQ(env.at("NCCL_SOCKET_IFNAME"), "=eth0,eth1");
  EXPECT_TRUE(any_note_has(s, "index 5 on mlx5_2:1"));
}

TEST(NcclTopo, InfiniBandPreferredOverRoce) {
  const std::vector<Hca> hcas = {{"mlx5_0", {ib_port(1, true, {"ib0"})}},
                                 {"mlx5_1", {roce_port(1, "ens2f0", "10.0.0.1")}}};
  const NcclSuggestion s = suggest_nccl_env(hcas);
  const auto env = env_of(s);
  EXPECT_EQ(env.at("NCCL_IB_HCA"), "=mlx5_0:1");
  EXPECT_EQ(env.count("NCCL_IB_GID_INDEX"), 0u);
  EXPECT_EQ(env.at("NCCL_SOCKET_IFNAME"), "=ib0");
  EXPECT_TRUE(any_note_has(s, "Ethernet (RoCE) ports left out: mlx5_1:1"));
}

}  // namespace
}  // namespace braid::topo
