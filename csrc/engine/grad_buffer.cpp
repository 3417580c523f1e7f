#include "braid/engine/grad_buffer.h"

#include <algorithm>
#include <chrono>

#include "braid/core/error.h"
#include "braid/kernels/ops.h"

namespace braid::engine {
namespace {

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }
int64_t round_down(int64_t n, int64_t multiple) { return n / multiple * multiple; }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Parameter i's elements in the flat buffer (its shard with the vocabulary padding rows).
ElementRange elements_of(const model::ParamLayout& layout, size_t i) {
  return {layout.offsets[i], layout.offsets[i] + layout.shards[i].shape.numel()};
}

}  // namespace

void DDPConfig::validate() const {
  BRAID_CONFIG_CHECK(bucket_size >= 0, "--ddp-bucket-size must be positive, got ", bucket_size);
  BRAID_CONFIG_CHECK(!overlap_param_gather || use_distributed_optimizer,
                     "--overlap-param-gather needs --use-distributed-optimizer");
}

int64_t DDPConfig::bucket_elements(int dp) const {
  return bucket_size > 0 ? bucket_size : std::max<int64_t>(40'000'000, 1'000'000 * int64_t(dp));
}

ElementRange Bucket::shard(int dp_rank, int dp_size) const {
  const int64_t n = range.size() / dp_size;
  return {range.begin + dp_rank * n, range.begin + (dp_rank + 1) * n};
}

std::vector<Bucket> make_buckets(const model::ParamLayout& layout, int dp_size, int64_t bucket_size,
                                 bool bucketed, bool separate_embedding, bool split_experts) {
  BRAID_CHECK(dp_size >= 1 && bucket_size > 0, "make_buckets: dp ", dp_size, ", bucket size ",
              bucket_size);
  const size_t n = layout.specs.size();
  auto is_expert = [&](size_t i) { return layout.specs[i].expert >= 0; };
  // The boundary below which buckets may not reach: the separate embedding bucket's end.
  int64_t floor = 0;
  if (separate_embedding) {
    BRAID_CHECK(n > 0 && layout.specs[0].name == "model.embed_tokens.weight",
                "make_buckets: a separate embedding bucket needs embed_tokens first");
    floor = round_up(elements_of(layout, 0).end, dp_size);
  }
  const int64_t end = std::max(round_up(layout.num_elements, dp_size), floor);
  std::vector<Bucket> buckets;
  int64_t bucket_end = end;
  for (size_t i = n; i-- > 0;) {
    const int64_t start = std::max(round_down(layout.offsets[i], dp_size), floor);
    const bool last = i == 0 || start == floor;
    // Expert parallelism: parameter i starts a run of experts' parameters or of the others.
    const bool kind_changes = split_experts && i > 0 && is_expert(i) != is_expert(i - 1);
    if ((bucketed && bucket_end - start >= bucket_size && start < bucket_end) ||
        ((last || kind_changes) && start < bucket_end)) {
      const int64_t begin = last ? floor : start;
      buckets.push_back(Bucket{{begin, bucket_end}, {}, false});
      bucket_end = begin;
      if (begin == floor) break;
    }
  }
  if (separate_embedding) buckets.push_back(Bucket{{0, floor}, {}, false});
  for (Bucket& b : buckets) {
    for (size_t i = 0; i < n; ++i) {
      const ElementRange e = elements_of(layout, i);
      if (e.size() > 0 && e.begin < b.range.end && b.range.begin < e.end) b.params.push_back(i);
    }
    if (!split_experts || b.params.empty()) continue;
    const size_t first = b.params.front();
    b.expert = is_expert(first);
    for (size_t i : b.params) {
      BRAID_CONFIG_CHECK(is_expert(i) == b.expert, "expert parallelism: ", layout.specs[first].name,
                         " and ", layout.specs[i].name,
                         " share a gradient bucket, as no multiple of the buckets' shard count (",
                         dp_size, ") separates them in the flat buffer: the layout must align ",
                         "its experts to it (ModelChunk::expert_alignment)");
    }
  }
  return buckets;
}

int64_t buffer_elements(const std::vector<Bucket>& buckets) {
  int64_t end = 0;
  for (const Bucket& b : buckets) end = std::max(end, b.range.end);
  return end;
}

