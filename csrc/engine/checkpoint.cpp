#include "braid/engine/checkpoint.h"

#include <algorithm>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "braid/ckpt/atomic_dir.h"
#include "braid/ckpt/safetensors.h"
#include "braid/kernels/ops.h"
#include "braid/model/moe.h"
#include "engine/checkpoint_config.h"
#include "engine/checkpoint_index.h"

namespace braid::engine {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kTracker = "latest_checkpointed_iteration.txt";
constexpr const char* kMetadata = "metadata.json";

// ---- optimizer state -------------------------------------------------------------------------

// A chunk's optimizer state over its whole flat buffer (f32, on the model's device): ZeRO's
// shards all-gathered over each bucket's group - DP × CP, or expert DP for the experts' buckets
// (collective there) - else this rank's own.
struct ChunkState {
  Tensor exp_avg, exp_avg_sq, master;  // master undefined for f32 parameters
};

ChunkState gather_state(Trainer& trainer, int c) {
  const ParallelModel& model = trainer.model();
  const model::GPTModel& m = model.chunk(c);
  const GradBuffer& buffer = model.grad_buffer(c);
  const int64_t n = m.flat_params().numel();
  const bool bf16 = m.flat_params().dtype() != DType::f32;
  ChunkState full{Tensor::zeros({n}, DType::f32, m.device()),
                  Tensor::zeros({n}, DType::f32, m.device()),
                  bf16 ? Tensor::zeros({n}, DType::f32, m.device()) : Tensor()};
  std::vector<const AdamW::Segment*> segments;
  for (const AdamW::Segment& s : trainer.optimizer().segments())
    if (s.chunk == c) segments.push_back(&s);
  for (const Bucket& bucket : buffer.buckets()) {
    const bool sharded = buffer.sharded() && buffer.group_size(bucket) > 1;
    const ElementRange owned =
        sharded ? bucket.shard(buffer.group_rank(bucket), buffer.group_size(bucket)) : bucket.range;
    auto it = std::find_if(segments.begin(), segments.end(), [&](const AdamW::Segment* s) {
      return s->range.begin == owned.begin && s->range.end == owned.end;
    });
    BRAID_CHECK(it != segments.end(), "checkpoint: no optimizer segment for [", owned.begin, ", ",
                owned.end, ") of chunk ", c);
    const AdamW::Segment& seg = **it;
    const int64_t begin = bucket.range.begin, size = bucket.range.size();
    auto place = [&](const Tensor& part, Tensor& whole) {
      if (sharded) {
        buffer.group(bucket)->all_gather(part, whole.slice(begin, {size}))->wait();
      } else {
        whole.slice(begin, {size}).copy_from(part);
      }
    };
    place(seg.exp_avg, full.exp_avg);
    place(seg.exp_avg_sq, full.exp_avg_sq);
    if (bf16) place(seg.master, full.master);
  }
  return full;
}

// ---- files -----------------------------------------------------------------------------------

Tensor host_f32(const Tensor& t) {
  Tensor host = t.device().is_cpu() ? t : t.to(Device::cpu());
  if (host.dtype() == DType::f32) return host;
  Tensor f = Tensor::empty(host.shape(), DType::f32);
  ops::cast(f, host);
  return f;
}

// Runs `body` on every rank; if it throws on any, every rank throws (its own error, or one
// saying another rank failed), so no rank goes on to a collective the others never reach.
template <typename Body>
void on_every_rank(const ParallelModel& model, const char* what, Body&& body) {
  std::exception_ptr error;
  try {
    body();
  } catch (...) {
    error = std::current_exception();
  }
  const comm::ParallelState* state = model.state();
  if (state != nullptr && state->world().size() > 1) {
    Tensor flag = Tensor::empty({1}, DType::i32);
    flag.data_ptr<int32_t>()[0] = error ? 1 : 0;
    Tensor on_device = flag.to(state->world().device());
    state->world().all_reduce(on_device, comm::ReduceOp::max)->wait();
    BRAID_CONFIG_CHECK(error || on_device.to(Device::cpu()).data_ptr<int32_t>()[0] == 0, what,
                       " failed on another rank (its message says why)");
  }
  if (error) std::rethrow_exception(error);
}

void barrier(const ParallelModel& model) {
  if (model.state() != nullptr) model.state()->world().barrier()->wait();
}

// A save's id: 16 random hex digits, in metadata.json ("save_id") and in every file the save
// writes (its safetensors metadata "braid.save_id"), so that a load can tell a file of another
// save (another run, or another save of this iteration) that was copied in.
constexpr const char* kSaveIdKey = "braid.save_id";

std::string new_save_id() {
  std::random_device device;
  const uint64_t id = (uint64_t(device()) << 32) ^ uint64_t(device());
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(id));
  return text;
}

