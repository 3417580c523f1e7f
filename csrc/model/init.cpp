#include "braid/model/init.h"

#include <cmath>
#include <vector>

#include "braid/core/philox.h"

namespace braid::model {

InitRule init_rule(const ParamSpec& spec, const TransformerConfig& config) {
  const std::string& name = spec.name;
  auto ends_with = [&](const char* suffix) { return name.ends_with(suffix); };
  // Norm scales start at one: input_/post_attention_layernorm, model.norm, the q_norm and k_norm
  // of qk_layernorm (their weights at zero when they hold gamma - 1).
  if (ends_with("layernorm.weight") || ends_with("norm.weight"))
    return {config.zero_centered_gamma ? InitKind::zeros : InitKind::ones, 0};
  // The router's bias starts as its weight does (megatron-core's TopKRouter); the other biases
  // at zero. The attention sinks fall to the normal init_std below (megatron-core's, HF GPT-OSS's).
  if (ends_with("mlp.gate.bias")) return {InitKind::normal, config.init_std};
  if (ends_with(".bias")) return {InitKind::zeros, 0};
  if (is_embedding(spec) && config.embedding_init_std > 0)
    return {InitKind::normal, config.embedding_init_std};
  if (ends_with("o_proj.weight") || ends_with("down_proj.weight"))
    return {InitKind::normal,
            float(double(config.init_std) / std::sqrt(2.0 * double(config.num_layers)))};
  return {InitKind::normal, config.init_std};
}

void init_values(std::span<float> out, const ParamSpec& spec, const TransformerConfig& config,
                 uint64_t seed, int64_t start) {
  const int64_t n = int64_t(out.size());
  BRAID_CHECK(start >= 0 && start + n <= spec.shape.numel(), "init_values: elements [", start, ", ",
              start + n, ") out of range for ", spec.name, " ", spec.shape);
  const InitRule rule = init_rule(spec, config);
  if (rule.kind != InitKind::normal) {
    const float fill = rule.kind == InitKind::ones ? 1.0f : 0.0f;
    for (float& x : out) x = fill;
    return;
  }
  const uint64_t stream = philox::stream_of(spec.name.c_str());
  float* data = out.data();
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
  for (int64_t i = 0; i < n; ++i) {
    philox::Words4 w = philox::random_words(seed, stream, uint64_t(start + i));
    data[i] = rule.std * philox::normal_from_words(w.x[0], w.x[1]);
  }
}

void init_parameter(Tensor value, const ParamSpec& spec, const TransformerConfig& config,
                    uint64_t seed, int64_t start) {
  const int64_t n = value.numel();
  std::vector<float> host(static_cast<size_t>(n));
  init_values(host, spec, config, seed, start);
  Tensor staged;
  if (value.dtype() == DType::f32) {
    staged = Tensor::from_blob(host.data(), value.shape(), DType::f32, Device::cpu());
  } else {
    BRAID_CHECK(value.dtype() == DType::bf16, "init_parameter: ", spec.name, " is ",
                dtype_name(value.dtype()), " (expected f32 or bf16)");
    staged = Tensor::empty(value.shape(), DType::bf16);
    uint16_t* bits = staged.data_ptr<uint16_t>();
    for (int64_t i = 0; i < n; ++i) bits[i] = float_to_bf16(host[size_t(i)]);
  }
  value.copy_from(staged);  // host copies are complete when copy_from returns
}

}  // namespace braid::model
