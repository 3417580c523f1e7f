#include "braid/core/dtype.h"

#include <cmath>

#include "braid/core/error.h"

namespace braid {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
    case DType::f16:
      return 2;
    case DType::i64:
      return 8;
    case DType::u8:
      return 1;
  }
  BRAID_FAIL("unknown dtype code ", int(t));
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32:
      return "f32";
    case DType::bf16:
      return "bf16";
    case DType::f16:
      return "f16";
    case DType::i32:
      return "i32";
    case DType::i64:
      return "i64";
    case DType::u8:
      return "u8";
  }
  return "?";
}

DType dtype_from_name(std::string_view name) {
  for (DType t : {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8})
    if (name == dtype_name(t)) return t;
  if (name == "float32" || name == "fp32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  if (name == "float16" || name == "fp16") return DType::f16;
  BRAID_CONFIG_CHECK(false, "unknown dtype '", name, "' (expected f32, bf16, f16, i32, i64 or u8)");
  return DType::f32;
}

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

Device device_from_name(std::string_view name) {
  if (name == "cpu") return Device::cpu();
  if (name == "cuda") return Device::cuda(0);
  if (name.starts_with("cuda:")) {
    std::string idx(name.substr(5));
    BRAID_CONFIG_CHECK(!idx.empty() && idx.find_first_not_of("0123456789") == std::string::npos,
                       "bad device '", name, "' (expected cpu, cuda or cuda:N)");
    return Device::cuda(std::stoi(idx));
  }
  BRAID_CONFIG_CHECK(false, "bad device '", name, "' (expected cpu, cuda or cuda:N)");
  return Device::cpu();
}

float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t mant = h & 0x3ff;
  uint32_t u;
  if (exp == 0) {
    if (mant == 0) {
      u = sign;
    } else {  // subnormal: renormalise
      float f = std::ldexp(float(mant), -24);
      std::memcpy(&u, &f, 4);
      u |= sign;
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (mant << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint16_t float_to_f16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00;  // overflow to inf
  if (abs < 0x38800000u) {                       // subnormal or zero in f16
    float a;
    std::memcpy(&a, &abs, 4);
    return sign | uint16_t(std::nearbyint(a * 16777216.0f));  // a / 2^-24, round to even
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return sign | uint16_t((rounded - 0x38000000u) >> 13);
}

}  // namespace braid