// `text` from world rank 0 on every rank.
std::string broadcast_string(const ParallelModel& model, const std::string& text) {
  const comm::ParallelState* state = model.state();
  if (state == nullptr || state->world().size() == 1) return text;
  comm::Communicator& world = state->world();
  Tensor size = Tensor::empty({1}, DType::i64);
  size.data_ptr<int64_t>()[0] = int64_t(text.size());
  Tensor on_device = size.to(world.device());
  world.broadcast(on_device, 0)->wait();
  const int64_t n = on_device.to(Device::cpu()).data_ptr<int64_t>()[0];
  Tensor bytes = Tensor::zeros({std::max<int64_t>(n, 1)}, DType::i32);
  for (int64_t i = 0; i < int64_t(text.size()); ++i)
    bytes.data_ptr<int32_t>()[i] = static_cast<unsigned char>(text[size_t(i)]);
  on_device = bytes.to(world.device());
  world.broadcast(on_device, 0)->wait();
  const Tensor host = on_device.to(Device::cpu());
  std::string out(size_t(n), '\0');
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = char(host.data_ptr<int32_t>()[i]);
  return out;
}

int world_rank(const ParallelModel& model) {
  return model.state() != nullptr ? model.state()->rank() : 0;
}

json read_json(const fs::path& path) {
  std::ifstream in(path);
  BRAID_CONFIG_CHECK(in.good(), "checkpoint: cannot read ", path.string());
  json parsed;
  try {
    parsed = json::parse(in);
  } catch (const json::exception& e) {
    BRAID_CONFIG_CHECK(false, "checkpoint: ", path.string(), " is not valid JSON: ", e.what());
  }
  BRAID_CONFIG_CHECK(parsed.is_object(), "checkpoint: ", path.string(), " holds ",
                     parsed.type_name(), ", not a JSON object");
  return parsed;
}

}  // namespace

std::string iteration_directory(const std::string& dir, int64_t iteration) {
  char name[32];
  std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(iteration));
  return (fs::path(dir) / name).string();
}

int64_t latest_iteration(const std::string& dir) {
  const fs::path tracker = fs::path(dir) / kTracker;
  if (!fs::exists(tracker)) return -1;
  std::ifstream in(tracker);
  std::string text;
  in >> text;
  int64_t iteration = -1;
  const char* last = text.data() + text.size();
  const auto [end, error] = std::from_chars(text.data(), last, iteration);
  BRAID_CONFIG_CHECK(!text.empty() && error == std::errc() && end == last && iteration >= 0,
                     "checkpoint: ", tracker.string(),
                     " should hold an iteration number (0 to 2^63 - 1), holds '", text, "'");
  return iteration;
}

// One save from prepare() to commit(): what each rank writes, and (rank 0) the staging
// directory and the metadata.
struct CheckpointSaver::Pending {
  int64_t iteration = 0;
  fs::path dir, final_dir, tmp_dir;
  std::unique_ptr<ckpt::AtomicDirectory> staging;  // rank 0
  std::unique_ptr<ckpt::SafetensorsWriter> file;   // writers (save): experts' and the rest's
  fs::path file_path;
  std::string metadata;  // rank 0
  std::thread thread;    // async: writes the files
  std::atomic<bool> written{false};
  std::exception_ptr error;

