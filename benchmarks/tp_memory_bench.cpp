// tp_memory_bench: the activation bytes one transformer layer keeps for its backward, per
// rank, under tensor parallelism (tp = the job's size), with and without sequence
// parallelism, for Recompute::none and Recompute::selective, next to Korthikanti et al. 2022
// ("Reducing Activation Recomputation in Large Transformer Models") per-layer formulas.
//
//   mpirun -np 4 build/benchmarks/tp_memory_bench [--hidden 1024 --heads 16 --seq 512
//       --batch 1 --ffn 4096 --vocab 1024 --dropout 0.1]
//
// Method: for each configuration, GPT models with 1 and with 2 layers run one training
// forward each; what the forward leaves allocated (braid's CPU allocator, current bytes
// after forward minus before) is what the microbatch keeps for backward. The 2-layer figure
// minus the 1-layer one is one layer's share: the embedding, final norm, logits and
// cross-entropy statistics cancel out.
//
// The CPU runs f32 activations, so "measured" is in f32 bytes and is compared with the
// formula ×2 (Korthikanti counts 16-bit activations and 1-byte dropout masks; ×2 scales
// all of it). "expected" is braid's own accounting of LayerActivations (transformer_layer.h)
// in f32; "exp16" is the same accounting with 16-bit activations and f32 statistics (norm
// mean/rstd, attention lse), i.e. what a bf16 run keeps, and "exp16/formula" compares it
// with the unscaled formula; "exp16/f_noattn" with the formula less its 5as/h term (the
// attention matrix, which braid's flash-style attention never stores). See docs/memory.md.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "braid/comm/launch.h"
#include "braid/core/allocator.h"
#include "braid/core/error.h"
#include "braid/model/gpt_model.h"

using namespace braid;
using namespace braid::model;

namespace {

struct Options {
  int64_t hidden = 1024, heads = 16, seq = 512, batch = 1, ffn = 0, vocab = 1024;
  float dropout = 0.1f;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf(
          "tp_memory_bench [--hidden H] [--heads A] [--seq S] [--batch B] [--ffn F] "
          "[--vocab V] [--dropout P]\n");
      std::exit(0);
    }
    if (i + 1 >= argc)
      throw ConfigError("tp_memory_bench: " + a + " needs a value", __FILE__, __LINE__);
    const char* v = argv[++i];
    if (a == "--hidden")
      o.hidden = std::atoll(v);
    else if (a == "--heads")
      o.heads = std::atoll(v);
    else if (a == "--seq")
      o.seq = std::atoll(v);
    else if (a == "--batch")
      o.batch = std::atoll(v);
    else if (a == "--ffn")
      o.ffn = std::atoll(v);
    else if (a == "--vocab")
      o.vocab = std::atoll(v);
    else if (a == "--dropout")
      o.dropout = float(std::atof(v));
    else
      throw ConfigError("tp_memory_bench: unknown option " + a, __FILE__, __LINE__);
  }
  if (o.ffn == 0) o.ffn = 4 * o.hidden;
  return o;
}

TransformerConfig config_of(const Options& o, int64_t layers, Recompute policy) {
  TransformerConfig c = TransformerConfig::preset("gpt2-124m");  // layernorm, gelu, learned pos
  c.num_layers = layers;
  c.hidden_size = o.hidden;
  c.num_attention_heads = o.heads;
  c.num_query_groups = 0;
  c.ffn_hidden_size = o.ffn;
  c.vocab_size = o.vocab;
  c.max_position_embeddings = o.seq;
  c.hidden_dropout = o.dropout;
  c.recompute = policy;
  return c;
}

// Bytes one forward of `layers` layers leaves allocated on this rank.
int64_t kept_bytes(const Options& o, int64_t layers, Recompute policy, comm::Communicator* group,
                   bool sp) {
  const TransformerConfig config = config_of(o, layers, policy);
  GPTModel model(config, Device::cpu(), 1234, TensorParallel{group, sp});
  Tensor ids = Tensor::empty({o.batch, o.seq}, DType::i32);
  Tensor targets = Tensor::empty({o.batch, o.seq}, DType::i32);
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (int64_t i = 0; i < o.batch * o.seq; ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    ids.data_ptr<int32_t>()[i] = int32_t(x % uint64_t(o.vocab));
  }
  for (int64_t i = 0; i < o.batch * o.seq; ++i)
    targets.data_ptr<int32_t>()[i] = (i % o.seq == o.seq - 1) ? -1 : ids.data_ptr<int32_t>()[i + 1];
  const int64_t before = memory_stats(Device::cpu()).current_bytes;
  model.forward(ids, targets, 0);
  const int64_t after = memory_stats(Device::cpu()).current_bytes;
  return after - before;  // the model's destructor frees the microbatch
}