GradBuffer::GradBuffer(model::GPTModel& model, comm::Communicator* dp,
                       comm::Communicator* expert_dp, const DDPConfig& config,
                       std::vector<Bucket> buckets, comm::ProgressThread* progress)
    : model_(model),
      dp_(dp != nullptr && dp->size() > 1 ? dp : nullptr),
      expert_dp_(expert_dp == nullptr    ? dp_
                 : expert_dp->size() > 1 ? expert_dp
                                         : nullptr),
      config_(config),
      buckets_(std::move(buckets)),
      progress_(progress) {
  config_.validate();
  BRAID_CHECK(model_.flat_grads().numel() >= buffer_elements(buckets_), "GradBuffer: the model's ",
              "flat buffers hold ", model_.flat_grads().numel(), " elements, the buckets need ",
              buffer_elements(buckets_), " (build the model with buffer_elements)");
  for (const Bucket& b : buckets_) {
    BRAID_CHECK(b.range.size() % group_size(b) == 0, "GradBuffer: ", b.expert ? "expert " : "",
                "bucket [", b.range.begin, ", ", b.range.end, ") does not split over ",
                group_size(b), b.expert ? " expert-DP" : " DP", " ranks");
  }
  for (comm::Communicator* g : {dp_, expert_dp_}) {
    if (g == nullptr) continue;
    BRAID_CHECK(g->device() == model_.device(), "GradBuffer: the ", g == dp_ ? "DP" : "expert-DP",
                " group works on ", g->device().str(), ", the model on ", model_.device().str());
  }
  if (communicates() && model_.device().is_cuda())
    comm_stream_ = std::make_unique<SideStream>(model_.device());
  buckets_of_param_.resize(model_.parameters().size());
  for (size_t b = 0; b < buckets_.size(); ++b)
    for (size_t p : buckets_[b].params) buckets_of_param_[p].push_back(b);
  reduce_work_.resize(buckets_.size());
  bf16_grads_.resize(buckets_.size());
  for (size_t b = 0; b < buckets_.size() && config_.grad_reduce_in_bf16; ++b)
    if (group(buckets_[b]) != nullptr)  // allocated now, not at the first backward's peak
      bf16_grads_[b] = Tensor::empty({buckets_[b].range.size()}, DType::bf16, model_.device());
  gather_work_.resize(buckets_.size());
  params_pending_.assign(buckets_.size(), 0);
  if (!communicates()) return;
  if (config_.overlap_grad_reduce) {
    model_.set_grads_done_hook([this](int microbatch, std::span<const size_t> params) {
      on_grads_done(microbatch, params);
    });
  }
  if (config_.overlap_param_gather) {
    model_.set_param_use_hook([this](std::span<const size_t> params) { on_param_use(params); });
  }
}

GradBuffer::~GradBuffer() {
  model_.set_grads_done_hook(nullptr);
  model_.set_param_use_hook(nullptr);
  try {
    for (comm::WorkPtr& w : reduce_work_)
      if (w) wait(w);
    finish_param_gather();
  } catch (const std::exception&) {
    // a failed collective has already been reported by the step that posted it
  }
}

std::vector<ElementRange> GradBuffer::owned_ranges() const {
  std::vector<ElementRange> owned;
  for (auto it = buckets_.rbegin(); it != buckets_.rend(); ++it)  // ascending offsets
    owned.push_back(sharded() ? it->shard(group_rank(*it), group_size(*it)) : it->range);
  return owned;
}

void GradBuffer::start_grad_sync(int microbatches) {
  BRAID_CHECK(microbatches > 0, "GradBuffer: a step needs at least one microbatch");
  for (const comm::WorkPtr& w : reduce_work_)
    BRAID_CHECK(w == nullptr, "GradBuffer: a reduction of the previous step is still in flight");
  microbatches_ = microbatches;
  backwards_seen_.assign(model_.parameters().size(), 0);
  for (size_t b = 0; b < buckets_.size(); ++b) params_pending_[b] = int(buckets_[b].params.size());
  spans_.clear();
}