  void write() {
    try {
      if (file) file->write(file_path.string());
      if (staging) ckpt::write_file(tmp_dir / kMetadata, metadata);
    } catch (...) {
      error = std::current_exception();
    }
    written = true;
  }
};

CheckpointSaver::CheckpointSaver(std::string dir, bool async)
    : dir_(std::move(dir)), async_(async) {}

CheckpointSaver::~CheckpointSaver() {
  if (pending_ && pending_->thread.joinable()) pending_->thread.join();  // never left running
}

std::string CheckpointSaver::save(Trainer& trainer, const LoopState& loop,
                                  const SaveOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  if (pending_) wait(trainer.model());  // one save in flight at a time
  ParallelModel& model = trainer.model();
  model.finish_param_gather();
  const comm::ParallelState* state = model.state();
  // Expert-DP rank 0 of each (tp, pp, ep) position (of each (pp, ep) one with whole experts)
  // writes its experts; the rank with DP and CP rank 0 of each (tp, pp) the rest (EP rank 0
  // when the experts are split over TP, so one of the former). Without EP these are one rank.
  const bool expert_writer = state == nullptr || state->expert_dp_rank() == 0;
  const bool dense_writer = state == nullptr || (state->dp_rank() == 0 && state->cp_rank() == 0);
  const bool writer = expert_writer || dense_writer;
  const bool root = world_rank(model) == 0;
  auto pending = std::make_unique<Pending>();
  Pending& p = *pending;
  p.iteration = trainer.iteration();
  p.dir = dir_;
  p.final_dir = iteration_directory(dir_, p.iteration);

  // Rank 0 opens the temporary directory every rank writes into and draws the save's id.
  std::string tmp_name, save_id;
  on_every_rank(model, "saving the checkpoint", [&] {
    if (!root) return;
    fs::create_directories(dir_);
    ckpt::remove_stale_temporaries(dir_);  // left by a save that died
    p.staging = std::make_unique<ckpt::AtomicDirectory>(p.final_dir,
                                                        ckpt::AtomicDirectory::Existing::replace);
    tmp_name = p.staging->path().string();
    save_id = new_save_id();
    json meta = checkpoint_metadata(trainer, loop, options);
    meta["save_id"] = save_id;
    p.metadata = meta.dump(1) + "\n";
  });
  p.tmp_dir = broadcast_string(model, tmp_name);
  save_id = broadcast_string(model, save_id);

  // The chunks' optimizer state, gathered over (expert) DP (collective: every rank, writer or
  // not).
  std::vector<ChunkState> states;
  if (options.save_optim)
    for (int c = 0; c < model.num_chunks(); ++c) states.push_back(gather_state(trainer, c));

  if (writer) {
    // Async: host copies, so training may change the originals while the thread writes.
    auto keep = [&](const Tensor& t) {
      if (!async_) return t;
      return t.device().is_cpu() ? t.clone() : t.to(Device::cpu());
    };
    p.file = std::make_unique<ckpt::SafetensorsWriter>();
    p.file->set_metadata(kSaveIdKey, save_id);
    p.file->record_checksums();  // each tensor's CRC-32C, checked by every load that reads it
    const int tp_rank = state != nullptr ? state->tp_rank() : 0;
    const int pp_rank = state != nullptr ? state->pp_rank() : 0;
    const int ep_rank = state != nullptr ? state->ep_rank() : 0;
    const int ep = state != nullptr ? state->grid().ep() : 1;
    p.file_path = p.tmp_dir / file_name(tp_rank, pp_rank, ep_rank, ep);
    for (int c = 0; c < model.num_chunks(); ++c) {
      const model::GPTModel& m = model.chunk(c);
      const model::ParamLayout& layout = m.layout();
      if (tp_rank == 0 && dense_writer)
        for (const auto& [name, bias] : m.expert_biases()) p.file->add(name, keep(bias));
      for (const Slice& s : stored_slices(layout)) {
        const model::Parameter& param = m.parameters()[s.param];
        if (!(param.spec.expert >= 0 ? expert_writer : dense_writer)) continue;
        const std::string& name = param.spec.name;
        p.file->add(name, keep(param.value));
        if (!options.save_optim) continue;
        const int64_t at = layout.offsets[s.param];
        const Shape shape = param.value.shape();
        const ChunkState& st = states[size_t(c)];
        p.file->add("optimizer.exp_avg." + name, keep(st.exp_avg.slice(at, shape)));
        p.file->add("optimizer.exp_avg_sq." + name, keep(st.exp_avg_sq.slice(at, shape)));
        if (st.master.defined())
          p.file->add("optimizer.master." + name, keep(st.master.slice(at, shape)));
      }
    }
  }
  pending_ = std::move(pending);
  const std::string path = p.final_dir.string();
  if (async_) {
    p.thread = std::thread([&p] { p.write(); });
  } else {
    p.write();
    commit(model);
  }
  last_blocked_seconds_ =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return path;
}

