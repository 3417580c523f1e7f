#pragma once
// numpy's legacy generator, numpy.random.RandomState(seed): MT19937 with numpy's bounded-integer
// rule and its Fisher-Yates shuffle. Megatron builds every GPT index with
// RandomState(seed).shuffle, so the same words give braid exactly Megatron's document order and
// sample order for a given seed: a run that moves from Megatron to braid sees the same data.
//
// Seeding an integer in [0, 2^32) is MT19937's init_genrand, i.e. std::mt19937(seed); numpy's
// RandomState.shuffle(x) swaps x[i] with x[random_interval(i)] for i = n-1 down to 1.

#include <cstdint>
#include <random>
#include <span>
#include <utility>

namespace braid::data {

class NumpyRandomState {
 public:
  explicit NumpyRandomState(uint32_t seed) : mt_(seed) {}

  uint32_t next32() { return uint32_t(mt_()); }
  // numpy's next_uint64 for MT19937: the first word is the high half.
  uint64_t next64() {
    uint64_t hi = next32();
    return (hi << 32) | next32();
  }

  // A uniform integer in [0, max] by numpy's rule (random_interval): draw under the smallest
  // all-ones mask that covers max, retry above max.
  uint64_t interval(uint64_t max) {
    if (max == 0) return 0;
    uint64_t mask = max;
    for (int shift = 1; shift <= 32; shift *= 2) mask |= mask >> shift;
    uint64_t value;
    if (max <= 0xffffffffull) {
      while ((value = (next32() & mask)) > max) {
      }
    } else {
      while ((value = (next64() & mask)) > max) {
      }
    }
    return value;
  }

  // RandomState.shuffle of a 1-D array, in place.
  template <typename T>
  void shuffle(std::span<T> x) {
    for (size_t i = x.size(); i-- > 1;) std::swap(x[i], x[size_t(interval(i))]);
  }

 private:
  std::mt19937 mt_;
};

}  // namespace braid::data
