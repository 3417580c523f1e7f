// CRC-32C: the crc32 instruction of SSE4.2 eight bytes at a time where the CPU has it, else a
// 256-entry table (built once from the reflected polynomial 0x82F63B78).

#include "braid/ckpt/crc32c.h"

#include <array>
#include <cstring>

namespace braid::ckpt {

namespace {

constexpr uint32_t kReflectedPolynomial = 0x82F63B78u;

constexpr std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int bit = 0; bit < 8; ++bit) c = (c >> 1) ^ ((c & 1u) ? kReflectedPolynomial : 0u);
    table[i] = c;
  }
  return table;
}

constexpr std::array<uint32_t, 256> kTable = make_table();

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(std::span<const uint8_t> data,
                                                        uint32_t crc) {
  uint64_t c = ~crc;
  const uint8_t* p = data.data();
  size_t n = data.size();
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
  }
  uint32_t c32 = uint32_t(c);
  for (; n > 0; ++p, --n) c32 = __builtin_ia32_crc32qi(c32, *p);
  return ~c32;
}

bool has_sse42() {
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
}
#endif

}  // namespace

namespace detail {
uint32_t crc32c_table(std::span<const uint8_t> data, uint32_t crc) {
  uint32_t c = ~crc;
  for (uint8_t byte : data) c = kTable[(c ^ byte) & 0xFFu] ^ (c >> 8);
  return ~c;
}
}  // namespace detail

uint32_t crc32c(std::span<const uint8_t> data, uint32_t crc) {
#if defined(__x86_64__)
  if (has_sse42()) return crc32c_sse42(data, crc);
#endif
  return detail::crc32c_table(data, crc);
}

}  // namespace braid::ckpt