bool CheckpointSaver::poll(const ParallelModel& model) {
  if (!pending_) return false;
  // Every rank must agree that every file is written: one small all-reduce.
  int32_t done = pending_->written ? 1 : 0;
  if (const comm::ParallelState* state = model.state();
      state != nullptr && state->world().size() > 1) {
    Tensor flag = Tensor::empty({1}, DType::i32);
    flag.data_ptr<int32_t>()[0] = done;
    Tensor on_device = flag.to(state->world().device());
    state->world().all_reduce(on_device, comm::ReduceOp::min)->wait();
    done = on_device.to(Device::cpu()).data_ptr<int32_t>()[0];
  }
  if (!done) return false;
  commit(model);
  return true;
}

void CheckpointSaver::wait(const ParallelModel& model) {
  if (!pending_) return;
  if (pending_->thread.joinable()) pending_->thread.join();
  commit(model);
}

void CheckpointSaver::commit(const ParallelModel& model) {
  std::unique_ptr<Pending> p = std::move(pending_);
  if (p->thread.joinable()) p->thread.join();
  on_every_rank(model, "saving the checkpoint", [&] {
    if (p->error) std::rethrow_exception(p->error);
  });
  barrier(model);  // every file is written and fsynced
  on_every_rank(model, "saving the checkpoint", [&] {
    if (!p->staging) return;
    p->staging->commit();  // fsyncs everything, renames into place (replacing a re-save)
    ckpt::replace_file_atomically(p->dir / kTracker, std::to_string(p->iteration) + "\n");
  });
  barrier(model);
  last_committed_ = p->iteration;
}

std::string save_checkpoint(const std::string& dir, Trainer& trainer, const LoopState& loop,
                            const SaveOptions& options) {
  CheckpointSaver saver(dir, false);
  return saver.save(trainer, loop, options);
}

namespace {

// Reads the saved pieces of one tensor that overlap [start, start + length) along split_dim
// (the whole tensor when replicated) into `dst` (host f32 of that slice's shape). Every file
// must be of the save metadata.json names (save_id; none to check in checkpoints from before
// it, or written by the converters), and every piece read must match its CRC-32C where the
// file records one.
class CheckpointReader {
 public:
  CheckpointReader(fs::path dir, const json& tensors, std::string save_id)
      : dir_(std::move(dir)), tensors_(tensors), save_id_(std::move(save_id)) {}

  bool has(const std::string& key) const { return tensors_.contains(key); }

