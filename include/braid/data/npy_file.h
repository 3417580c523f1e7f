#pragma once
// numpy's .npy format (version 1.0) for the cached dataset indices: numpy.load(path,
// mmap_mode="r") reads what braid writes, and braid maps what it wrote without a copy.
//
// Header: "\x93NUMPY", 1, 0, a little-endian uint16 length, then a Python dict literal
// {'descr': '<i8', 'fortran_order': False, 'shape': (n, 2), } padded with spaces and a newline
// so that the data starts at a multiple of 64 bytes.

#include <string>

#include "braid/core/tensor.h"

namespace braid::data {

// Writes a CPU tensor (f32, i32, i64, u8) to `path` (no temporary name: see atomic_write in
// index_cache.h). Error (RuntimeError) when the file cannot be written.
void write_npy(const std::string& path, const Tensor& tensor);

// Maps `path` copy-on-write: the tensor's memory is the file's pages (writes through it stay
// private to the process and never reach the file). ConfigError for a file that is not a C-order
// .npy of a supported dtype or is shorter than its header says.
Tensor read_npy(const std::string& path);

}  // namespace braid::data
