#pragma once
// Shared by the safetensors parser and writer (csrc/ckpt only).

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace braid::ckpt {

// The dtype's place in the Python library's order (the writer puts higher ones first); -1:
// unknown.
int dtype_rank(std::string_view dtype);
// numel * itemsize, or nullopt when a dim is negative or the product overflows 64 bits.
std::optional<uint64_t> byte_size(std::span<const int64_t> shape, uint64_t itemsize);
std::string shape_str(std::span<const int64_t> shape);  // "[2, 3]"

}  // namespace braid::ckpt
