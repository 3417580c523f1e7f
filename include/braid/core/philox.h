#pragma once
// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11),
// the counter-based generator braid uses on every device: the same (key, counter) gives
// the same four words on the CPU and in a CUDA kernel, so random streams never depend on
// how work is split across threads, devices or ranks.

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define BRAID_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define BRAID_HOST_DEVICE inline
#endif

namespace braid::philox {

struct Words4 {
  uint32_t x[4];
};

BRAID_HOST_DEVICE void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  uint64_t p = uint64_t(a) * uint64_t(b);
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
}

// Ten rounds of Philox4x32 on `counter` with `key`.
BRAID_HOST_DEVICE Words4 philox4x32(Words4 counter, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo(kM0, counter.x[0], hi0, lo0);
    mulhilo(kM1, counter.x[2], hi1, lo1);
    counter = Words4{{hi1 ^ counter.x[1] ^ key0, lo1, hi0 ^ counter.x[3] ^ key1, lo0}};
    key0 += kW0;
    key1 += kW1;
  }
  return counter;
}

// Four words for element `index` of stream `stream` under `seed`.
BRAID_HOST_DEVICE Words4 random_words(uint64_t seed, uint64_t stream, uint64_t index) {
  return philox4x32(
      Words4{{uint32_t(index), uint32_t(index >> 32), uint32_t(stream), uint32_t(stream >> 32)}},
      uint32_t(seed), uint32_t(seed >> 32));
}

// A uniform float in (0, 1]: 24 random bits, never zero (safe for log).
BRAID_HOST_DEVICE float uniform_from_word(uint32_t w) {
  return (float((w >> 8) + 1u)) * (1.0f / 16777216.0f);
}

// A standard normal from two words (Box-Muller, computed in double so that the CPU and
// CUDA results agree to the last bit of the float).
BRAID_HOST_DEVICE float normal_from_words(uint32_t w0, uint32_t w1) {
  double u1 = (double((w0 >> 8) + 1u)) * (1.0 / 16777216.0);
  double u2 = (double(w1 >> 8)) * (1.0 / 16777216.0);
  return float(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

// A stream id for part (a, b) of stream `stream` (splitmix64's finaliser, nested): the parts'
// streams are as unrelated as distinct seeds, for any 64-bit a and b (attention dropout's: one
// per run-wide sequence index and head of a dropout site).
BRAID_HOST_DEVICE uint64_t mix64(uint64_t x) {
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
BRAID_HOST_DEVICE uint64_t substream(uint64_t stream, uint64_t a, uint64_t b) {
  return mix64(stream ^ mix64(a ^ mix64(b ^ 0x9E3779B97F4A7C15ull)));
}

// FNV-1a of a name: the stream id of a parameter's initialisation.
constexpr uint64_t stream_of(const char* name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (const char* p = name; *p; ++p) h = (h ^ uint64_t(uint8_t(*p))) * 0x100000001b3ull;
  return h;
}

}  // namespace braid::philox
