#pragma once
// Element types, devices and the 16-bit float conversions used on the host.

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace braid {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8 };

size_t dtype_size(DType t);
const char* dtype_name(DType t);
DType dtype_from_name(std::string_view name);  // ConfigError on an unknown name
inline bool is_floating(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int index = 0) { return {DeviceKind::cuda, index}; }
  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool is_cuda() const { return kind == DeviceKind::cuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu" or "cuda:0"
};

Device device_from_name(std::string_view name);  // "cpu", "cuda", "cuda:1"; ConfigError otherwise

// Host-side 16-bit float conversions (round to nearest even; NaN stays NaN).
inline float bf16_to_float(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

float f16_to_float(uint16_t bits);
uint16_t float_to_f16(float f);

}  // namespace braid