void GradBuffer::on_grads_done(int, std::span<const size_t> params) {
  for (size_t p : params) {
    if (++backwards_seen_[p] != microbatches_) continue;
    for (size_t b : buckets_of_param_[p]) {
      if (--params_pending_[b] == 0) post_reduce(b, true);
    }
  }
}

void GradBuffer::post_reduce(size_t b, bool during_backward) {
  const Bucket& bucket = buckets_[b];
  comm::Communicator* g = group(bucket);
  if (g == nullptr) return;  // an expert bucket whose experts no other rank holds
  Tensor grads = model_.flat_grads();
  Tensor whole = grads.slice(bucket.range.begin, {bucket.range.size()});
  const int64_t posted = now_ns();
  stream_wait(model_.device(), comm_stream(), Stream{});
  int64_t offset = 0;  // of the bucket in `grads`
  if (config_.grad_reduce_in_bf16) {
    ops::cast(bf16_grads_[b], whole, comm_stream());
    grads = whole = bf16_grads_[b];
    offset = bucket.range.begin;
  }
  comm::WorkPtr work;
  if (sharded()) {
    const ElementRange s = bucket.shard(g->rank(), g->size());
    work = g->reduce_scatter(whole, grads.slice(s.begin - offset, {s.size()}), comm::ReduceOp::sum,
                             comm_stream());
  } else {
    work = g->all_reduce(whole, comm::ReduceOp::sum, comm_stream());
  }
  if (progress_ != nullptr) progress_->watch(work, g->timeout());
  spans_.push_back(Span{int(b), posted, 0, during_backward});
  reduce_work_[b] = std::move(work);
}

void GradBuffer::widen_reduced(size_t b) {
  const Bucket& bucket = buckets_[b];
  const ElementRange s =
      sharded() ? bucket.shard(group_rank(bucket), group_size(bucket)) : bucket.range;
  ops::cast(model_.flat_grads().slice(s.begin, {s.size()}),
            bf16_grads_[b].slice(s.begin - bucket.range.begin, {s.size()}));
}

void GradBuffer::wait(comm::WorkPtr& work) {
  if (progress_ != nullptr) {
    progress_->wait(work);
  } else {
    work->wait();
  }
  work = nullptr;
}

void GradBuffer::finish_grad_sync() {
  if (!communicates()) return;
  for (size_t b = 0; b < buckets_.size(); ++b)
    if (reduce_work_[b] == nullptr && (params_pending_[b] > 0 || !config_.overlap_grad_reduce))
      post_reduce(b, false);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    if (reduce_work_[b] == nullptr) continue;
    wait(reduce_work_[b]);
    if (config_.grad_reduce_in_bf16) widen_reduced(b);
    for (Span& s : spans_)
      if (s.bucket == int(b)) s.done_ns = now_ns();
  }
  // Every parameter was reduced once this step; the next start_grad_sync re-arms.
  std::fill(params_pending_.begin(), params_pending_.end(), -1);
}

void GradBuffer::start_param_gather() {
  if (!communicates() || !sharded()) return;
  finish_param_gather();  // a bucket no forward read (padding only) may still be in flight
  const Tensor& params = model_.flat_params();
  stream_wait(model_.device(), comm_stream(), Stream{});
  for (size_t b = buckets_.size(); b-- > 0;) {  // first layers first: the forward's order
    const Bucket& bucket = buckets_[b];
    comm::Communicator* g = group(bucket);
    if (g == nullptr) continue;
    const ElementRange s = bucket.shard(g->rank(), g->size());
    comm::WorkPtr work =
        g->all_gather(params.slice(s.begin, {s.size()}),
                      params.slice(bucket.range.begin, {bucket.range.size()}), comm_stream());
    if (progress_ != nullptr) progress_->watch(work, g->timeout());
    gather_work_[b] = std::move(work);
  }
  if (!config_.overlap_param_gather) finish_param_gather();
}

void GradBuffer::finish_param_gather() {
  for (comm::WorkPtr& w : gather_work_)
    if (w) wait(w);
}

void GradBuffer::on_param_use(std::span<const size_t> params) {
  for (size_t p : params)
    for (size_t b : buckets_of_param_[p])
      if (gather_work_[b]) wait(gather_work_[b]);
}

}  // namespace braid::engine
