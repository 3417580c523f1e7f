#include "braid/model/expert_parallel.h"

#include <numeric>

#include "braid/kernels/ops.h"

namespace braid::model {
namespace {

// `host` i32 on `device`.
Tensor on_device(const Tensor& host, Device device) {
  return device.is_cpu() ? host : host.to(device);
}

// Every EP rank's routed rows per expert: [ep][E], from each rank's offsets.
std::vector<std::vector<int64_t>> gather_counts(const std::vector<int64_t>& offsets,
                                                const ExpertParallel& ep) {
  const int64_t experts = int64_t(offsets.size()) - 1;
  Tensor mine = Tensor::empty({experts}, DType::i64);
  for (int64_t e = 0; e < experts; ++e)
    mine.data_ptr<int64_t>()[e] = offsets[size_t(e + 1)] - offsets[size_t(e)];
  const Device dev = ep.group->device();
  Tensor all = Tensor::empty({ep.size() * experts}, DType::i64, dev);
  ep.group->all_gather(on_device(mine, dev), all)->wait();
  if (dev.is_cuda()) all = all.to(Device::cpu());
  std::vector<std::vector<int64_t>> counts(size_t(ep.size()));
  for (int r = 0; r < ep.size(); ++r) {
    const int64_t* row = all.data_ptr<int64_t>() + r * experts;
    counts[size_t(r)].assign(row, row + experts);
  }
  return counts;
}

// The all-to-all: block r of `in` (`in_rows[r]` rows) goes to EP rank r, whose block of `out`
// (`out_rows` there) it becomes. This rank's own block is a copy.
void exchange(Tensor out, const std::vector<int64_t>& out_rows, const Tensor& in,
              const std::vector<int64_t>& in_rows, const ExpertParallel& ep) {
  std::vector<comm::P2POp> ops;
  int64_t in_at = 0, out_at = 0;
  for (int r = 0; r < ep.size(); ++r) {
    const Tensor send = in.narrow(in_at, in_rows[size_t(r)]);
    Tensor recv = out.narrow(out_at, out_rows[size_t(r)]);
    if (r == ep.rank()) {
      if (send.numel() > 0) recv.copy_from(send);
    } else {
      if (send.numel() > 0) ops.push_back(comm::P2POp::send(send, r));
      if (recv.numel() > 0) ops.push_back(comm::P2POp::recv(recv, r));
    }
    in_at += in_rows[size_t(r)];
    out_at += out_rows[size_t(r)];
  }
  if (!ops.empty()) ep.group->p2p(ops)->wait();
}

}  // namespace

ModelChunk holding_experts(ModelChunk chunk, int rank, int size, int64_t num_experts) {
  if (size == 1) return chunk;
  chunk.first_expert = int(rank * num_experts / size);
  chunk.end_expert = int((rank + 1) * num_experts / size);
  return chunk;
}

ModelChunk ExpertParallel::holding(ModelChunk chunk, int64_t num_experts) const {
  chunk.whole_experts = whole_experts;
  return holding_experts(chunk, rank(), size(), num_experts);
}

void check_expert_parallel(const TransformerConfig& config, int ep) {
  BRAID_CONFIG_CHECK(ep >= 1, "--expert-model-parallel-size must be at least 1, got ", ep);
  if (ep == 1) return;
  BRAID_CONFIG_CHECK(config.num_experts > 0, "--expert-model-parallel-size ", ep,
                     " needs a mixture-of-experts model (--num-experts)");
  BRAID_CONFIG_CHECK(config.num_experts % ep == 0, "expert parallelism: --num-experts (",
                     config.num_experts, ") is not divisible by --expert-model-parallel-size (", ep,
                     ")");
}

void check_whole_experts(const ExpertParallel& ep, const TensorParallel& tp) {
  BRAID_CONFIG_CHECK(!ep.whole_experts || !tp.active() || tp.sequence_parallel,
                     "--expert-tensor-parallel-size 1 with --tensor-model-parallel-size ",
                     tp.size(),
                     " needs --sequence-parallel: each TP rank routes its own share of "
                     "the tokens through whole experts");
}

ExpertDispatch plan_dispatch(const MoeRouting& routing, const ExpertParallel& ep) {
  ExpertDispatch plan;
  if (!ep.active()) {
    plan.offsets = routing.offsets;
    return plan;
  }
  const int64_t experts = int64_t(routing.offsets.size()) - 1;
  const int64_t local = experts / ep.size(), first = ep.rank() * local;
  const std::vector<std::vector<int64_t>> counts = gather_counts(routing.offsets, ep);
  // Where source r's block starts in the arrival order, and where its rows of local expert e do.
  std::vector<int64_t> block(size_t(ep.size()) + 1, 0);
  plan.send.resize(size_t(ep.size()));
  plan.recv.resize(size_t(ep.size()));
  for (int r = 0; r < ep.size(); ++r) {
    const auto mine = counts[size_t(ep.rank())].begin() + r * local;
    plan.send[size_t(r)] = std::accumulate(mine, mine + local, int64_t{0});
    const auto theirs = counts[size_t(r)].begin() + first;
    plan.recv[size_t(r)] = std::accumulate(theirs, theirs + local, int64_t{0});
    block[size_t(r) + 1] = block[size_t(r)] + plan.recv[size_t(r)];
  }
  const int64_t m = block.back();
  // Both permutations in one host buffer, so that they reach the device in one copy.
  Tensor orders = Tensor::empty({2 * m}, DType::i32);
  int32_t* to_arrival = orders.data_ptr<int32_t>();
  int32_t* to_expert = to_arrival + m;
  plan.offsets.assign(1, 0);
  std::vector<int64_t> next(block.begin(), block.end() - 1);  // per source: its next row
  int64_t at = 0;
  for (int64_t e = 0; e < local; ++e) {
    for (int r = 0; r < ep.size(); ++r) {
      const int64_t rows = counts[size_t(r)][size_t(first + e)];
      for (int64_t j = 0; j < rows; ++j, ++at) {
        to_arrival[at] = int32_t(next[size_t(r)] + j);
        to_expert[next[size_t(r)] + j] = int32_t(at);
      }
      next[size_t(r)] += rows;
    }
    plan.offsets.push_back(at);
  }
  orders = on_device(orders, routing.row_token.device());
  plan.expert_order = orders.slice(0, {m});
  plan.arrival_order = orders.slice(m, {m});
  return plan;
}

Tensor dispatch_rows(const Tensor& rows, const ExpertDispatch& plan, const ExpertParallel& ep) {
  if (!ep.active()) return rows;
  const int64_t m = plan.rows(), c = rows.size(1);
  Tensor arrived = Tensor::empty({m, c}, rows.dtype(), rows.device());
  exchange(arrived, plan.recv, rows, plan.send, ep);
  Tensor out = Tensor::empty({m, c}, rows.dtype(), rows.device());
  if (m > 0) ops::gather_rows(out, arrived, plan.expert_order, {});
  return out;
}

void return_rows(Tensor out, const Tensor& rows, const ExpertDispatch& plan,
                 const ExpertParallel& ep) {
  if (!ep.active()) return;
  Tensor leaving = Tensor::empty(rows.shape(), rows.dtype(), rows.device());
  if (rows.size(0) > 0) ops::gather_rows(leaving, rows, plan.arrival_order, {});
  exchange(out, plan.send, leaving, plan.recv, ep);
}

}  // namespace braid::model
