#include "braid/model/context_parallel.h"

#include <algorithm>
#include <span>
#include <vector>

#include "braid/core/error.h"
#include "braid/kernels/ops.h"

namespace braid::model {
namespace {

// The shape of `t` with its first two dims replaced by `rows` and `length`.
Shape with_rows(const Tensor& t, int64_t rows, int64_t length) {
  std::vector<int64_t> dims(t.shape().begin(), t.shape().end());
  dims[0] = rows;
  dims[1] = length;
  return Shape(std::span<const int64_t>(dims));
}

// Positions [first, first + length) of row `row` of a [rows, seq, ...] tensor, as
// [1, length, ...].
Tensor positions(const Tensor& t, int64_t row, int64_t first, int64_t length) {
  const int64_t width = t.numel() / (t.size(0) * t.size(1));  // elements per position
  return t.slice((row * t.size(1) + first) * width, with_rows(t, 1, length));
}

// Calls f(r, j, i, chunk) for local chunk j of sequence i of every CP rank r: `chunk` is the
// sequence chunk it holds.
template <typename F>
void for_each_chunk(int ranks, int64_t batch, F&& f) {
  for (int r = 0; r < ranks; ++r)
    for (int j = 0; j < 2; ++j)
      for (int64_t i = 0; i < batch; ++i) f(r, j, i, ContextParallel::chunk_of(r, ranks, j));
}

}  // namespace

Tensor split_sequence(const ContextParallel& cp, const Tensor& full) {
  const int64_t b = full.size(0), s = full.size(1), parts = 2 * int64_t(cp.size());
  BRAID_CONFIG_CHECK(s % parts == 0, "context parallelism: the sequence length (", s,
                     ") is not divisible by 2 × --context-parallel-size (", cp.size(),
                     ") = ", parts);
  const int64_t len = s / parts;
  Tensor local = Tensor::empty(with_rows(full, 2 * b, len), full.dtype(), full.device());
  for (int j = 0; j < 2; ++j) {
    for (int64_t i = 0; i < b; ++i)
      positions(local, j * b + i, 0, len).copy_from(positions(full, i, cp.chunk(j) * len, len));
  }
  return local;
}

Tensor gather_sequence(const ContextParallel& cp, const Tensor& local) {
  const int64_t rows = local.size(0), b = rows / 2, len = local.size(1);
  const int ranks = cp.size();
  Tensor gathered =
      Tensor::empty(with_rows(local, ranks * rows, len), local.dtype(), local.device());
  cp.group->all_gather(local, gathered)->wait();
  Tensor full = Tensor::empty(with_rows(local, b, 2 * ranks * len), local.dtype(), local.device());
  for_each_chunk(ranks, b, [&](int r, int j, int64_t i, int64_t chunk) {
    positions(full, i, chunk * len, len)
        .copy_from(positions(gathered, r * rows + j * b + i, 0, len));
  });
  return full;
}

Tensor scatter_sequence(const ContextParallel& cp, const Tensor& full) {
  const int ranks = cp.size();
  const int64_t b = full.size(0), rows = 2 * b, len = full.size(1) / (2 * ranks);
  Tensor by_rank = Tensor::empty(with_rows(full, ranks * rows, len), full.dtype(), full.device());
  for_each_chunk(ranks, b, [&](int r, int j, int64_t i, int64_t chunk) {
    positions(by_rank, r * rows + j * b + i, 0, len)
        .copy_from(positions(full, i, chunk * len, len));
  });
  Tensor local = Tensor::empty(with_rows(full, rows, len), full.dtype(), full.device());
  cp.group->reduce_scatter(by_rank, local)->wait();
  return local;
}

namespace {

// The pieces of one local chunk of one sequence: its queries (and what has their shape) as
// [1, L, ...], its log-sum-exp [1, Hq, L], and the keys its queries see [1, P, ...]: those
// from the first the chunk's first query's window reaches to the chunk's end (from 0 with
// document masking, whose key_start holds positions of the whole sequence). The queries are
// the last L of those P positions, as ops::attention_forward aligns them.
struct ChunkView {
  int64_t row, sequence, first_key, end_key;  // row of the local [2B, L] region; keys [first, end)
  Tensor rows(const Tensor& t) const { return positions(t, row, 0, t.size(1)); }
  Tensor lse(const Tensor& t) const {
    return t.slice(row * t.size(1) * t.size(2), {1, t.size(1), t.size(2)});
  }
  Tensor keys(const Tensor& t) const {
    return positions(t, sequence, first_key, end_key - first_key);
  }
  // The sequence's row [1, S] of key_start [B, S] (undefined when it is).
  Tensor key_start(const Tensor& t) const {
    return t.defined() ? t.slice(sequence * t.size(1), {1, t.size(1)}) : Tensor();
  }
  // The whole sequences' dropout mask at this chunk's sequence and keys.
  ops::AttentionDropout dropout(ops::AttentionDropout d) const {
    d.first_sequence += sequence;
    d.first_position += first_key;
    return d;
  }
};

template <typename F>
void for_each_local_chunk(const ContextParallel& cp, const Tensor& q, int64_t window,
                          const Tensor& key_start, F&& f) {
  const int64_t b = q.size(0) / 2, len = q.size(1);
  for (int j = 0; j < 2; ++j) {
    const int64_t start = cp.chunk(j) * len;
    const int64_t first =
        window < 0 || key_start.defined() ? 0 : std::max<int64_t>(0, start - window);
    for (int64_t i = 0; i < b; ++i) f(ChunkView{j * b + i, i, first, start + len});
  }
}

}  // namespace

void context_attention_forward(const ContextParallel& cp, Tensor out, Tensor lse, const Tensor& q,
                               const Tensor& k, const Tensor& v, int64_t window,
                               const Tensor& key_start, const ops::AttentionDropout& dropout) {
  for_each_local_chunk(cp, q, window, key_start, [&](const ChunkView& c) {
    ops::attention_forward(c.rows(out), c.lse(lse), c.rows(q), c.keys(k), c.keys(v), window,
                           c.key_start(key_start), c.dropout(dropout));
  });
}

void context_attention_backward(const ContextParallel& cp, Tensor dq, Tensor dk, Tensor dv,
                                const Tensor& dout, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& out, const Tensor& lse,
                                int64_t window, const Tensor& key_start,
                                const ops::AttentionDropout& dropout) {
  dk.zero_();
  dv.zero_();
  // Adds a chunk's share (the activation dtype) into the f32 sum.
  auto accumulate = [](Tensor sum, const Tensor& part) {
    Tensor part_f32 = part;
    if (part.dtype() != DType::f32) {
      part_f32 = Tensor::empty(part.shape(), DType::f32, part.device());
      ops::cast(part_f32, part);
    }
    ops::add(sum, sum, part_f32);
  };
  for_each_local_chunk(cp, q, window, key_start, [&](const ChunkView& c) {
    const Tensor k_seen = c.keys(k), v_seen = c.keys(v);
    Tensor dk_part = Tensor::empty(k_seen.shape(), k.dtype(), k.device());
    Tensor dv_part = Tensor::empty(v_seen.shape(), v.dtype(), v.device());
    ops::attention_backward(c.rows(dq), dk_part, dv_part, c.rows(dout), c.rows(q), k_seen, v_seen,
                            c.rows(out), c.lse(lse), window, c.key_start(key_start),
                            c.dropout(dropout));
    accumulate(c.keys(dk), dk_part);
    accumulate(c.keys(dv), dv_part);
  });
}

}  // namespace braid::model
