#include "braid/engine/pipeline.h"

#include <map>
#include <utility>

namespace braid::engine {
namespace {

using Key = std::pair<int, int>;  // (microbatch, chunk)

Tensor take(std::map<Key, Tensor>& buffers, Key key, const char* what) {
  auto it = buffers.find(key);
  BRAID_CHECK(it != buffers.end(), "pipeline: no ", what, " for microbatch ", key.first, ", chunk ",
              key.second, " (the schedule uses it before it exists)");
  Tensor t = std::move(it->second);
  buffers.erase(it);
  return t;
}

// "send" when the exchange only sends, "recv" when it only receives, "exchange" otherwise;
// microbatch and chunk of its first op, all of them in the detail.
void record_posting(Trace& trace, const Action& a, int64_t start_ns, int virtual_stages) {
  bool sends = false, recvs = false;
  for (const P2POp& op : a.ops) {
    const bool send = op.kind == P2PKind::send_activation || op.kind == P2PKind::send_grad;
    (send ? sends : recvs) = true;
  }
  trace.end(sends && recvs ? "exchange"
            : sends        ? "send"
                           : "recv",
            "p2p", start_ns, a.ops.front().microbatch, a.ops.front().chunk,
            to_string(a, virtual_stages));
}

}  // namespace

PipelineExecutor::PipelineExecutor(Schedule schedule, std::vector<model::GPTModel*> chunks,
                                   comm::Communicator& pp)
    : schedule_(std::move(schedule)), chunks_(std::move(chunks)), pp_(pp) {
  BRAID_CONFIG_CHECK(pp_.size() == schedule_.pp, "pipeline: the schedule is for ", schedule_.pp,
                     " stages, the pipeline group has ", pp_.size(), " ranks");
  BRAID_CONFIG_CHECK(int(chunks_.size()) == schedule_.virtual_stages, "pipeline: the schedule has ",
                     schedule_.virtual_stages, " chunks per rank, ", chunks_.size(), " were given");
  const int last = schedule_.num_model_chunks() - 1;
  for (int c = 0; c < int(chunks_.size()); ++c) {
    const int model_chunk = schedule_.model_chunk(pp_.rank(), c);
    const model::ModelChunk& held = chunks_[size_t(c)]->chunk();
    BRAID_CHECK(held.embedding == (model_chunk == 0) && held.head == (model_chunk == last),
                "pipeline: chunk ", c, " of stage ", pp_.rank(), " is model chunk ", model_chunk,
                " of ", last + 1, " but its model ", held.embedding ? "holds" : "does not hold",
                " the embedding and ", held.head ? "holds" : "does not hold", " the head");
  }
}

float PipelineExecutor::run(std::span<const Tensor> ids, std::span<const Tensor> targets,
                            std::span<const float> grad_scales,
                            std::span<const int64_t> first_samples) {
  const size_t m = size_t(schedule_.microbatches);
  BRAID_CONFIG_CHECK(ids.size() == m && targets.size() == m && grad_scales.size() == m &&
                         (first_samples.empty() || first_samples.size() == m),
                     "pipeline: the schedule runs ", m, " microbatches, got ", ids.size(), " ids, ",
                     targets.size(), " targets, ", grad_scales.size(), " gradient scales and ",
                     first_samples.size(), " first samples");
  const Trace::Recording recording(trace_ != nullptr ? trace_ : Trace::current());
  std::map<Key, Tensor> inputs, outputs, grads_in, grads_out;
  double loss = 0;
  const model::GPTModel& any = *chunks_.front();
  const int64_t hidden = any.config().hidden_size;
  auto activation = [&](int microbatch) {
    return Tensor::empty({any.region_tokens(ids[size_t(microbatch)].numel()), hidden},
                         any.config().params_dtype, any.device());
  };

  for (const Action& a : schedule_.ranks[size_t(pp_.rank())]) {
    const Key key{a.microbatch, a.chunk};
    switch (a.kind) {
      case ActionKind::forward: {
        model::GPTModel& m = *chunks_[size_t(a.chunk)];
        Trace::Scope span(trace_, "forward", "compute", a.microbatch, a.chunk);
        const Tensor input = m.chunk().embedding ? Tensor() : take(inputs, key, "input activation");
        float microbatch_loss = 0;
        Tensor out =
            m.forward_stage(ids[size_t(a.microbatch)], targets[size_t(a.microbatch)], input,
                            a.microbatch, &microbatch_loss, !schedule_.forward_only,
                            first_samples.empty() ? -1 : first_samples[size_t(a.microbatch)]);
        if (m.chunk().head) {
          loss += double(grad_scales[size_t(a.microbatch)]) * microbatch_loss;
        } else {
          outputs[key] = std::move(out);
        }
        break;
      }
      case ActionKind::backward: {
        model::GPTModel& m = *chunks_[size_t(a.chunk)];
        Trace::Scope span(trace_, "backward", "compute", a.microbatch, a.chunk);
        const Tensor dout = m.chunk().head ? Tensor() : take(grads_in, key, "output gradient");
        Tensor din = m.backward_stage(dout, a.microbatch, grad_scales[size_t(a.microbatch)]);
        if (!m.chunk().embedding) grads_out[key] = std::move(din);
        break;
      }
      case ActionKind::exchange: {
        const int64_t posted = trace_ ? trace_->now_ns() : 0;
        std::vector<comm::P2POp> ops;
        for (const P2POp& op : a.ops) {
          const Key k{op.microbatch, op.chunk};
          switch (op.kind) {
            case P2PKind::send_activation:
              ops.push_back(comm::P2POp::send(take(outputs, k, "output activation"), op.peer));
              break;
            case P2PKind::recv_activation:
              inputs[k] = activation(op.microbatch);
              ops.push_back(comm::P2POp::recv(inputs[k], op.peer));
              break;
            case P2PKind::send_grad:
              ops.push_back(comm::P2POp::send(take(grads_out, k, "input gradient"), op.peer));
              break;
            case P2PKind::recv_grad:
              grads_in[k] = activation(op.microbatch);
              ops.push_back(comm::P2POp::recv(grads_in[k], op.peer));
              break;
          }
        }
        comm::WorkPtr work = pp_.p2p(ops);
        if (trace_) record_posting(*trace_, a, posted, schedule_.virtual_stages);
        Trace::Scope wait(trace_, "wait", "p2p", a.ops.front().microbatch, a.ops.front().chunk);
        work->wait();
        break;
      }
    }
  }
  return float(loss);
}

}  // namespace braid::engine