  void read(const std::string& key, const Shape& global, int split_dim, int64_t start,
            int64_t length, Tensor& dst) {
    BRAID_CONFIG_CHECK(tensors_.contains(key), "checkpoint ", dir_.string(), " has no tensor ",
                       key);
    const json& entry = tensors_.at(key);
    const std::vector<int64_t> saved_shape = entry.at("shape").get<std::vector<int64_t>>();
    BRAID_CONFIG_CHECK(Shape(std::span<const int64_t>(saved_shape)) == global, "checkpoint ",
                       dir_.string(), ": ", key, " is ",
                       Shape(std::span<const int64_t>(saved_shape)), " there but ", global,
                       " in this model's config");
    const int64_t rows = global[0], cols = global.dim() > 1 ? global[1] : 1;
    const int saved_dim = entry.at("split_dim").get<int>();
    int64_t covered = 0;
    for (const json& shard : entry.at("shards")) {
      const int64_t s_start = shard.at("start").get<int64_t>();
      const int64_t s_len = shard.at("length").get<int64_t>();
      const std::string file = shard.at("file").get<std::string>();
      // Both slices as [row0, row1) × [col0, col1) of the global tensor.
      auto box = [&](int d, int64_t a, int64_t n) {
        return std::array<int64_t, 4>{d == 0 ? a : 0, d == 0 ? a + n : rows, d == 1 ? a : 0,
                                      d == 1 ? a + n : cols};
      };
      const auto want = box(split_dim, start, length);
      const auto have = box(saved_dim, s_start, s_len);
      const int64_t r0 = std::max(want[0], have[0]), r1 = std::min(want[1], have[1]);
      const int64_t c0 = std::max(want[2], have[2]), c1 = std::min(want[3], have[3]);
      if (r0 >= r1 || c0 >= c1) continue;
      const Tensor src = tensor(file, key, Shape{have[1] - have[0], have[3] - have[2]});
      const float* in = src.data_ptr<float>();
      float* out = dst.data_ptr<float>();
      const int64_t in_cols = have[3] - have[2], out_cols = want[3] - want[2];
      for (int64_t r = r0; r < r1; ++r) {
        std::memcpy(out + (r - want[0]) * out_cols + (c0 - want[2]),
                    in + (r - have[0]) * in_cols + (c0 - have[2]), size_t(c1 - c0) * sizeof(float));
      }
      covered += (r1 - r0) * (c1 - c0);
    }
    BRAID_CONFIG_CHECK(covered == dst.numel(), "checkpoint ", dir_.string(), ": the shards of ",
                       key, " cover ", covered, " of the ", dst.numel(),
                       " elements this rank needs");
  }

 private:
  // The saved piece `key` of `file` as host f32 [rows, cols].
  Tensor tensor(const std::string& file, const std::string& key, const Shape& rows_cols) {
    auto it = files_.find(file);
    if (it == files_.end()) {
      it = files_.emplace(file, ckpt::SafetensorsFile::open((dir_ / file).string())).first;
      if (!save_id_.empty()) {
        const auto& saved = it->second.metadata();
        const auto id = saved.find(kSaveIdKey);
        const std::string its = id == saved.end() ? "none" : id->second;
        BRAID_CONFIG_CHECK(its == save_id_, "checkpoint ", (dir_ / file).string(),
                           " was written by another save (its save id ", its, ", ", kMetadata,
                           "'s ", save_id_,
                           "): the directory mixes the files of two checkpoints; put back the "
                           "file this save wrote");
      }
    }
    const ckpt::SafetensorsFile& f = it->second;
    if (checked_.insert({file, key}).second) f.check_checksum(key);
    Tensor t = host_f32(f.view(key));
    BRAID_CONFIG_CHECK(t.numel() == rows_cols.numel(), "checkpoint ", (dir_ / file).string(), ": ",
                       key, " holds ", t.shape(), ", the index says ", rows_cols);
    return t.view(rows_cols);
  }

  fs::path dir_;
  const json& tensors_;
  std::string save_id_;
  std::map<std::string, ckpt::SafetensorsFile> files_;
  std::set<std::pair<std::string, std::string>> checked_;  // (file, tensor) checksums checked
};

}  // namespace

