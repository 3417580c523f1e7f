// The C++ side of tests/python/ckpt/test_safetensors_interop.py.
//
//   safetensors_tool write <out>       a fixed sample: every braid dtype, an empty and a 0-dim
//                                      tensor, raw I8 bytes, metadata (values: see sample())
//   safetensors_tool dump <in>         JSON on stdout: metadata, and each tensor's dtype,
//                                      shape and bytes in hex (read() for braid dtypes)
//   safetensors_tool copy <in> <out>   read every tensor and the metadata, write them again
// Errors (a braid::Error) go to stderr with exit status 1.

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "braid/ckpt/safetensors.h"

namespace {

using braid::DType;
using braid::Tensor;
using braid::ckpt::SafetensorsFile;
using braid::ckpt::SafetensorsWriter;

// Element i is scale * i + offset; the Python test computes the same.
Tensor filled(const braid::Shape& shape, DType dtype, double scale, double offset) {
  Tensor t = Tensor::empty(shape, dtype);
  for (int64_t i = 0; i < t.numel(); ++i) t.set_item(i, scale * double(i) + offset);
  return t;
}

void write_sample(const std::string& out) {
  SafetensorsWriter w;
  w.add("f32", filled({3, 4}, DType::f32, 0.5, -3));
  w.add("bf16", filled({2, 3, 1}, DType::bf16, 0.25, -3));
  w.add("f16", filled({7}, DType::f16, 0.125, -3));
  w.add("i32", filled({2, 2}, DType::i32, 100000, -3));
  w.add("i64", filled({5}, DType::i64, 1e12, -3));
  w.add("u8", filled({9}, DType::u8, 7, 0));
  w.add("empty", Tensor::empty({0, 3}, DType::f32));
  w.add("scalar", filled({}, DType::f32, 0, -1.5));
  const int64_t shape[] = {2, 3};
  const uint8_t raw[] = {253, 254, 255, 0, 1, 2};  // int8 -3 .. 2
  w.add_bytes("raw_i8", "I8", shape, raw);
  w.set_metadata("format", "pt");
  w.set_metadata("step", "42");
  w.set_metadata("note", "quotes \" backslash \\ newline \n unicode \xc3\xa9");
  w.write(out);
}

std::string hex(const void* data, size_t n) {
  static const char* digits = "0123456789abcdef";
  std::string s;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

void dump(const std::string& in) {
  SafetensorsFile f = SafetensorsFile::open(in);
  nlohmann::ordered_json out;
  out["metadata"] = f.metadata();
  out["tensors"] = nlohmann::ordered_json::object();
  for (const std::string& name : f.names()) {
    const auto& info = f.info(name);
    nlohmann::ordered_json t;
    t["dtype"] = info.dtype;
    t["shape"] = info.shape;
    if (braid::ckpt::braid_dtype(info.dtype) && info.shape.size() <= size_t(braid::kMaxDims)) {
      Tensor x = f.read(name);
      t["hex"] = hex(x.data(), x.nbytes());
    } else {
      auto b = f.bytes(name);
      t["hex"] = hex(b.data(), b.size());
    }
    out["tensors"][name] = std::move(t);
  }
  std::cout << out.dump() << "\n";
}

void copy(const std::string& in, const std::string& out) {
  SafetensorsFile f = SafetensorsFile::open(in);
  SafetensorsWriter w;
  std::vector<Tensor> keep;
  for (const std::string& name : f.names()) {
    const auto& info = f.info(name);
    if (braid::ckpt::braid_dtype(info.dtype) && info.shape.size() <= size_t(braid::kMaxDims)) {
      w.add(name, f.read(name));
    } else {
      w.add_bytes(name, info.dtype, info.shape, f.bytes(name));
    }
  }
  for (const auto& [k, v] : f.metadata()) w.set_metadata(k, v);
  w.write(out);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  try {
    if (args.size() == 2 && args[0] == "write") {
      write_sample(args[1]);
    } else if (args.size() == 2 && args[0] == "dump") {
      dump(args[1]);
    } else if (args.size() == 3 && args[0] == "copy") {
      copy(args[1], args[2]);
    } else {
      std::fprintf(stderr, "usage: safetensors_tool write <out> | dump <in> | copy <in> <out>\n");
      return 2;
    }
  } catch (const braid::Error& e) {
    std::fprintf(stderr, "safetensors_tool: %s\n", e.message().c_str());
    return 1;
  }
  return 0;
}