// braid's LayerActivations (transformer_layer.h) for one layer, elem = bytes per activation
// value; statistics (norm mean/rstd, lse) are always f32.
double expected_bytes(const Options& o, int t, bool sp, Recompute policy, double elem) {
  const double T = double(o.batch * o.seq);
  const double R = (sp && t > 1) ? T / t : T;  // residual-stream region tokens
  const double H = double(o.hidden), Hq = double(o.heads / t), D = double(o.hidden / o.heads);
  const double F = double(o.ffn / t);
  const double input = R * H * elem, mid = R * H * elem;
  const double qkv = 3 * T * Hq * D * elem, attn_out = T * Hq * D * elem;
  const double lse = T * Hq * 4.0;
  const double fc1 = T * F * elem;
  const double norm_out = R * H * elem, stats = 2 * R * 4.0;  // layernorm: mean + rstd
  const double act = T * F * elem;
  double b = input + qkv + attn_out + lse + mid + fc1;  // selective keeps these
  if (policy == Recompute::none) b += 2 * (norm_out + stats) + act;
  return b;
}

// Korthikanti et al. 2022, bytes per layer with 16-bit activations (Table 2).
// attention_matrix = false drops the 5as/h term (softmax output, its dropout mask and the
// dropout output: what flash-style attention never stores).
double formula_bytes(const Options& o, int t, bool sp, Recompute policy,
                     bool attention_matrix = true) {
  const double s = double(o.seq), b = double(o.batch), h = double(o.hidden), a = double(o.heads);
  const double sbh = s * b * h, attn = attention_matrix ? 5 * a * s / h : 0.0;
  const bool sel = policy == Recompute::selective;
  if (t == 1) return sbh * (34 + (sel ? 0 : attn));
  if (sp) return sbh / t * (34 + (sel ? 0 : attn));
  return sbh * (10 + 24.0 / t + (sel ? 0 : attn / t));
}

}  // namespace

int main(int argc, char** argv) {
  return comm::run_main([&] {
    const Options o = parse(argc, argv);
    comm::Distributed dist = comm::init_distributed();
    comm::MpiCommunicator& world = *dist.world;
    const int t = world.size();
    const bool root = world.rank() == 0;
    if (root) {
      std::printf(
          "# braid tp_memory_bench: tp %d, s %lld b %lld h %lld a %lld ffn %lld, layernorm gelu, "
          "hidden_dropout %g, f32 activations (CPU)\n"
          "# bytes per layer per rank kept for backward = kept(L=2) - kept(L=1); formula: "
          "Korthikanti et al. 2022 (16-bit)\n",
          t, (long long)o.seq, (long long)o.batch, (long long)o.hidden, (long long)o.heads,
          (long long)o.ffn, double(o.dropout));
      std::printf("%3s %3s %-10s %14s %14s %8s %14s %8s %14s %14s %8s %14s\n", "tp", "sp",
                  "recompute", "measured_f32", "formula_x2", "meas/fx2", "expected_f32", "meas/exp",
                  "exp16", "formula16", "exp16/f", "exp16/f_noattn");
    }
    for (bool sp : {false, true}) {
      if (sp && t == 1) continue;  // one rank: sequence parallelism changes nothing
      for (Recompute policy : {Recompute::none, Recompute::selective}) {
        const int64_t one = kept_bytes(o, 1, policy, &world, sp);
        const int64_t two = kept_bytes(o, 2, policy, &world, sp);
        const double measured = double(two - one);
        const double formula = formula_bytes(o, t, sp, policy);
        const double expected = expected_bytes(o, t, sp, policy, 4.0);
        const double exp16 = expected_bytes(o, t, sp, policy, 2.0);
        // Rank 0 prints; every rank checks it saw the same figure (shards are equal-sized).
        Tensor m = Tensor::empty({1}, DType::i64), g = Tensor::empty({t}, DType::i64);
        m.data_ptr<int64_t>()[0] = two - one;
        world.all_gather(m, g)->wait();
        bool same = true;
        for (int r = 0; r < t; ++r) same = same && g.data_ptr<int64_t>()[r] == two - one;
        if (root) {
          std::printf(
              "%3d %3d %-10s %14.0f %14.0f %8.3f %14.0f %8.3f %14.0f %14.0f %8.3f %14.3f%s\n", t,
              int(sp), to_string(policy), measured, 2 * formula, measured / (2 * formula), expected,
              measured / expected, exp16, formula, exp16 / formula,
              exp16 / formula_bytes(o, t, sp, policy, false), same ? "" : "  (ranks differ)");
          std::fflush(stdout);
        }
      }
    }
    return 0;
  });
}