namespace {

// load_checkpoint's work; trainer null: the parameters only (load_parameters).
LoopState load_into(const std::string& dir, ParallelModel& model, Trainer* trainer,
                    const LoadOptions& options) {
  model.finish_param_gather();
  LoopState loop;
  loop.consumed_samples = 0;  // --finetune and load_parameters: from the start
  auto load = [&] {
    const int64_t iteration = options.iteration >= 0 ? options.iteration : latest_iteration(dir);
    BRAID_CONFIG_CHECK(iteration >= 0, "checkpoint: no ", kTracker, " in ", dir,
                       " (nothing saved there yet)");
    const fs::path path = iteration_directory(dir, iteration);
    BRAID_CONFIG_CHECK(fs::is_directory(path), "checkpoint: ", path.string(), " does not exist");
    const json meta = read_json(path / kMetadata);
    const std::string where = (path / kMetadata).string();
    BRAID_CONFIG_CHECK(meta.value("format", "") == "braid-checkpoint", where,
                       ": not a braid checkpoint");
    const int version = meta.at("format_version").get<int>();
    BRAID_CONFIG_CHECK(version <= kCheckpointFormatVersion, where, ": format version ", version,
                       " is newer than this braid reads (", kCheckpointFormatVersion,
                       "); update braid");
    check_same_model(meta.at("config"), model.config(), where);
    const bool with_optim = trainer != nullptr && options.load_optim && !options.finetune;
    BRAID_CONFIG_CHECK(!with_optim || meta.at("optimizer").get<bool>(), where,
                       ": saved without optimizer state; load with --no-load-optim or --finetune");
    // Resuming mid-run without the dropout seed might not continue the masks (Megatron refuses
    // too); at iteration 0 (a converted model) the fresh state is the saved one.
    const bool with_rng = trainer != nullptr && options.load_rng && !options.finetune;
    BRAID_CONFIG_CHECK(
        !with_rng || meta.contains("rng") || meta.at("iteration").get<int64_t>() == 0, where,
        ": saved without RNG state at iteration ", meta.at("iteration").get<int64_t>(),
        "; load with --no-load-rng (the dropout masks take this run's --seed) or --finetune");
    CheckpointReader reader(path, meta.at("tensors"), meta.value("save_id", ""));
    const bool master_saved =
        !meta.at("tensors").empty() &&
        reader.has("optimizer.master." + model.chunk(0).parameters().front().spec.name);

    for (int c = 0; c < model.num_chunks(); ++c) {
      model::GPTModel& m = model.chunk(c);
      const model::ParamLayout& layout = m.layout();
      const int64_t n = m.flat_params().numel();
      // The chunk's values and (with the optimizer) state over its whole buffer, host f32.
      Tensor values = Tensor::zeros({n}, DType::f32);
      Tensor exp_avg, exp_avg_sq;
      if (with_optim) {
        exp_avg = Tensor::zeros({n}, DType::f32);
        exp_avg_sq = Tensor::zeros({n}, DType::f32);
      }
      for (size_t i = 0; i < layout.specs.size(); ++i) {
        const model::ParamSpec& spec = layout.specs[i];
        const model::ParamShard& shard = layout.shards[i];
        const Shape valid = shard.valid_shape();
        if (valid.numel() == 0) continue;
        const int dim = spec.tp_dim >= 0 && layout.tp_size > 1 && shard.replicas < layout.tp_size
                            ? spec.tp_dim
                            : -1;
        const int64_t start = dim >= 0 ? shard.start : 0;
        const int64_t length = dim >= 0 ? valid[dim] : spec.shape[0];
        Tensor dst = values.slice(layout.offsets[i], valid);
        const bool use_master = master_saved && m.flat_params().dtype() == DType::f32;
        const std::string key = use_master ? "optimizer.master." + spec.name : spec.name;
        // Before format 7 a router had no bias even with add_bias_linear: it loads as a bias of
        // zeros (the same router) with fresh moments.
        if (version < 7 && spec.name.ends_with(".mlp.gate.bias") && !reader.has(key)) continue;
        reader.read(key, spec.shape, dim, start, length, dst);
        if (!with_optim) continue;
        Tensor m1 = exp_avg.slice(layout.offsets[i], valid);
        Tensor m2 = exp_avg_sq.slice(layout.offsets[i], valid);
        reader.read("optimizer.exp_avg." + spec.name, spec.shape, dim, start, length, m1);
        reader.read("optimizer.exp_avg_sq." + spec.name, spec.shape, dim, start, length, m2);
        if (master_saved && m.flat_params().dtype() != DType::f32) {
          reader.read("optimizer.master." + spec.name, spec.shape, dim, start, length, dst);
        }
      }
      // Parameters (rounded to their dtype), then this rank's optimizer segments.
      ops::cast(m.flat_params(), values.to(m.device()));
      for (const auto& [name, bias] : m.expert_biases()) {
        Tensor host = Tensor::empty(bias.shape(), DType::f32);
        reader.read(name, bias.shape(), -1, 0, bias.size(0), host);
        Tensor(bias).copy_from(host.to(m.device()));
      }
      if (!with_optim) continue;
      for (const AdamW::Segment& seg : trainer->optimizer().segments()) {
        if (seg.chunk != c) continue;
        const int64_t b = seg.range.begin, size = seg.range.size();
        const_cast<Tensor&>(seg.exp_avg).copy_from(exp_avg.slice(b, {size}).to(m.device()));
        const_cast<Tensor&>(seg.exp_avg_sq).copy_from(exp_avg_sq.slice(b, {size}).to(m.device()));
        if (m.flat_params().dtype() != DType::f32)  // f32: the master is the parameters
          const_cast<Tensor&>(seg.master).copy_from(values.slice(b, {size}).to(m.device()));
      }
    }
    if (trainer == nullptr || options.finetune) return;
    // Megatron: the iteration (and with it the LR schedule and the data position) continues
    // unless --finetune; --no-load-optim starts only the optimizer afresh.
    loop.consumed_samples = meta.at("consumed_samples").get<int64_t>();
    loop.device_seconds = meta.value("device_seconds", 0.0);
    loop.skipped_train_samples = meta.value("skipped_train_samples", int64_t(0));
    loop.consumed_valid_samples = meta.value("consumed_valid_samples", int64_t(-1));
    const json& t = meta.at("trainer");
    const auto steps = t.at("iteration").get<int64_t>();
    const auto skipped = t.at("skipped_iterations").get<int64_t>();
    // Checkpoints before update_samples had no ramps: every update was a full batch.
    const int64_t update_samples = t.contains("update_samples")
                                       ? t.at("update_samples").get<int64_t>()
                                       : (steps - skipped) * trainer->config().global_batch_size;
    trainer->set_iterations(steps, skipped, update_samples, loop.consumed_samples);
    if (with_optim) {
      trainer->optimizer().set_step(t.at("optimizer_steps").get<int64_t>());
      const json& s = meta.at("loss_scaler");
      trainer->loss_scaler().load_state({s.at("scale").get<float>(),
                                         s.at("growth_tracker").get<int>(),
                                         s.at("hysteresis_tracker").get<int>()});
    }
    // The masks continue from the data position (set_iterations) under the saved seed. (Older
    // saves also hold "dropout_forwards", the count of forwards their masks followed: unused.)
    if (with_rng && meta.contains("rng")) {
      for (int c = 0; c < model.num_chunks(); ++c)
        model.chunk(c).set_dropout_seed(meta.at("rng").at("seed").get<uint64_t>());
    }
  };
  on_every_rank(model, "loading the checkpoint", [&] {
    try {
      load();
    } catch (const json::exception& e) {  // a metadata.json edited or written by something else
      BRAID_CONFIG_CHECK(false, "checkpoint ", dir, ": its ", kMetadata,
                         " lacks a field or holds one of another type (", e.what(), ")");
    }
  });
  barrier(model);
  return loop;
}

}  // namespace

LoopState load_checkpoint(const std::string& dir, Trainer& trainer, const LoadOptions& options) {
  return load_into(dir, trainer.model(), &trainer, options);
}

void load_parameters(const std::string& dir, ParallelModel& model, int64_t iteration) {
  LoadOptions options;
  options.load_optim = options.load_rng = false;
  options.finetune = true;
  options.iteration = iteration;
  load_into(dir, model, nullptr, options);
}

}  // namespace braid::engine
