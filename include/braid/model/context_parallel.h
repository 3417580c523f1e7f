#pragma once
// Context parallelism (Megatron's --context-parallel-size): every sequence of S tokens is split
// over the cp ranks of a CP group, balanced for causal attention as Megatron and Transformer
// Engine balance it: the sequence is cut into 2·cp chunks of L = S / (2 cp) positions, and rank
// r holds chunks r and 2cp − 1 − r, so that every rank's queries see the same number of keys.
//
// A rank holds its tokens chunk-major: the first chunk of each of the B sequences, then their
// second chunk — a region of Tokens{2B, L} whose row j·B + b is local chunk j of sequence b. So
// every op but attention (norms, GEMMs, activations, dropout, the cross-entropy: all per token)
// runs on the local tokens exactly as it runs on all of them, and rope and learned positions
// only need each chunk's first position.
//
// Attention gathers the keys and values of the whole sequence over the group (all-gather, the
// scheme Llama 3 trained with) and runs each local chunk's queries against the keys up to the
// chunk's end (ops::attention_forward with Sq < Sk). Backward sums every rank's key and value
// gradients back to the ranks that hold those positions (reduce-scatter). Every parameter
// gradient is partial over the group: the data-parallel reduction sums it (the DP×CP group,
// comm/parallel_state.h).

#include <cstdint>

#include "braid/comm/communicator.h"
#include "braid/core/tensor.h"
#include "braid/kernels/ops.h"

namespace braid::model {

struct ContextParallel {
  comm::Communicator* group = nullptr;  // the CP group; nullptr: no context parallelism

  int size() const { return group != nullptr ? group->size() : 1; }
  int rank() const { return group != nullptr ? group->rank() : 0; }
  bool active() const { return size() > 1; }
  // The sequence chunk (of 2·size) that local chunk j (0 or 1) of CP rank `rank` is.
  static int64_t chunk_of(int rank, int size, int j) { return j == 0 ? rank : 2 * size - 1 - rank; }
  int64_t chunk(int j) const { return chunk_of(rank(), size(), j); }
  // The position of element `i` of the flattened local region [2B, L] of B sequences.
  int64_t position(int64_t i, int64_t batch, int64_t chunk_length) const {
    const int64_t row = i / chunk_length;
    return chunk(int(row / batch)) * chunk_length + i % chunk_length;
  }
};

// ids or targets [B, S] (any dtype, any device) -> this rank's [2B, S / (2 cp)], chunk-major.
// ConfigError unless S divides into 2·cp chunks.
Tensor split_sequence(const ContextParallel& cp, const Tensor& full);

// Local keys or values [2B, L, H, D] -> those of the whole sequences [B, S, H, D], in position
// order (an all-gather over the group).
Tensor gather_sequence(const ContextParallel& cp, const Tensor& local);

// Gradients [B, S, H, D] that each rank holds partially -> this rank's positions [2B, L, H, D],
// summed over the group (a reduce-scatter).
Tensor scatter_sequence(const ContextParallel& cp, const Tensor& full);

// Causal attention of the local queries q [2B, L, Hq, D] over the whole sequences' keys and
// values k, v [B, S, Hkv, D] (gather_sequence): each local chunk against the keys up to its end,
// from the first its window reaches (ops::attention_forward's window; -1: from the start), and
// with key_start (i32 [B, S], document masking: ops::attention_forward's, over the whole
// sequences) from the query's document's first. out [2B, L, Hq, D]; lse [2B, Hq, L] f32.
// Attention dropout (`dropout`: first_sequence the microbatch's first sequence, first_position
// 0) draws the mask of the whole sequences: each chunk's at its sequence and positions.
void context_attention_forward(const ContextParallel& cp, Tensor out, Tensor lse, const Tensor& q,
                               const Tensor& k, const Tensor& v, int64_t window,
                               const Tensor& key_start = {},
                               const ops::AttentionDropout& dropout = {});
// dq [2B, L, Hq, D]; dk, dv [B, S, Hkv, D] f32: this rank's queries' share of the key and
// value gradients, summed in f32 (scatter_sequence sums the ranks' shares, in f32 too, so a
// key's gradient is rounded to the activation dtype once, as without CP).
void context_attention_backward(const ContextParallel& cp, Tensor dq, Tensor dk, Tensor dv,
                                const Tensor& dout, const Tensor& q, const Tensor& k,
                                const Tensor& v, const Tensor& out, const Tensor& lse,
                                int64_t window, const Tensor& key_start = {},
                                const ops::AttentionDropout& dropout = {});

}  // namespace braid::model
